#include "reshard/ops/convert.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "format/json_util.h"
#include "reshard/base/checksum.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/base/error.h"
#include "reshard/base/version.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/format/model_manifest.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/file_io.h"
#include "reshard/io/manifest.h"
#include "reshard/io/parallel_for.h"
#include "reshard/io/rank_file.h"
#include "reshard/io/rank_file_writer.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/conversion.h"
#include "reshard/plan/fsdp1.h"
#include "reshard/plan/rank_plan.h"
#include "reshard/ops/path_hint.h"
#include "ops/rank_fill.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// At most this many rank files are open for writing at once.
constexpr size_t kMaxOpenRankFiles = 64;

void CopyAuxFiles(const Checkpoint& ckpt, const fs::path& out) {
  for (const auto& name : ckpt.aux_files) {
    const std::string contents = ReadWholeFile(ckpt.dir / name, 1ull << 30);
    std::error_code ec;
    if (fs::exists(out / name, ec)) {
      try {
        if (ReadWholeFile(out / name, 1ull << 30) == contents) continue;
      } catch (const Error&) {
      }
    }
    WriteFileAtomic(out / name, contents, CopyMode(ckpt.dir / name));  // never wider
  }
}

class Converter {
 public:
  // `view`: the tensors the layout is planned over (the model's names and shapes: ckpt
  // itself, or ModelView(ckpt, *conversion)); bytes always come from `ckpt`.
  Converter(const ConvertOptions& o, const Checkpoint& ckpt, const Checkpoint& view,
            const Conversion* conversion, const std::set<std::string>& whole, unsigned threads,
            const Fsdp1Plan* units, const ParallelPlan* parallel)
      : o_(o), ckpt_(ckpt), view_(view), conversion_(conversion), whole_(whole),
        threads_(threads), units_(units), parallel_(parallel) {
    for (const auto& f : ckpt.files) sources_.push_back(File::OpenRead(f.path));
  }

  RankPlan Plan(uint32_t rank) const {
    if (parallel_) return PlanRank(view_, o_.layout, *parallel_, rank, whole_, o_.plan_file->string());
    return units_ ? PlanRank(view_, o_.layout, *units_, rank)
                  : PlanRank(view_, o_.layout, rank, whole_);
  }

  // The planned header of `rank` (what a writer lays out and a re-run compares with).
  RankFileHeader Header(uint32_t rank, const RankPlan& plan) const {
    RankFileHeader h;
    h.writer = std::string(WriterString());
    h.SetLayout(o_.layout);
    h.rank = rank;
    h.source = ckpt_.fingerprint;
    h.chunk_size = o_.chunk_size;
    for (const PlannedTensor& p : plan.tensors) h.tensors.push_back(PlannedEntry(p));
    return h;
  }

  void Run(std::vector<uint32_t> ranks, ConvertResult& result) {
    for (size_t g = 0; g < ranks.size(); g += kMaxOpenRankFiles) {
      std::vector<uint32_t> group(ranks.begin() + g,
                                  ranks.begin() + std::min(ranks.size(), g + kMaxOpenRankFiles));
      RunGroup(group, result);
    }
  }

  uint64_t total_bytes = 0;
  std::atomic<uint64_t> done_bytes_{0};

 private:
  void RunGroup(const std::vector<uint32_t>& ranks, ConvertResult& result) {
    const SourceLookup lookup = [this](std::string_view name) { return ckpt_.Find(name); };
    const fs::path dir = o_.out / o_.layout.Key();
    std::vector<RankFileJob> jobs;
    for (const uint32_t rank : ranks) {
      const RankPlan plan = Plan(rank);
      RankFileJob job;
      job.rank = rank;
      job.path = dir / RankFileName(rank, o_.layout.world_size);
      job.header = Header(rank, plan);
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        TensorEntry e = job.header.tensors[i];
        e.nbytes = plan.tensors[i].nbytes;  // what the writer lays out
        EntryMap map = MapEntry(e, o_.layout.kind, o_.layout.world_size, rank, job.path.string());
        if (conversion_) ExpandConversion(map, *conversion_);
        if (const std::string why = CheckSources(map, lookup); !why.empty()) {
          Fail(ErrorCode::kMismatch, job.path.string() + ": tensor \"" + e.name + "\": " + why);
        }
        job.maps.push_back(std::move(map));
      }
      jobs.push_back(std::move(job));
    }
    RankFillOptions fo;
    fo.codec = o_.codec;
    fo.zstd_level = o_.zstd_level;
    fo.threads = threads_;
    fo.done_bytes = &done_bytes_;
    if (o_.progress) fo.progress = [this] { o_.progress(done_bytes_.load(), total_bytes); };
    const RankFillStats st = WriteRankFiles(
        jobs, lookup,
        [this]() -> SourceRead {
          return [this](size_t file, uint64_t at, size_t n, void* dst) { sources_[file].PReadExact(dst, n, at); };
        },
        fo);
    result.bytes_read += st.bytes_read;
    result.bytes_stored += st.bytes_stored;
    result.bytes_decoded += st.bytes_decoded;
    for (const RankFileJob& j : jobs) result.ranks_written.push_back(j.rank);
  }

  const ConvertOptions& o_;
  const Checkpoint& ckpt_;
  const Checkpoint& view_;
  const Conversion* conversion_;
  const std::set<std::string>& whole_;
  unsigned threads_;
  const Fsdp1Plan* units_;
  const ParallelPlan* parallel_;
  std::vector<File> sources_;
};

