// The reshard command line: each command parses flags, calls one library function, and maps
// the result to an exit code and a short message. Exit codes: 0 success, 1 verification found
// problems, 2 the command line is wrong on its own (ErrorCode::kInvalidArgument), 3 the files
// refuse it (missing, corrupt or mismatched input, what OUT holds) or I/O failed; 128 + N after
// signal N (Ctrl-C: 130). README.
#include <fcntl.h>
#include <signal.h>
#include <cerrno>
#include <cstdlib>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <optional>
#include <string_view>
#include <cstdio>
#include <iostream>
#include <string>

#include <filesystem>
#include <fstream>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "reshard/base/cancel.h"
#include "reshard/base/error.h"
#include "reshard/base/human.h"
#include "reshard/format/layout.h"
#include "reshard/format/model_manifest.h"
#include "reshard/io/manifest.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/hf_cache.h"
#include "reshard/ops/build_info.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/export.h"
#include "reshard/ops/inspect.h"
#include "reshard/ops/relayout.h"
#include "reshard/ops/remove.h"
#include "reshard/ops/verify.h"

namespace {

constexpr int kExitProblems = 1;
constexpr int kExitUsage = 2;
constexpr int kExitFailed = 3;

// A whole decimal number that fits in uint32_t, nothing else (no sign, no spaces).
std::optional<uint32_t> ParseU32(std::string_view text) {
  uint32_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return v;
}

std::pair<uint32_t, uint32_t> ParseRankRange(const std::string& text) {
  const auto dash = text.find('-');
  auto a = ParseU32(std::string_view(text).substr(0, dash));
  auto b = dash == std::string::npos ? a : ParseU32(std::string_view(text).substr(dash + 1));
  if (!a || !b) {
    throw CLI::ValidationError("--ranks", "expected A-B (e.g. 0-3) or a single rank, got \"" +
                                              text + "\"");
  }
  return {*a, *b};
}

void ParseCompress(const std::string& text, reshard::ConvertOptions& o) {
  if (text.empty() || text == "none" || text == "raw") {
    o.codec = reshard::Codec::kRaw;
    return;
  }
  if (text.rfind("zstd", 0) != 0) {
    throw CLI::ValidationError("--compress", "expected zstd or zstd:LEVEL, got \"" + text + "\"");
  }
  o.codec = reshard::Codec::kZstd;
  if (text.size() > 4) {
    if (text[4] != ':') throw CLI::ValidationError("--compress", "expected zstd:LEVEL");
    auto level = ParseU32(std::string_view(text).substr(5));
    o.zstd_level = level ? static_cast<int>(*level) : 0;
    if (!level || *level < 1 || *level > 19) {
      throw CLI::ValidationError("--compress", "LEVEL must be 1-19");
    }
  }
}

std::string Bytes(double bytes) { return reshard::FormatBytes(bytes); }

// Rank files a re-run found damaged (the header as it would write it, the bytes not) and wrote again.
nlohmann::json DamagedJson(const std::vector<std::pair<uint32_t, std::string>>& damaged) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [rank, problem] : damaged) j.push_back({{"rank", rank}, {"problem", problem}});
  return j;
}
void PrintDamaged(const std::vector<std::pair<uint32_t, std::string>>& damaged) {
  for (const auto& [rank, problem] : damaged) {
    std::printf("rank %u: the file there was damaged, written again (%s)\n", rank, problem.c_str());
  }
}
std::string Rate(double bytes, double seconds) {
  return seconds > 0 ? reshard::FormatRate(bytes / seconds) : "-";
}

// Progress on a terminal: one line on stderr, rewritten at most ten times a second, only when
// both stdout and stderr are terminals and --json was not given (quiet when piped or logged).
class Progress {
 public:
  explicit Progress(bool json) : on_(!json && ::isatty(1) && ::isatty(2)) {}
  bool on() const { return on_; }
  void operator()(const std::string& what, uint64_t done, uint64_t total) {
    if (!on_) return;
    if (what != what_) {  // a new stage (verify: the next layout) gets its own line and clock
      Done();
      what_ = what;
      t0_ = std::chrono::steady_clock::now();
      last_ = -1;
    }
    const double s = Seconds();
    if (done < total && s - last_ < 0.1) return;
    last_ = s;
    const double rate = s > 0 ? done / s : 0;
    const double eta = rate > 0 ? (total - done) / rate : 0;
    std::fprintf(stderr, "\r\033[K  %s%s / %s  %s  ETA %.0f s", what.c_str(), Bytes(done).c_str(),
                 Bytes(total).c_str(), reshard::FormatRate(rate).c_str(), eta);
    std::fflush(stderr);
    shown_ = true;
  }
  /// Ends the progress line (before the command's own output).
  void Done() {
    if (shown_) std::fprintf(stderr, "\n");
    shown_ = false;
  }

 private:
  double Seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  bool on_;
  bool shown_ = false;
  double last_ = -1;
  std::string what_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// SRC as a local path or a model id in the Hugging Face cache (reshard::ResolveSource: a local
// path wins). Says on stderr which snapshot a model id resolved to, unless --json.
reshard::ResolvedSource Resolve(const std::string& src, const std::string& revision, bool json) {
  reshard::ResolvedSource r = reshard::ResolveSource(src, revision);
  if (r.from_cache && !json) {
    std::fprintf(stderr, "reshard: %s (revision %s, commit %.12s) from the Hugging Face cache: %s\n",
                 r.model_id.c_str(), r.revision.c_str(), r.commit.c_str(), r.path.c_str());
  }
  return r;
}

constexpr const char* kSourceHelp =
    "; or a Hugging Face model id (Org/Name) already in the local Hugging Face cache "
    "($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; never downloaded: "
    "hf download Org/Name first). A path that exists locally wins over a model id of the "
    "same spelling (write ./Org/Name to be explicit)";
constexpr const char* kRevisionHelp =
    "with a model id: the cached revision to use, a ref name (branch or tag, default main) or "
    "a 40-digit commit hash";

}  // namespace

namespace fs = std::filesystem;

// Whether the model manifest `path` records transformers' conversion of the checkpoint's
// names (one that cannot be read counts as not: convert reports it).
bool HasConversion(const fs::path& path) {
  try {
    return reshard::ReadModelManifest(path).conversion.has_value();
  } catch (const reshard::Error&) {
    return false;
  }
}

