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

namespace reshard {

namespace fs = std::filesystem;

namespace {

// At most this many rank files are open for writing at once.
constexpr size_t kMaxOpenRankFiles = 64;

// One rank file of a group being written, and where each of its entries' bytes come from.
struct RankWriter {
  uint32_t rank = 0;
  RankFileWriter file;
  std::vector<EntryMap> maps;  // one per entry
};

// One chunk of one tensor of one rank file: `length` bytes of the rank file, filled by the
// entry's byte map; (file_index, source_offset) is the first source byte it reads (for
// ordering the reads).
struct WorkItem {
  uint32_t writer = 0;     // index into the group's writers
  uint32_t tensor = 0;     // index into the writer's entries
  uint64_t chunk = 0;
  uint64_t source_offset = 0;
  uint64_t length = 0;
  size_t file_index = 0;
};

bool UpToDate(const fs::path& path, const ConvertOptions& o, const SourceFingerprint& source,
              const RankPlan& plan) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return false;
  try {
    RankFileReader r = RankFileReader::Open(path);
    const RankFileHeader& h = r.header();
    if (!(h.source == source) || h.layout_key != o.layout.Key() ||
        h.world_size != o.layout.world_size || h.dtype_policy != o.layout.dtype ||
        h.chunk_size != o.chunk_size) {
      return false;
    }
    for (const auto& t : h.tensors) {
      if (t.nbytes > 0 && t.codec != o.codec) return false;
    }
    if (h.kind != o.layout.kind || h.wrap != o.layout.wrap ||
        h.use_orig_params != o.layout.use_orig_params || h.param_dtype != o.layout.param_dtype ||
        h.tensors.size() != plan.tensors.size()) {
      return false;
    }
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const auto& want = plan.tensors[i];
      const auto& have = h.tensors[i];
      if (have.name != want.name || have.dtype != want.dtype || have.sharded != want.sharded ||
          have.global_shape != want.global_shape || have.local_shape != want.local_shape ||
          (want.flat == nullptr) != (have.flat == nullptr) ||
          (want.flat && !(*want.flat == *have.flat))) {
        return false;
      }
    }
    return true;
  } catch (const Error&) {
    return false;
  }
}

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
            const Fsdp1Plan* units)
      : o_(o), ckpt_(ckpt), view_(view), conversion_(conversion), whole_(whole),
        threads_(threads), units_(units) {
    for (const auto& f : ckpt.files) sources_.push_back(File::OpenRead(f.path));
  }

  RankPlan Plan(uint32_t rank) const {
    return units_ ? PlanRank(view_, o_.layout, *units_, rank)
                  : PlanRank(view_, o_.layout, rank, whole_);
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
    std::vector<RankWriter> writers;  // destroyed uncommitted, each removes its temporary
    writers.reserve(ranks.size());
    std::vector<WorkItem> items;
    const SourceLookup lookup = [this](std::string_view name) { return ckpt_.Find(name); };
    const fs::path dir = o_.out / o_.layout.Key();
    RankFileWriterOptions wo;
    wo.codec = o_.codec;
    wo.sync_directory = false;  // once for the group, below
    for (size_t w = 0; w < ranks.size(); ++w) {
      const uint32_t rank = ranks[w];
      const RankPlan plan = Plan(rank);
      const fs::path final_path = dir / RankFileName(rank, o_.layout.world_size);
      RankFileHeader h;
      h.writer = std::string(WriterString());
      h.SetLayout(o_.layout);
      h.rank = rank;
      h.source = ckpt_.fingerprint;
      h.chunk_size = o_.chunk_size;
      for (const PlannedTensor& p : plan.tensors) {
        h.tensors.push_back(PlannedEntry(p));
      }
      writers.push_back({rank, RankFileWriter::Create(final_path, std::move(h), wo), {}});
      RankWriter& rw = writers.back();
      const std::vector<TensorEntry>& entries = rw.file.header().tensors;  // sizes laid out
      for (uint32_t ti = 0; ti < entries.size(); ++ti) {
        const TensorEntry& e = entries[ti];
        rw.maps.push_back(MapEntry(e, o_.layout.kind, o_.layout.world_size, rank,
                                   final_path.string()));
        if (conversion_) ExpandConversion(rw.maps.back(), *conversion_);
        const EntryMap& map = rw.maps.back();
        if (const std::string why = CheckSources(map, lookup); !why.empty()) {
          Fail(ErrorCode::kMismatch, final_path.string() + ": tensor \"" + e.name + "\": " + why);
        }
        for (uint64_t c = 0; c < e.ChunkCount(o_.chunk_size); ++c) {
          const uint64_t begin = c * o_.chunk_size;  // a multiple of 4096: whole elements
          WorkItem it{static_cast<uint32_t>(w), ti, c, 0, std::min(o_.chunk_size, e.nbytes - begin), 0};
          std::tie(it.file_index, it.source_offset) = FirstSourceByte(map, lookup, begin);
          items.push_back(it);
        }
      }
    }
    const bool zstd = o_.codec == Codec::kZstd;
    if (!zstd) {
      // Raw chunks go to fixed places: read the source in order.
      std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
        return a.file_index != b.file_index ? a.file_index < b.file_index
                                            : a.source_offset < b.source_offset;
      });
    } else {
      // zstd frames are appended, and a rank file's tensors must lie in header order (formats/
      // rank-file.md): items go tensor by tensor, chunk by chunk, the ranks' pieces of one
      // chunk side by side (so the source is still read roughly in order). Source order is not
      // header order under FSDP1 (flat parameters gather pieces of many source tensors) or a
      // conversion (renamed, stacked keys).
      std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
        return a.tensor != b.tensor ? a.tensor < b.tensor : a.chunk < b.chunk;
      });
    }

    // Workers take items in that order from one counter: no barrier between chunks. Each
    // chunk is filled, hashed and encoded (zstd: compressed) in parallel; raw chunks go
    // straight to their places. zstd frames are appended to their rank file in item order: a
    // worker whose frame is not next for that file waits (blocking, not spinning) until it
    // is; the smallest unwritten item is always held by a running worker, so this cannot
    // deadlock.
    std::vector<uint64_t> seq(items.size());
    {
      std::vector<uint64_t> per_writer(writers.size(), 0);
      for (size_t i = 0; i < items.size(); ++i) seq[i] = per_writer[items[i].writer]++;
    }
    std::vector<uint64_t> next_seq(writers.size(), 0);
    std::mutex write_mu;
    std::condition_variable write_cv;
    std::atomic<bool> failed{false};  // an item failed: wakes the workers waiting to write
    std::atomic<uint64_t> stored{0}, read{0};
    const SourceRead read_source = [this](size_t file, uint64_t at, size_t n, void* dst) {
      sources_[file].PReadExact(dst, n, at);
    };
    ParallelForOptions po;
    po.threads = threads_;
    if (o_.progress) po.progress = [&](uint64_t) { o_.progress(done_bytes_.load(), total_bytes); };
    // Each thread's buffers are sized by the longest chunk of these ranks, not chunk_size: a
    // large --chunk-size over small tensors costs no memory.
    uint64_t longest = 1;
    for (const WorkItem& it : items) longest = std::max(longest, it.length);
    ParallelFor(items.size(), po, [&] {
      return [&, buf = std::unique_ptr<char[]>(new char[longest]),
              scratch = std::vector<char>(),  // source elements of a converting chunk
              encoder = ChunkEncoder(o_.codec, longest, o_.zstd_level)](
                 size_t i) mutable -> uint64_t {
        if (failed.load()) return 0;  // the loop is ending
        try {
          const WorkItem& it = items[i];
          RankWriter& rw = writers[it.writer];
          const uint64_t source_bytes = FillEntry(rw.maps[it.tensor], lookup, read_source,
                                                  it.chunk * o_.chunk_size, it.length, buf.get(),
                                                  scratch);
          const std::span<const char> data =
              rw.file.EncodeChunk(it.tensor, it.chunk, buf.get(), encoder);
          if (!zstd) {
            rw.file.WriteChunk(it.tensor, it.chunk, data);
          } else {
            std::unique_lock<std::mutex> lock(write_mu);
            write_cv.wait(lock, [&] { return next_seq[it.writer] == seq[i] || failed.load(); });
            if (failed.load()) return 0;
            // Written under the lock: file order is the order of `seq`.
            rw.file.WriteChunk(it.tensor, it.chunk, data);
            ++next_seq[it.writer];
            lock.unlock();
            write_cv.notify_all();
          }
          stored += data.size();
          read += source_bytes;
          done_bytes_ += it.length;
          return it.length;
        } catch (...) {
          {
            std::lock_guard<std::mutex> g(write_mu);
            failed = true;
          }
          write_cv.notify_all();
          throw;  // the loop's first error
        }
      };
    });
    result.bytes_read += read.load();
    result.bytes_stored += stored.load();

    for (RankWriter& rw : writers) {
      for (const auto& e : rw.file.header().tensors) result.bytes_decoded += e.nbytes;
      rw.file.Commit();
      result.ranks_written.push_back(rw.rank);
    }
    SyncDirectory(dir);
  }

  const ConvertOptions& o_;
  const Checkpoint& ckpt_;
  const Checkpoint& view_;
  const Conversion* conversion_;
  const std::set<std::string>& whole_;
  unsigned threads_;
  const Fsdp1Plan* units_;
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
             "a few MiB gain nothing (default 2 MiB)");
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
    Fail(ErrorCode::kInvalidArgument,
         o.source.string() + ": " + model_path.string() + " keeps the checkpoint's FP8 weights "
         "with their float32 scales (quantization policy keep), which --dtype " + o.layout.dtype +
         " would convert: use --dtype keep, or dequantize (capture the model manifest with "
         "python -m reshard.model_manifest " + o.source.string() + " -o FILE --quantized "
         "dequantize, then --model-manifest FILE)");
  }
  const Checkpoint view = conversion ? ModelView(ckpt, *conversion, model_path.string()) : ckpt;
  // FSDP2 does not shard buffers: the model's persistent buffers are stored whole.
  std::set<std::string> whole;
  if (model && o.layout.kind == LayoutKind::kFsdp2) {
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
      Fail(ErrorCode::kInvalidArgument,
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
  Converter converter(o, ckpt, view, conversion, whole, threads, units ? &*units : nullptr);
  for (uint32_t r = first; r <= last; ++r) {
    const RankPlan plan = converter.Plan(r);
    if (UpToDate(dir / RankFileName(r, o.layout.world_size), o, ckpt.fingerprint, plan)) {
      result.ranks_up_to_date.push_back(r);
    } else {
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