// The model manifest: the option, else SOURCE/ or OUT/reshard-model.json; empty when none.
fs::path ModelManifestIfAny(const ConvertOptions& o) {
  return o.model_manifest ? *o.model_manifest : FindModelManifest(o.source, o.out);
}

// FSDP1 needs one.
fs::path RequireModelManifest(const ConvertOptions& o) {
  if (fs::path p = ModelManifestIfAny(o); !p.empty()) return p;
  Fail(ErrorCode::kNotFound,
       "--layout fsdp1 needs the model's modules and parameter order, which a checkpoint does "
       "not hold (its keys are sorted), and reshard convert could not capture them (it runs "
       "$RESHARD_PYTHON, default python3, which needs the reshard package and transformers). "
       "Capture them with: python -m reshard.model_manifest " +
           o.source.string() + " -o " + (o.out / kModelManifestName).string() +
           "  (or pass --model-manifest FILE)");
}

// OUT without a manifest may hold only what an interrupted conversion of this source leaves:
// the lock, temporaries, layout directories of rank files, and copies of the source's aux
// files (identical) and the model manifest. The first other entry is named, else "".
std::string ForeignEntry(const fs::path& out, const Checkpoint& ckpt) {
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    std::error_code ec;
    if (name == kLockName || name == kConvertClaimName ||
        (name.starts_with(".") && name.find(".tmp-") != std::string::npos)) {
      continue;
    }
    if ((name.starts_with("fsdp1-") || name.starts_with("fsdp2-")) &&
        e.is_directory(ec) && !e.is_symlink(ec)) {
      bool only_ranks = true;
      for (const auto& f : fs::directory_iterator(e.path())) {
        const std::string n = f.path().filename().string();
        only_ranks = only_ranks && (n.starts_with("rank-") || n.starts_with(".rank-"));
      }
      if (only_ranks) continue;
      return name + "/ (a directory holding other files than rank files)";
    }
    if (name == kModelManifestName) continue;
    if (std::find(ckpt.aux_files.begin(), ckpt.aux_files.end(), name) != ckpt.aux_files.end()) {
      try {
        if (ReadWholeFile(e.path(), 1ull << 30) == ReadWholeFile(ckpt.dir / name, 1ull << 30)) {
          continue;
        }
      } catch (const Error&) {
      }
      return name + " (differing from " + (ckpt.dir / name).string() + ")";
    }
    return name;
  }
  return {};
}

// config.json's quantization_config.quant_method beside checkpoint `dir` ("" when it has none,
// or no readable config.json: not convert's to judge).
std::string QuantMethod(const fs::path& dir) {
  const fs::path config = dir / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(config, ec)) return "";
  const std::string text = ReadWholeFile(config, 64ull << 20);
  internal::CheckJsonDepth(text, config.string(), "config.json");
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return "";
  auto q = j.find("quantization_config");
  if (q == j.end() || !q->is_object()) return "";
  auto m = q->find("quant_method");
  return m != q->end() && m->is_string() ? m->get<std::string>() : std::string("?");
}

}  // namespace

fs::path FindModelManifest(const fs::path& source, const fs::path& out) {
  std::error_code ec;
  const fs::path src_dir = fs::is_directory(source, ec) ? source : source.parent_path();
  for (const fs::path& dir : {src_dir, out}) {
    if (fs::exists(dir / kModelManifestName, ec)) return dir / kModelManifestName;
  }
  return {};
}