// Runs `python -m reshard.model_manifest SRC -o FILE` (RESHARD_PYTHON, else python3): the
// model's modules, buffers and transformers' conversion of SRC's keys, which need torch and
// transformers (the CLI links neither). Returns "" on success, else why not (its last line).
std::string CaptureModelManifest(const fs::path& src, const fs::path& file, const std::string& quantized) {
  const char* py = std::getenv("RESHARD_PYTHON");
  const std::string python = py && *py ? py : "python3";
  const fs::path log = file.string() + ".log";
  const pid_t pid = ::fork();
  if (pid < 0) return "cannot start " + python;
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<std::string> args = {python, "-m", "reshard.model_manifest", src.string(), "-o",
                                     file.string(), "--quantized", quantized};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "%s: not found\n", python.c_str());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::string last;
  {
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) last = line;
    }
  }
  std::error_code ec;
  fs::remove(log, ec);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && fs::exists(file, ec)) return "";
  return python + " -m reshard.model_manifest: " + (last.empty() ? "failed" : last);
}

// Ctrl-C / SIGTERM: the running operation stops at its next chunk and unwinds (temporaries
// removed, nothing half-written committed); a second signal stops the process at once.
extern "C" void OnStopSignal(int sig) {
  if (reshard::CancelSignal() != 0) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  reshard::RequestCancel(sig);
}

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

// What an interrupted command did and did not do, and the exit status of a signal (128 + N).
int Interrupted(const std::string& command) {
  const int sig = reshard::CancelSignal();
  std::string what;
  if (command == "convert") {
    what = "convert stopped: the rank files it was writing are not committed and their temporaries "
           "are removed (rank files finished before stay valid). Run the same command again: it "
           "writes only what is missing";
  } else if (command == "export") {
    what = "export stopped: nothing was published (the partial output is removed). Run it again";
  } else if (command == "verify") {
    what = "verify stopped before it checked everything (nothing was changed); the result above "
           "is incomplete";
  } else {
    what = command + " stopped";
  }
  std::fprintf(stderr, "reshard: interrupted by %s: %s\n", reshard::CancelSignalName().c_str(),
               what.c_str());
  return 128 + (sig > 0 ? sig : SIGINT);
}

int RunCli(int argc, char** argv);

int main(int argc, char** argv) {
  InstallStopHandlers();
  std::string command;
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] != '-') {
      command = argv[i];
      break;
    }
  }
  const int rc = RunCli(argc, argv);
  if (reshard::CancelSignal() != 0) return Interrupted(command);
  return rc;
}