void CheckConvertSource(const fs::path& source) {
  std::error_code ec;
  if (!fs::is_directory(source, ec) || !fs::exists(source / kManifestName, ec)) return;
  // A Hugging Face checkpoint that also holds a reshard.json (an older convert into it): its
  // weights are the source.
  for (const auto& e : fs::directory_iterator(source, ec)) {
    const std::string n = e.path().filename().string();
    if (n.ends_with(".safetensors") || n.starts_with("pytorch_model.bin")) return;
  }
  std::optional<Manifest> m;
  try {
    m = ReadManifest(source);
  } catch (const Error&) {
  }
  const bool saved = m && m->source.saved;
  Fail(ErrorCode::kMismatch,
       source.string() + ": " + (saved ? "a checkpoint reshard.save wrote" : "the output of reshard convert") +
           ", not a Hugging Face checkpoint: reshard relayout " + source.string() +
           " --world-size N makes another world size (or layout) inside it; reshard export " + source.string() +
           " -o DIR writes a Hugging Face checkpoint from it");
}

void CheckConvertOutput(const fs::path& out) {
  std::error_code ec;
  if (const std::string hint = fs::is_directory(out, ec) ? PathHint(out) : std::string();
      hint.starts_with("a layout directory of ")) {
    fs::path dir = out.lexically_normal();  // "OUT/KEY/" names KEY
    if (!dir.has_filename() && dir.has_parent_path()) dir = dir.parent_path();
    Fail(ErrorCode::kMismatch, out.string() + ": " + hint + " (-o " + dir.parent_path().string() +
                                          "; a conversion adds its layout beside the others)");
  }
}