int RunCli(int argc, char** argv) {
  CLI::App app{
      "reshard: turn Hugging Face checkpoints into per-rank FSDP shard files, and check them.",
      "reshard"};
  app.require_subcommand(1);
  // Version, rank-file format and build options (CUDA, zstd, xxhash, compiler), the
  // same facts as reshard._C.build_info().
  app.set_version_flag("--version", reshard::VersionText(),
                       "print the version, the rank-file format and the build options, then exit");
  app.footer(
      "Exit codes: 0 success, 1 verify found problems, 2 a wrong command line, 3 the files refuse it\n"
      "(missing, corrupt, mismatched, what OUT holds) or it failed.\n"
      "Example:  reshard convert ./Llama-3.2-1B -o ./llama-shards --world-size 8\n"
      "          reshard verify ./llama-shards --source ./Llama-3.2-1B\n"
      "          reshard export ./llama-shards -o ./llama-hf");

  // convert
  reshard::ConvertOptions co;
  std::string src, out, layout = "fsdp2", ranks, compress, dtype = "keep";
  uint32_t world_size = 0;
  bool convert_json = false;
  auto* convert = app.add_subcommand(
      "convert",
      "Write one file per rank holding exactly the bytes that rank owns under FSDP.");
  convert->add_option("SRC", src,
                      "Hugging Face checkpoint directory (model.safetensors, or sharded with "
                      "model.safetensors.index.json; else pytorch_model.bin, or sharded with "
                      "pytorch_model.bin.index.json) or one .safetensors or torch.save "
                      "(.bin/.pt/.pth, zip format) file. torch.save files are read without "
                      "running any pickled code" + std::string(kSourceHelp))
      ->required();
  std::string convert_revision;
  convert->add_option("--revision", convert_revision, kRevisionHelp);
  convert->add_option("-o,--out", out,
                      "output directory; several layouts of one source can live side by side "
                      "in it (OUT/fsdp2-ws8/, OUT/fsdp2-ws4/, ...)")
      ->required();
  convert->add_option("--world-size", world_size,
                      "number of shards: the size of the FSDP shard mesh dimension (required "
                      "unless --mesh gives it)")
      ->check(CLI::Range(1u, 99999u));
  std::string convert_mesh, convert_plan;
  convert->add_option("--mesh", convert_mesh,
                      "a DTensor layout's device mesh, NAME=SIZE per dim in order, e.g. "
                      "dp_shard=2,tp=2 (needs --plan); one rank file per mesh coordinate, rank = "
                      "its row-major index (formats/rank-file.md, DTensor layouts)");
  convert->add_option("--plan", convert_plan,
                      "with --mesh: the parallel plan file, parameter-name patterns to DTensor "
                      "placements per mesh dim (formats/parallel-plan.md)");
  convert->add_option("--layout", layout,
                      "layout kind: fsdp2 (fully_shard: each parameter in dim-0 chunks, the "
                      "torch.chunk rule) or fsdp1 (FullyShardedDataParallel: one flat, padded "
                      "parameter per wrapped unit, split in equal chunks)")
      ->check(CLI::IsMember({"fsdp2", "fsdp1"}))
      ->capture_default_str();
  std::string model_manifest;
  convert->add_option("--wrap", co.layout.wrap,
                      "fsdp1: module classes wrapped as FSDP units (auto_wrap_policy / "
                      "accelerate's transformer_layer_cls_to_wrap), e.g. --wrap "
                      "LlamaDecoderLayer; repeat for several. Default: the model's "
                      "_no_split_modules, as accelerate does");
  convert->add_flag("--use-orig-params", co.layout.use_orig_params,
                    "fsdp1: the job uses use_orig_params=True (accelerate's default), which adds "
                    "alignment padding between parameters");
  convert->add_option("--param-dtype", co.layout.param_dtype,
                      "fsdp1 with --use-orig-params: MixedPrecision(param_dtype=...) of the job "
                      "(bf16, fp16, fp32); it sets the alignment padding")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  convert->add_option("--model-manifest", model_manifest,
                      "the model's modules, parameter order, buffers and transformers' "
                      "conversion of the checkpoint's names (python -m reshard.model_manifest SRC "
                      "-o FILE). Default: SRC/ or OUT/reshard-model.json, else captured now by "
                      "$RESHARD_PYTHON (default python3) when it has reshard and transformers");
  std::string quantized = "dequantize";
  convert->add_option("--quantized", quantized,
                      "a quantized checkpoint (FP8 with block scales, quantization_config "
                      "quant_method fp8): dequantize (as from_pretrained does without a GPU of "
                      "compute capability 8.9: float32 weight x scale, rounded once to the model's "
                      "dtype) or keep (each FP8 weight and its weight_scale_inv stored as "
                      "the FP8 model holds them). Passed to the model manifest's capture")
      ->check(CLI::IsMember({"dequantize", "keep"}))
      ->capture_default_str();
  bool no_capture = false;
  convert->add_flag("--no-capture", no_capture,
                    "do not run Python to capture the model manifest (also "
                    "RESHARD_MODEL_CAPTURE=0): names are kept as in the checkpoint and "
                    "persistent buffers are sharded like parameters");
  convert->add_option("--dtype", dtype,
                      "dtype policy: keep (bytes as in the source), or bf16 / fp16 / fp32: "
                      "store every F16/BF16/F32/F64 tensor in that dtype, bit for bit as "
                      "torch's Tensor.to(dtype) (integers, bool and F8 are kept; --quantized dequantize turns FP8 weights into the model's dtype). Part of the "
                      "layout key: OUT/fsdp2-ws8-bf16/")
      ->check(CLI::IsMember({"keep", "bf16", "fp16", "fp32"}))
      ->capture_default_str();
  convert->add_option("--ranks", ranks,
                      "write only ranks A-B (inclusive), e.g. 0-3 on one machine and 4-7 on "
                      "another, into one shared OUT");
  bool convert_split = false;
  convert->add_flag("--split-from-env", convert_split,
                    "split the ranks among the processes of a launcher, from its environment: "
                    "SLURM_ARRAY_TASK_ID/COUNT, else torchrun's RANK/WORLD_SIZE (the launcher's "
                    "process count, not --world-size), else SLURM_PROCID/SLURM_NTASKS; each "
                    "writes its block into the shared OUT, the manifest lists the layout complete "
                    "once the last one ends");
  convert->add_option("--threads", co.threads, "worker threads (default: all cores)");
  convert->add_option("--compress", compress,
                      "store tensor data as independent zstd frames: zstd or zstd:LEVEL "
                      "(1-19, default 3); raw by default");
  convert->add_option("--chunk-size", co.chunk_size,
                      "bytes per checksum/compression chunk, a multiple of 4096, at most 1 GiB "
                      "(each worker thread holds up to three chunk buffers)")
      ->capture_default_str();
  convert->add_option("--lock-wait", co.lock_wait_seconds,
                      "seconds to wait for another conversion into OUT to release the manifest "
                      "lock (conversions of disjoint --ranks may run at the same time)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  convert->add_flag("--force", co.force,
                    "convert into an OUT that is neither empty nor a reshard output of SRC "
                    "(its files that convert writes, config.json among them, are replaced)");
  convert->add_flag("--json", convert_json, "print a machine-readable summary on stdout");
  convert->footer(
      "Examples:\n"
      "  reshard convert ./Qwen2.5-7B -o ./qwen-shards --world-size 8\n"
      "  reshard convert Qwen/Qwen2.5-0.5B -o ./qwen-shards --world-size 8  # from the HF cache\n"
      "  reshard convert ./old-model -o ./shards --world-size 8 --dtype bf16\n"
      "  reshard convert ./Qwen2.5-7B -o ./qwen-shards --world-size 8 --compress zstd:3 --json\n"
      "  # split across two machines into one shared OUT (may run at the same time):\n"
      "  reshard convert /shared/Llama-70B -o /shared/llama-shards --world-size 16 --ranks 0-7\n"
      "  reshard convert /shared/Llama-70B -o /shared/llama-shards --world-size 16 --ranks 8-15\n"
      "  # FSDP1 (FlatParameters; the model's parameter order is captured by Python itself)\n"
      "  reshard convert ./Llama-3.1-8B -o ./shards --world-size 8 --layout fsdp1 --dtype fp32\n"
      "  reshard convert ./Llama-3.1-8B -o ./shards --world-size 8 --layout fsdp1 "
      "--use-orig-params --param-dtype bf16 --dtype fp32\n"
      "The world size is the number of processes of the training job (for HSDP: the shard\n"
      "group size). Re-running on a complete output does nothing; a partial one is completed.\n"
      "Then: reshard verify OUT --source SRC; in the job: reshard.load(model, OUT).");

  // relayout (alias: reshard): another world size of a saved checkpoint, optimizer included
  reshard::RelayoutOptions ro;
  std::string relayout_out, relayout_layout, relayout_ranks, relayout_compress, relayout_from, relayout_manifest;
  std::vector<std::string> relayout_wrap;
  bool relayout_orig = false, relayout_json = false, relayout_split = false;
  std::string relayout_param_dtype, relayout_mesh, relayout_plan;
  auto* relayout = app.add_subcommand(
      "relayout",
      "Add another layout (world size, FSDP kind, DTensor mesh) to a saved checkpoint or a conversion, made "
      "from one of its layouts: weights and optimizer state (KEY/optim/), offline.");
  relayout->alias("reshard");
  relayout->add_option("OUT", relayout_out,
                       "the checkpoint directory: a reshard.save output (weights, optimizer "
                       "state) or a reshard convert output")
      ->required();
  auto* relayout_ws = relayout->add_option("--world-size", ro.world_size, "number of shards of the new layout")
      ->check(CLI::Range(1u, 99999u));
  auto* relayout_mesh_opt = relayout->add_option(
      "--mesh", relayout_mesh,
      "a DTensor layout of this device mesh, e.g. dp_shard=1,tp=4 (its size is the world size); needs --plan");
  relayout->add_option("--plan", relayout_plan,
                       "with --mesh: the parallel plan file giving the placements (formats/parallel-plan.md)");
  relayout_ws->excludes(relayout_mesh_opt);
  relayout->add_option("--layout", relayout_layout,
                       "fsdp2 or fsdp1 (default: the source layout's kind; fsdp2 from a DTensor layout without --mesh)")
      ->check(CLI::IsMember({"fsdp2", "fsdp1"}));
  relayout->add_option("--wrap", relayout_wrap, "fsdp1: wrapped module classes (default: the source's, "
                                                "else the model's _no_split_modules)");
  relayout->add_flag("--use-orig-params", relayout_orig,
                     "fsdp1: the new job uses use_orig_params=True (default: as the source)");
  relayout->add_option("--param-dtype", relayout_param_dtype,
                       "fsdp1 with --use-orig-params: MixedPrecision param_dtype (default: the source's)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  relayout->add_option("--from", relayout_from,
                       "the layout to read, e.g. fsdp2-ws4 (default: the only complete layout, "
                       "preferring the one with optimizer state)");
  relayout->add_option("--model-manifest", relayout_manifest,
                       "fsdp1 targets: the model manifest (default OUT/reshard-model.json)");
  relayout->add_option("--ranks", relayout_ranks, "write only ranks A-B of the new layout");
  relayout->add_flag("--split-from-env", relayout_split,
                     "split the new layout's ranks among the processes of a launcher, from its "
                     "environment: SLURM_ARRAY_TASK_ID/COUNT, else torchrun's RANK/WORLD_SIZE "
                     "(the launcher's process count, not --world-size), else "
                     "SLURM_PROCID/SLURM_NTASKS; whichever finishes last commits");
  bool relayout_commit_only = false;
  relayout->add_flag("--commit-only", relayout_commit_only,
                     "write no rank file: only commit the new layout if all of its rank files "
                     "are there (an explicit final step after split runs)");
  relayout->add_option("--threads", ro.threads, "worker threads (default: twice the cores: it waits on the disk)");
  relayout->add_option("--compress", relayout_compress, "zstd or zstd:LEVEL; raw by default");
  relayout->add_option("--chunk-size", ro.chunk_size, "bytes per checksum chunk of the new files")
      ->capture_default_str();
  relayout->add_option("--lock-wait", ro.lock_wait_seconds, "seconds to wait for OUT's lock")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  relayout->add_flag("--json", relayout_json, "print a machine-readable summary on stdout");
  relayout->footer(
      "Examples:\n"
      "  reshard relayout ./ckpt/step-00001000 --world-size 48      # saved at 64, resume at 48\n"
      "  reshard relayout ./ckpt/step-00001000 --world-size 6 --from fsdp1-ws4-LlamaDecoderLayer\n"
      "  torchrun --nproc-per-node 8 --no-python reshard relayout ./ckpt --world-size 64 --split-from-env\n"
      "  reshard relayout ./ckpt/step-00001000 --mesh dp_shard=1,tp=4 --plan llama_tp.json   # 2x2 -> 1x4\n"
      "The new layout's rank files (and optim/, with optimizer.json) are written beside the\n"
      "source's; reshard.json lists the layout only once every one of them is there. Then:\n"
      "reshard verify OUT; in the job: reshard.load(model, OUT), reshard.load_optimizer(opt, model, OUT).");

  // verify
  reshard::VerifyOptions vo;
  std::string verify_path, verify_source;
  bool verify_json = false;
  auto* verify = app.add_subcommand(
      "verify", "Check every file's header and checksums; with --source, compare every byte.");
  verify->add_option("PATH", verify_path, "output directory, a layout directory, or a rank file")
      ->required();
  verify->add_option("--source", verify_source,
                     "the source checkpoint: check that the ranks reassemble it byte for byte "
                     "(after the layout's dtype conversion, if any): a directory or file" +
                         std::string(kSourceHelp));
  std::string verify_revision;
  verify->add_option("--revision", verify_revision, std::string(kRevisionHelp) + " (for --source)");
  verify->add_option("--threads", vo.threads, "worker threads (default: all cores)");
  verify->add_flag("--json", verify_json, "print a machine-readable report on stdout");
  verify->footer(
      "Examples:\n"
      "  reshard verify ./qwen-shards --source ./Qwen2.5-7B     # every byte against the source\n"
      "  reshard verify ./qwen-shards                           # headers and checksums only\n"
      "  reshard verify ./qwen-shards/fsdp2-ws8/rank-00003-of-00008.reshard --json\n"
      "Exit code 0: all is well; 1: problems found (each printed with its file and tensor);\n"
      "3: the check could not run (e.g. PATH missing).");

  // inspect
  std::string inspect_path;
  bool inspect_json = false;
  auto* inspect = app.add_subcommand(
      "inspect", "Show tensors, dtypes, bytes per rank and layouts of an output, a rank file, "
                 "or a Hugging Face source directory.");
  inspect->add_option("PATH", inspect_path, "output directory, layout directory, rank file, or "
                                            "Hugging Face checkpoint" + std::string(kSourceHelp))
      ->required();
  std::string inspect_revision;
  inspect->add_option("--revision", inspect_revision, kRevisionHelp);
  inspect->add_flag("--json", inspect_json, "print JSON on stdout");
  inspect->footer(
      "Examples:\n"
      "  reshard inspect ./qwen-shards                  # layouts, ranks, bytes per rank\n"
      "  reshard inspect ./qwen-shards/fsdp2-ws8/rank-00003-of-00008.reshard\n"
      "  reshard inspect ./Qwen2.5-7B --json            # the source: tensors, dtypes, shapes");

  // remove
  std::string remove_out;
  std::vector<std::string> remove_keys;
  bool remove_json = false;
  auto* remove = app.add_subcommand(
      "remove", "Remove layouts from an output directory: their entries in reshard.json, then their "
                "directories (rank files and optimizer state).");
  remove->add_option("OUT", remove_out, "output directory (the one with reshard.json)")->required();
  remove->add_option("KEY", remove_keys, "layouts to remove (reshard inspect OUT lists them)")->required();
  remove->add_flag("--json", remove_json, "print JSON on stdout");
  remove->footer(
      "A layout that reshard relayout made from a removed one stays, standing alone (reshard verify\n"
      "then checks it by its checksums). Refused: every layout at once, one part of an\n"
      "expert-parallel save without the others.\n"
      "Examples:\n"
      "  reshard remove ./qwen-shards fsdp2-ws4\n"
      "  reshard remove ./run/step-1000 fsdp2-ws16        # a saved checkpoint's old world size");

  // export
  reshard::ExportOptions eo;
  std::string export_out, export_dir, export_max_shard = "5GB", export_dtype = "keep";
  bool export_json = false;
  auto* exp = app.add_subcommand(
      "export", "Write a layout back as an ordinary Hugging Face checkpoint directory "
                "(safetensors shards, index, config and tokenizer files).");
  exp->add_option("OUT", export_out, "a reshard output directory (holds reshard.json)")
      ->required();
  exp->add_option("-o,--out", export_dir,
                  "the Hugging Face checkpoint directory to write (must not exist or be empty, "
                  "unless --force)")
      ->required();
  exp->add_option("--layout", eo.layout,
                  "layout key to export (e.g. fsdp2-ws8); required when OUT holds several");
  exp->add_option("--max-shard-size", export_max_shard,
                  "largest safetensors file, as save_pretrained's max_shard_size: 5GB, 500MB, "
                  "... (powers of 1000) or bytes; everything in one model.safetensors when it "
                  "fits")
      ->capture_default_str();
  exp->add_option("--dtype", export_dtype,
                  "keep the rank files' dtype, or write every F16/BF16/F32/F64 tensor as "
                  "bf16 / fp16 / fp32, bit for bit as torch's Tensor.to(dtype)")
      ->check(CLI::IsMember({"keep", "bf16", "fp16", "fp32"}))
      ->capture_default_str();
  exp->add_option("--threads", eo.threads, "worker threads (default: all cores)");
  exp->add_flag("--force", eo.force, "replace a non-empty output directory");
  exp->add_flag("--adapter", eo.adapter,
                "OUT is a reshard.save of a PEFT (LoRA) model's adapters: write a PEFT adapter "
                "directory (adapter_model.safetensors, adapter_config.json) that "
                "PeftModel.from_pretrained loads");
  bool export_merge = false;
  std::string export_base, export_base_layout;
  exp->add_flag("--merge", export_merge,
                "OUT is a reshard.save of a PEFT (LoRA) model's adapters: write the base model with "
                "the adapters merged, bit for bit as PEFT's merge_and_unload(), as a Hugging Face "
                "checkpoint (runs python -m reshard.merge with $RESHARD_PYTHON, default python3, "
                "which needs reshard, torch and peft)");
  exp->add_option("--base", export_base,
                  "with --merge: the reshard output directory holding the base model (default: OUT "
                  "itself when saved with base=True, else the directory the job loaded it from, as "
                  "the save records it)");
  exp->add_option("--base-layout", export_base_layout,
                  "with --merge: the layout of --base to merge into, when it holds several");
  exp->add_flag("--hub-names", eo.hub_names,
                "write the source checkpoint's own names and layout (per-expert MoE keys, "
                "embed_out, ...) by inverting the conversion convert applied "
                "(OUT/reshard-model.json), for tools that expect the hub's names; default: the "
                "model's names and fused tensors, which transformers 5 loads as they are");
  exp->add_flag("--json", export_json, "print a machine-readable summary on stdout");
  exp->footer("Example:  reshard export ./llama-shards -o ./llama-hf --max-shard-size 5GB\n"
              "          reshard export ./llama-shards --layout fsdp2-ws8-bf16 -o ./llama-bf16\n"
              "          reshard export ./mixtral-shards -o ./mixtral-hf --hub-names\n"
              "          reshard export ./lora-step-100 -o ./lora-adapter --adapter\n"
              "          reshard export ./lora-step-100 -o ./llama-merged --merge [--base ./llama-shards]\n"
              "Files are written into a hidden directory beside the output and renamed into "
              "place at the end:\nan interrupted export leaves no output directory.");

  // An unknown first word: name it and the commands (CLI11 says "A subcommand is required").
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      known = known || sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "reshard: unknown command '%s'; the commands are %s (reshard --help)\n",
                   reshard::Printable(argv[1], 64).c_str(), names.c_str());
      return kExitUsage;
    }
  }
  try {
    app.parse(argc, argv);
    if (*convert) {  // --world-size, or --mesh (and --plan) for a DTensor layout
      if (!convert_mesh.empty()) {
        if (convert->count("--layout")) {
          throw CLI::ValidationError("--mesh", "gives a DTensor layout; --layout does not apply");
        }
        try {
          co.layout.mesh = reshard::ParseMeshFlag(convert_mesh);
        } catch (const reshard::Error& e) {
          throw CLI::ValidationError("--mesh", e.what());
        }
        if (world_size && world_size != co.layout.mesh.Size()) {
          throw CLI::ValidationError("--world-size", std::to_string(world_size) + " is not the mesh's " +
                                                         std::to_string(co.layout.mesh.Size()) + " ranks");
        }
        if (convert_plan.empty()) throw CLI::ValidationError("--mesh", "needs --plan FILE (formats/parallel-plan.md)");
        world_size = static_cast<uint32_t>(co.layout.mesh.Size());
      } else if (world_size == 0) {
        throw CLI::RequiredError("--world-size");
      } else if (!convert_plan.empty()) {
        throw CLI::ValidationError("--plan", "needs --mesh (a DTensor layout)");
      }
    }
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : kExitUsage;
  }

  try {
    if (*convert) {
      const reshard::ResolvedSource resolved = Resolve(src, convert_revision, convert_json);
      co.source = resolved.path;
      co.out = out;
      co.layout.kind = *reshard::ParseLayoutKind(layout);
      if (!convert_mesh.empty()) co.layout.kind = reshard::LayoutKind::kDTensor;  // checked above
      if (!convert_plan.empty()) co.plan_file = convert_plan;
      co.layout.world_size = world_size;
      co.layout.dtype = dtype;
      if (!model_manifest.empty()) co.model_manifest = model_manifest;
      // The model manifest: captured unless given, found with its conversion, or turned off.
      fs::path captured;
      const char* env_capture = std::getenv("RESHARD_MODEL_CAPTURE");
      std::error_code fec;
      // The resolved checkpoint directory (a model id's snapshot in the Hugging Face cache).
      const fs::path source = co.source;
      const bool hf_dir = fs::exists((fs::is_directory(source, fec) ? source : source.parent_path()) /
                                     "config.json", fec);
      // The one convert would use without --model-manifest.
      reshard::CheckConvertSource(source);  // before a capture or anything else runs
      reshard::CheckConvertOutput(out);  // before a capture writes into it
      const fs::path existing = reshard::FindModelManifest(source, out);
      const bool has_conversion = !existing.empty() && HasConversion(existing);
      const bool out_existed = fs::exists(out, fec);
      if (model_manifest.empty() && hf_dir && !no_capture && !(env_capture && std::string(env_capture) == "0") &&
          (existing.empty() || !has_conversion)) {
        fs::create_directories(out, fec);
        captured = fs::path(out) / ("." + std::string(reshard::kModelManifestName) + ".tmp-capture-" +
                                    std::to_string(::getpid()));
        if (!convert_json) std::fprintf(stderr, "capturing the model manifest (python -m reshard.model_manifest)...\n");
        const std::string why = CaptureModelManifest(source, captured, quantized);
        if (why.empty()) {
          co.model_manifest = captured;
        } else {
          std::error_code ec;
          fs::remove(captured, ec);
          captured.clear();
          if (existing.empty()) {
            const char* py = std::getenv("RESHARD_PYTHON");
            std::fprintf(stderr,
                         "reshard: note: no model manifest (%s); the rank files keep the "
                         "checkpoint's names and persistent buffers are sharded. To capture it: "
                         "%s -m reshard.model_manifest %s -o %s/%s (a Python with reshard and transformers; "
                         "convert runs $RESHARD_PYTHON, else python3), then run this convert again\n",
                         why.c_str(), py && *py ? py : "python3", src.c_str(), out.c_str(),
                         std::string(reshard::kModelManifestName).c_str());
          }
        }
      }
      // The capture's file, and -o when this command made it and nothing else was written there
      // (a refusal after the capture, e.g. --wrap of a class the model lacks): an empty -o left
      // behind would look like an output. fs::remove leaves a directory that is not empty.
      struct RemoveCaptured {
        fs::path p, created_out;
        ~RemoveCaptured() {
          std::error_code ec;
          if (!p.empty()) fs::remove(p, ec);
          if (!created_out.empty()) fs::remove(created_out, ec);
        }
      } remove_captured{captured, out_existed ? fs::path() : fs::path(out)};
      if (!ranks.empty()) co.ranks = ParseRankRange(ranks);
      if (convert_split) {
        if (!ranks.empty()) throw CLI::ValidationError("--split-from-env", "and --ranks both choose the ranks; pass one");
        std::string what;
        const auto [index, count] = reshard::LauncherProcess([](const char* n) { return std::getenv(n); }, what);
        const auto mine = reshard::SplitRanks(world_size, index, count);
        if (!mine) {
          std::printf("%s: no rank of %u left for this process; nothing to do\n", what.c_str(), world_size);
          return 0;
        }
        co.ranks = *mine;
      }
      ParseCompress(compress, co);
      Progress progress(convert_json);
      if (progress.on()) {
        co.progress = [&progress](uint64_t done, uint64_t total) { progress("", done, total); };
      }
      reshard::ConvertResult r;
      try {
        r = reshard::Convert(co);
      } catch (const reshard::Error& e) {
        progress.Done();
        // A model id whose cached snapshot lacks the weights (e.g. only config.json was
        // downloaded, or a blob was deleted): say how to complete it.
        if (!resolved.from_cache || e.code() != reshard::ErrorCode::kNotFound) throw;
        throw reshard::Error(e.code(), std::string(e.what()) + "; the Hugging Face cache holds "
                                       "only part of " + resolved.model_id + ": hf download " +
                                       resolved.model_id +
                                       (convert_revision.empty() ? std::string()
                                                                 : " --revision " + convert_revision));
      }
      progress.Done();
      if (convert_json) {
        nlohmann::json j = {{"layout", r.layout_key},
                            {"dtype", co.layout.dtype},
                            {"layout_dir", r.layout_dir.string()},
                            {"world_size", r.world_size},
                            {"ranks_written", r.ranks_written},
                            {"ranks_up_to_date", r.ranks_up_to_date},
                            {"ranks_damaged", DamagedJson(r.ranks_damaged)},
                            {"bytes_read", r.bytes_read},
                            {"bytes_stored", r.bytes_stored},
                            {"bytes_decoded", r.bytes_decoded},
                            {"seconds", r.seconds},
                            {"layout_complete", r.layout_complete}};
        if (co.layout.kind == reshard::LayoutKind::kFsdp1) {
          j["wrap"] = r.wrap;
          j["unused_tensors"] = r.unused_tensors;
        }
        std::cout << j.dump(2) << "\n";
      } else if (r.ranks_written.empty()) {
        std::cout << r.layout_dir.string() << ": all " << r.ranks_up_to_date.size()
                  << " requested rank files are already up to date; nothing to do\n";
      } else {
        PrintDamaged(r.ranks_damaged);
        std::printf("wrote %zu rank file(s) of %s into %s: %s read in %.2f s (%s)",
                    r.ranks_written.size(), r.layout_key.c_str(), r.layout_dir.c_str(),
                    Bytes(r.bytes_read).c_str(), r.seconds, Rate(r.bytes_read, r.seconds).c_str());
        if (co.codec == reshard::Codec::kZstd) {
          std::printf(", zstd stored %s (ratio %.3f)", Bytes(r.bytes_stored).c_str(),
                      r.bytes_decoded ? double(r.bytes_stored) / r.bytes_decoded : 1.0);
        }
        if (!r.ranks_up_to_date.empty()) {
          std::printf("; %zu were already up to date", r.ranks_up_to_date.size());
        }
        std::printf("\n");
        if (!r.unused_tensors.empty()) {
          std::printf("note: %zu source tensor(s) are no parameter or persistent buffer of the "
                      "model and are not in FSDP1 rank files (e.g. %s)\n",
                      r.unused_tensors.size(), r.unused_tensors.front().c_str());
        }
        if (!r.layout_complete) {
          std::printf("layout %s is not complete yet: convert the remaining ranks into the same "
                      "directory\n", r.layout_key.c_str());
        }
      }
      return 0;
    }
    if (*relayout) {
      ro.out = relayout_out;
      if (!relayout_layout.empty()) ro.kind = *reshard::ParseLayoutKind(relayout_layout);
      if (!relayout_wrap.empty()) ro.wrap = relayout_wrap;
      if (relayout_orig) ro.use_orig_params = true;
      if (!relayout_param_dtype.empty()) ro.param_dtype = relayout_param_dtype;
      if (!relayout_from.empty()) ro.from = relayout_from;
      if (!relayout_manifest.empty()) ro.model_manifest = relayout_manifest;
      if (relayout_mesh.empty() && ro.world_size == 0) {
        throw CLI::ValidationError("--world-size", "or --mesh (with --plan) is required: the new layout");
      }
      if (!relayout_mesh.empty()) {
        ro.mesh = reshard::ParseMeshFlag(relayout_mesh);
        ro.world_size = static_cast<uint32_t>(std::min<uint64_t>(ro.mesh->Size(), 100000));
      }
      if (!relayout_plan.empty()) ro.plan_file = relayout_plan;
      if (!relayout_ranks.empty() && relayout_split) {
        throw CLI::ValidationError("--split-from-env", "--ranks was given too, and both choose the ranks; pass one");
      }
      if (relayout_commit_only && (!relayout_ranks.empty() || relayout_split)) {
        throw CLI::ValidationError("--commit-only", std::string("writes no rank file, so ") +
                                                        (relayout_split ? "--split-from-env" : "--ranks") +
                                                        " does not apply; pass one");
      }
      if (!relayout_ranks.empty()) ro.ranks = ParseRankRange(relayout_ranks);
      std::string split_what;
      if (relayout_split) {
        const auto [index, count] = reshard::LauncherProcess([](const char* n) { return std::getenv(n); }, split_what);
        const auto mine = reshard::SplitRanks(ro.world_size, index, count);
        if (mine) ro.ranks = *mine; else ro.commit_only = true;
      }
      if (relayout_commit_only) ro.commit_only = true;
      reshard::ConvertOptions codec;
      ParseCompress(relayout_compress, codec);
      ro.codec = codec.codec;
      ro.zstd_level = codec.zstd_level;
      Progress progress(relayout_json);
      if (progress.on()) {
        ro.progress = [&progress](uint64_t done, uint64_t total) { progress("", done, total); };
      }
      reshard::RelayoutResult r = reshard::Relayout(ro);
      progress.Done();
      if (relayout_json) {
        nlohmann::json j = {{"from", r.from_key},
                            {"layout", r.layout_key},
                            {"layout_dir", r.layout_dir.string()},
                            {"world_size", r.world_size},
                            {"optimizer", r.optimizer},
                            {"ranks_written", r.ranks_written},
                            {"ranks_up_to_date", r.ranks_up_to_date},
                            {"ranks_damaged", DamagedJson(r.ranks_damaged)},
                            {"ranks_missing", r.ranks_missing},
                            {"bytes_read", r.bytes_read},
                            {"bytes_stored", r.bytes_stored},
                            {"bytes_decoded", r.bytes_decoded},
                            {"seconds", r.seconds},
                            {"committed", r.committed}};
        if (!split_what.empty()) j["split"] = split_what;
        std::cout << j.dump(2) << "\n";
      } else {
        std::string missing;  // the first ranks still to write, for the message below
        for (size_t i = 0; i < r.ranks_missing.size() && i < 8; ++i) {
          missing += (i ? ", " : "") + std::to_string(r.ranks_missing[i]);
        }
        if (r.ranks_missing.size() > 8) missing += ", ...";
        PrintDamaged(r.ranks_damaged);
        std::printf("%s -> %s%s: wrote %zu rank file(s) (%zu up to date), %s read in %.2f s (%s)\n",
                    r.from_key.c_str(), r.layout_key.c_str(), r.optimizer ? " with optimizer state" : "",
                    r.ranks_written.size(), r.ranks_up_to_date.size(), Bytes(r.bytes_read).c_str(), r.seconds,
                    Rate(r.bytes_read, r.seconds).c_str());
        if (r.committed) {
          std::printf("layout %s is complete and listed in %s/reshard.json\n", r.layout_key.c_str(),
                      relayout_out.c_str());
        } else {
          std::printf("layout %s is not complete yet (%zu rank file(s) missing: rank%s %s): run the remaining "
                      "ranks into the same directory (--ranks A-B)\n",
                      r.layout_key.c_str(), r.ranks_missing.size(), r.ranks_missing.size() > 1 ? "s" : "",
                      missing.c_str());
        }
      }
      // An explicit final step that could not commit is a failure: the script running it
      // must not go on as if the layout were there.
      if (relayout_commit_only && !r.committed) {
        std::fprintf(stderr, "reshard relayout --commit-only: layout %s not committed: %zu of its %u rank files "
                             "are missing; write them first (reshard relayout %s ... --ranks A-B)\n",
                     r.layout_key.c_str(), r.ranks_missing.size(), r.world_size, relayout_out.c_str());
        return 3;
      }
      return 0;
    }
    if (*exp) {
      auto size = reshard::ParseMaxShardSize(export_max_shard);
      if (!size) {
        throw CLI::ValidationError("--max-shard-size", "expected a size such as 5GB, 500MB or "
                                                       "a byte count, got \"" +
                                                           export_max_shard + "\"");
      }
      eo.out = export_out;
      eo.hf_dir = export_dir;
      eo.max_shard_size = *size;
      eo.dtype = export_dtype;
      if (!export_merge && (!export_base.empty() || !export_base_layout.empty())) {
        throw CLI::ValidationError("--base", "applies to --merge, which was not given");
      }
      if (export_merge) {
        // PEFT's merge arithmetic is torch's: Python does it (reshard/merge.py), this process
        // waits for it and passes its exit status on (2: bad usage, 3: failed).
        if (eo.adapter || eo.hub_names || export_dtype != "keep") {
          throw CLI::ValidationError("--merge", "writes the base model's names and dtypes, as "
                                                "merge_and_unload: not with --adapter, --hub-names "
                                                "or --dtype");
        }
        const char* py = std::getenv("RESHARD_PYTHON");
        const std::string python = py && *py ? py : "python3";
        std::vector<std::string> args = {python, "-m", "reshard.merge", export_out, "-o", export_dir,
                                         "--max-shard-size", std::to_string(*size)};
        if (!export_base.empty()) args.insert(args.end(), {"--base", export_base});
        if (!export_base_layout.empty()) args.insert(args.end(), {"--base-layout", export_base_layout});
        if (!eo.layout.empty()) args.insert(args.end(), {"--layout", eo.layout});
        if (eo.threads) args.insert(args.end(), {"--threads", std::to_string(eo.threads)});
        if (eo.force) args.push_back("--force");
        if (export_json) args.push_back("--json");
        std::fflush(nullptr);
        const pid_t pid = ::fork();
        if (pid < 0) throw reshard::Error(reshard::ErrorCode::kIo, "cannot start " + python);
        if (pid == 0) {
          std::vector<char*> argv_c;
          for (auto& a : args) argv_c.push_back(a.data());
          argv_c.push_back(nullptr);
          ::execvp(argv_c[0], argv_c.data());
          ::_exit(127);
        }
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (rc == 1 || rc == 127) {  // reshard.merge never exits 1: Python could not run it
          std::fprintf(stderr,
                       "reshard: error: export --merge runs `%s -m reshard.merge` (PEFT's merge "
                       "arithmetic needs torch), which %s. Install the reshard package (pip install "
                       ". from this repository), torch, safetensors and peft in that Python, or set "
                       "RESHARD_PYTHON to the training environment's python\n",
                       python.c_str(), rc == 127 ? "was not found" : "could not import reshard (see above)");
          return kExitFailed;
        }
        return rc == 0 ? 0 : rc == kExitUsage ? kExitUsage : kExitFailed;
      }
      Progress progress(export_json);
      if (progress.on()) {
        eo.progress = [&progress](uint64_t done, uint64_t total) { progress("", done, total); };
      }
      reshard::ExportResult r = reshard::Export(eo);
      progress.Done();
      if (export_json) {
        nlohmann::json j = {{"layout", r.layout_key},        {"hf_dir", r.hf_dir.string()},
                            {"weight_files", r.weight_files}, {"aux_files", r.aux_files},
                            {"sharded", r.sharded},          {"tensors", r.tensors},
                            {"total_size", r.total_size},    {"bytes_read", r.bytes_read},
                            {"seconds", r.seconds},          {"hub_names", r.hub_names}};
        if (!r.config_dtype.empty()) j["config_dtype"] = r.config_dtype;
        if (r.config_dequantized) j["config_quantization_removed"] = true;
        std::cout << j.dump(2) << "\n";
      } else {
        std::printf("wrote %s of layout %s into %s: %llu tensors, %zu weight file(s), %s in "
                    "%.2f s (%s)\n",
                    r.sharded ? "a sharded checkpoint"
                    : r.weight_files.size() == 1 ? r.weight_files[0].c_str()  // adapter_model.safetensors too
                                                 : "model.safetensors",
                    r.layout_key.c_str(),
                    r.hf_dir.c_str(), static_cast<unsigned long long>(r.tensors),
                    r.weight_files.size(), Bytes(r.total_size).c_str(), r.seconds,
                    Rate(r.total_size, r.seconds).c_str());
        if (!r.config_dtype.empty()) {
          std::printf("config.json: dtype set to %s, the weights' dtype\n", r.config_dtype.c_str());
        }
        if (r.config_dequantized) {
          std::printf("config.json: quantization_config removed: the weights were dequantized "
                      "at convert\n");
        }
      }
      return 0;
    }
    if (*verify) {
      vo.path = verify_path;
      if (!verify_source.empty()) vo.source = Resolve(verify_source, verify_revision, verify_json).path;
      if (verify_source.empty() && !verify_revision.empty()) {
        throw CLI::ValidationError("--revision", "applies to --source, which was not given");
      }
      Progress progress(verify_json);
      if (progress.on()) {
        vo.progress = [&progress](const std::string& layout, uint64_t done, uint64_t total) {
          progress(layout.empty() ? "" : layout + ": ", done, total);
        };
      }
      reshard::VerifyReport r = reshard::Verify(vo);
      progress.Done();
      if (verify_json) {
        nlohmann::json problems = nlohmann::json::array();
        for (const auto& p : r.problems) {
          problems.push_back({{"file", p.file}, {"tensor", p.tensor}, {"message", p.message}});
        }
        nlohmann::json j = {{"ok", r.ok()},       {"layouts", r.layouts},
                            {"files", r.files},   {"tensors", r.tensors},
                            {"bytes", r.bytes},   {"source_bytes_compared", r.source_bytes_compared},
                            {"seconds", r.seconds}, {"problems", problems}, {"notes", r.notes}};
        std::cout << j.dump(2) << "\n";
      } else {
        for (const auto& p : r.problems) {
          std::cout << p.file << (p.tensor.empty() ? "" : ": tensor \"" + p.tensor + "\"") << ": "
                    << p.message << "\n";
        }
        if (r.ok()) {
          std::printf("OK: %llu files, %llu tensors, %s checked%s in %.2f s\n",
                      static_cast<unsigned long long>(r.files),
                      static_cast<unsigned long long>(r.tensors), Bytes(r.bytes).c_str(),
                      vo.source || r.source_bytes_compared
                          ? (", " + Bytes(r.source_bytes_compared) +
                             (vo.source ? " compared with the source" : " compared with the layouts they were made from"))
                                .c_str()
                          : "",
                      r.seconds);
        } else {
          std::printf("FAILED: %zu problem(s)\n", r.problems.size());
        }
        for (const auto& n : r.notes) std::cout << "note: " << n << "\n";
      }
      return r.ok() ? 0 : kExitProblems;
    }
    if (*remove) {
      const reshard::RemoveResult r = reshard::RemoveLayouts(remove_out, remove_keys);
      if (remove_json) {
        std::cout << nlohmann::json{{"removed", r.removed}, {"unlinked", r.unlinked}, {"remaining", r.remaining}}.dump(2)
                  << "\n";
      } else {
        for (const auto& k : r.removed) std::printf("removed layout %s (%s)\n", k.c_str(), (fs::path(remove_out) / k).c_str());
        for (const auto& k : r.unlinked) {
          std::printf("layout %s was made from a removed layout: it stands alone now (verify checks it by its "
                      "checksums)\n", k.c_str());
        }
        std::string left;
        for (const auto& k : r.remaining) left += " " + k;
        std::printf("%s lists:%s\n", (fs::path(remove_out) / "reshard.json").c_str(), left.c_str());
      }
      return 0;
    }
    if (*inspect) {
      nlohmann::json d = reshard::Inspect(Resolve(inspect_path, inspect_revision, inspect_json).path);
      if (inspect_json) {
        std::cout << d.dump(2) << "\n";
      } else {
        std::cout << reshard::RenderInspect(d);
      }
      return 0;
    }
  } catch (const CLI::ValidationError& e) {
    std::fprintf(stderr, "reshard: %s\n", e.what());
    return kExitUsage;
  } catch (const reshard::Error& e) {
    if (e.code() == reshard::ErrorCode::kCancelled) return kExitFailed;  // main says what happened
    std::fprintf(stderr, "reshard: error: %s\n", e.what());
    return e.code() == reshard::ErrorCode::kInvalidArgument ? kExitUsage : kExitFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reshard: error: %s\n", e.what());
    return kExitFailed;
  }
  return 0;
}