ConvertResult Convert(const ConvertOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  ConvertOptions o = options;
  std::optional<ModelManifest> model;
  fs::path model_path;
  if (o.layout.kind == LayoutKind::kFsdp1) {
    model_path = RequireModelManifest(o);
  } else {
    model_path = ModelManifestIfAny(o);
  }
  if (!model_path.empty()) model = ReadModelManifest(model_path);
  if (model && o.layout.kind == LayoutKind::kFsdp1 && o.layout.wrap.empty()) {
    // accelerate's default, the model's _no_split_modules, less the classes this model does
    // not build (multimodal families list their vision and audio blocks, which a text-only
    // class such as Qwen3_5ForCausalLM lacks): the units FSDP1 makes of those classes.
    std::set<std::string> have;
    for (const ModelModule& m : model->modules) have.insert(m.cls);
    for (const std::string& c : model->no_split_modules) {
      if (have.count(c)) o.layout.wrap.push_back(c);
    }
  }
  std::optional<ParallelPlan> parallel;
  if (o.layout.kind == LayoutKind::kDTensor) {
    if (!o.plan_file) Fail(ErrorCode::kInvalidArgument, "--mesh needs --plan FILE (formats/parallel-plan.md)");
    parallel = ParseParallelPlan(ReadWholeFile(*o.plan_file, 64ull << 20), o.plan_file->string());
    o.layout.plan_name = parallel->name;
    o.layout.plan_xxh3 = parallel->xxh3;
  } else if (o.plan_file) {
    Fail(ErrorCode::kInvalidArgument, "--plan needs --mesh (a DTensor layout)");
  }
  o.layout.Normalize();
  if (o.layout.world_size == 0) {
    Fail(ErrorCode::kInvalidArgument, "--world-size must be at least 1");
  }
  // Rank file names spell rank and world size in five digits (rank-RRRRR-of-WWWWW.reshard);
  // a larger world size would give names that ScanLayout and the manifest cannot parse.
  if (o.layout.world_size > 99999) {
    Fail(ErrorCode::kInvalidArgument,
         "world size " + std::to_string(o.layout.world_size) +
             " is too large: rank file names allow at most 99999 ranks");
  }
  if (o.chunk_size == 0 || o.chunk_size % kDataAlignment != 0 ||
      o.chunk_size > kMaxConvertChunkSize) {
    Fail(ErrorCode::kInvalidArgument,
         "--chunk-size " + std::to_string(o.chunk_size) +
             ": expected a chunk size that is a positive multiple of 4096 up to " +
             std::to_string(kMaxConvertChunkSize) + " (1 GiB): each worker thread holds up "
             "to three buffers of a chunk (source, zstd frame, dtype conversion) and a loader "
             "stages whole zstd chunks in pinned memory (lanes x slots x chunk); chunks beyond "
             "a few MiB gain nothing (default " + std::to_string(kDefaultChunkSize) + ")");
  }
  if (!ParseDTypePolicy(o.layout.dtype)) {
    Fail(ErrorCode::kInvalidArgument,
         "--dtype " + o.layout.dtype + " is not one of keep, bf16, fp16, fp32");
  }
  uint32_t first = 0, last = o.layout.world_size - 1;
  if (o.ranks) {
    std::tie(first, last) = *o.ranks;
    if (first > last || last >= o.layout.world_size) {
      Fail(ErrorCode::kInvalidArgument,
           "--ranks " + std::to_string(first) + "-" + std::to_string(last) +
               " is not a range inside 0-" + std::to_string(o.layout.world_size - 1));
    }
  }
  unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());

  CheckConvertSource(o.source);
  Checkpoint ckpt = OpenCheckpoint(o.source);
  // The model's view of the checkpoint: transformers' renames and fusions applied
  // (reshard/plan/conversion.h), so rank files hold the live model's names and shapes.
  const Conversion* conversion = model && model->conversion ? &*model->conversion : nullptr;
  if (conversion && !conversion->refused.empty()) {
    std::string why;
    for (size_t i = 0; i < conversion->refused.size() && i < 5; ++i) why += "\n  " + conversion->refused[i];
    if (conversion->refused.size() > 5) {
      why += "\n  (and " + std::to_string(conversion->refused.size() - 5) + " more)";
    }
    Fail(ErrorCode::kUnsupported,
         o.source.string() + ": the model (" + model->model_class + ") is loaded from this "
         "checkpoint through transformers " + conversion->transformers_version +
         "' weight conversion, and " + std::to_string(conversion->refused.size()) +
         " of its tensors cannot be converted (" + model_path.string() + "):" + why);
  }
  if (!conversion || !conversion->quantization) {
    // A quantized checkpoint copied as stored would hold packed blocks and scales under names
    // the model does not have (MXFP4), or FP8 weights a plain model cannot take: only the
    // captured conversion knows transformers' policy for them.
    if (const std::string method = QuantMethod(ckpt.dir); !method.empty()) {
      Fail(ErrorCode::kUnsupported,
           o.source.string() + ": a quantized checkpoint (config.json quantization_config.quant_method \"" +
               method + "\"), and " +
               (model ? model_path.string() + " records no quantization policy for it"
                      : std::string("no model manifest was captured")) +
               ": convert needs transformers' own conversion of it, captured by Python (reshard and "
               "transformers importable; or first: python -m reshard.model_manifest " + o.source.string() +
               " -o FILE [--quantized dequantize|keep], then --model-manifest FILE)" +
               (method == "fp8" || method == "mxfp4" ? std::string()
                                                      : "; only fp8 and mxfp4 are supported"));
    }
  }
  if (conversion && conversion->quantization &&
      conversion->quantization->policy == Quantization::Policy::kKeep && o.layout.dtype != "keep") {
    Fail(ErrorCode::kMismatch,
         o.source.string() + ": " + model_path.string() + " keeps the checkpoint's FP8 weights "
         "with their float32 scales (quantization policy keep), which --dtype " + o.layout.dtype +
         " would convert: use --dtype keep, or dequantize (capture the model manifest with "
         "python -m reshard.model_manifest " + o.source.string() + " -o FILE --quantized "
         "dequantize, then --model-manifest FILE)");
  }
  const Checkpoint view = conversion ? ModelView(ckpt, *conversion, model_path.string()) : ckpt;
  // FSDP2 does not shard buffers: the model's persistent buffers are stored whole.
  std::set<std::string> whole;
  if (model && (o.layout.kind == LayoutKind::kFsdp2 || o.layout.kind == LayoutKind::kDTensor)) {
    for (const ModelBuffer& b : model->buffers) {
      if (!b.persistent) continue;
      if (const SourceTensor* t = FindSourceTensor(view, b.name, model->base_model_prefix)) {
        whole.insert(t->name);
      }
    }
  }
  std::optional<Fsdp1Plan> units;
  if (model && o.layout.kind == LayoutKind::kFsdp1) units = PlanFsdp1(view, *model, o.layout);
  std::error_code ec;
  CheckConvertOutput(o.out);
  fs::create_directories(o.out, ec);
  if (ec || !fs::is_directory(o.out)) {
    Fail(ErrorCode::kIo, o.out.string() + ": cannot create the output directory" +
                             (ec ? " (" + ec.message() + ")" : std::string()));
  }
  auto lock = std::make_unique<DirectoryLock>(o.out / kLockName, o.lock_wait_seconds);
  std::optional<Manifest> manifest = ReadManifest(o.out);
  if (manifest && !(manifest->source == ckpt.fingerprint)) {
    Fail(ErrorCode::kMismatch,
         o.out.string() + ": holds layouts of another source (fingerprint " +
             Hex16(manifest->source.fingerprint) + ", this source is " +
             Hex16(ckpt.fingerprint.fingerprint) + "); convert into an empty directory");
  }
  if (!manifest && !o.force) {
    const std::string foreign = ForeignEntry(o.out, ckpt);
    if (!foreign.empty()) {
      Fail(ErrorCode::kMismatch,
           o.out.string() + ": found " + Printable(foreign) +
               " in a directory without reshard.json; expected an empty directory or a reshard "
               "output of this source (files there would be overwritten); pass --force to "
               "convert into it anyway");
    }
  }
  // Held until this conversion ends: conversions of this source (disjoint --ranks, other
  // layouts) share it; one of another source is refused now, before it writes a byte, not
  // at its end after its rank files have replaced this one's.
  std::string held_owner, held_by;
  std::optional<SharedClaim> claim = SharedClaim::Take(
      o.out / kConvertClaimName, Hex16(ckpt.fingerprint.fingerprint),
      "reshard convert " + Printable(fs::absolute(o.source, ec).string()) + " (source fingerprint " +
          Hex16(ckpt.fingerprint.fingerprint) + "), pid " + std::to_string(::getpid()) + " on " +
          SafeHostName(),
      &held_owner, &held_by);
  if (!claim) {
    Fail(ErrorCode::kBusy,
         o.out.string() + ": another conversion into this directory is running, of another "
                          "source (fingerprint " + held_owner + ", this source is " +
             Hex16(ckpt.fingerprint.fingerprint) + "): " + held_by + " holds " +
             std::string(kConvertClaimName) +
             "; nothing was written. An output directory holds layouts of one source only: "
             "convert into another directory (or wait for that conversion to end and remove "
             "its output)");
  }
  const fs::path dir = o.out / o.layout.Key();
  fs::create_directories(dir, ec);
  if (ec) Fail(ErrorCode::kIo, dir.string() + ": cannot create (" + ec.message() + ")");
  RemoveStaleTemporaries(dir);
  lock.reset();  // rank files need no lock: each is written under a private name and renamed

  ConvertResult result;
  if (units) {
    result.unused_tensors = units->unused;
    result.wrap = o.layout.wrap;
  }
  result.layout_key = o.layout.Key();
  result.layout_dir = dir;
  result.world_size = o.layout.world_size;
  std::vector<uint32_t> todo;
  Converter converter(o, ckpt, view, conversion, whole, threads, units ? &*units : nullptr,
                      parallel ? &*parallel : nullptr);
  for (uint32_t r = first; r <= last; ++r) {
    const RankPlan plan = converter.Plan(r);
    std::string damage;
    if (RankFileUpToDate(dir / RankFileName(r, o.layout.world_size), converter.Header(r, plan), o.codec,
                         /*check_data=*/true, threads, &damage)) {
      result.ranks_up_to_date.push_back(r);
    } else {
      if (!damage.empty()) result.ranks_damaged.emplace_back(r, damage);
      todo.push_back(r);
      for (const auto& t : plan.tensors) converter.total_bytes += t.nbytes;
    }
  }
  converter.Run(todo, result);

  lock = std::make_unique<DirectoryLock>(o.out / kLockName, std::max(o.lock_wait_seconds, 600.0));
  manifest = ReadManifest(o.out);  // another conversion may have rewritten it meanwhile
  if (manifest && !(manifest->source == ckpt.fingerprint)) {
    Fail(ErrorCode::kMismatch, o.out.string() + ": another source was converted into this "
                                                "directory during this conversion");
  }
  CopyAuxFiles(ckpt, o.out);
  Manifest m = manifest.value_or(Manifest{});
  if (model) {
    // Kept beside the layouts: later conversions, verify and reshard.load find it there.
    const std::string name(kModelManifestName);
    if (!fs::equivalent(model_path, o.out / name, ec)) {
      WriteFileAtomic(o.out / name, ReadWholeFile(model_path, 256ull << 20));
    }
    if (std::find(m.aux_files.begin(), m.aux_files.end(), name) == m.aux_files.end()) {
      m.aux_files.push_back(name);
    }
  }
  m.writer = std::string(WriterString());
  m.source = ckpt.fingerprint;
  for (const auto& a : ckpt.aux_files) {
    if (std::find(m.aux_files.begin(), m.aux_files.end(), a) == m.aux_files.end()) {
      m.aux_files.push_back(a);
    }
  }
  ManifestLayout entry = ScanLayout(o.out, o.layout, ckpt.fingerprint);
  result.layout_complete = entry.complete;
  m.layouts[entry.key] = std::move(entry);
  WriteManifest(o.out, m);
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace reshard
