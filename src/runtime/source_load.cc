#include "reshard/runtime/source_load.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "reshard/base/dtype.h"
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
#include "reshard/ops/layout_reader.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/conversion.h"
#include "reshard/plan/fsdp1.h"
#include "reshard/plan/layout_tensors.h"
#include "reshard/plan/rank_plan.h"

#include "runtime/read_pipeline.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

// Bytes of one work item: a piece of one target, filled at once into one staging slot (a
// multiple of 4096, so whole elements of every dtype).
constexpr uint64_t kDefaultPiece = 4ull << 20;

// One reader thread's access to the source bytes (FillEntry's SourceRead).
class ThreadSource {
 public:
  virtual ~ThreadSource() = default;
  virtual void Read(size_t file_index, uint64_t offset, size_t size, void* dst) = 0;
};

// One piece of one target: entry bytes [begin, begin + length).
struct Piece {
  uint32_t job = 0;
  uint64_t begin = 0, length = 0;
  std::pair<size_t, uint64_t> first_source{0, 0};  // for ordering the reads
};

// Whether byte `offset` of `fd` is in the page cache: mincore of its page, mapped alone (as
// PageCacheResidency samples whole files; a read with RWF_NOWAIT, tried first, found cold
// files "cached" on the GPU machine, run AJ). Where the page cannot be mapped, "yes" (the
// warm path is always right, only slower on a cold file).
bool ByteCached(int fd, uint64_t offset) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t at = offset / page * page;
  void* map = ::mmap(nullptr, page, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(at));
  if (map == MAP_FAILED) return true;
  unsigned char v = 1;
  const bool ok = ::mincore(map, page, &v) == 0;
  ::munmap(map, page);
  return !ok || (v & 1) != 0;
}

// What both kinds of view share: the planned header, each entry's byte map, the load.
class PlannedView : public SourceRankView {
 public:
  const RankFileHeader& header() const override { return header_; }
  const std::string& description() const override { return description_; }

  LoadStats Load(std::span<const LoadTarget> targets, DeviceCopier* copier,
                 const LoadOptions& options) const override;

 protected:
  // Plans rank `rank` of `layout` over `view` (the tensors as the model names them, bytes
  // found through `lookup`), expanding conversions when `conversion` is given.
  // FSDP1 layouts are planned from `model` (their units and parameter order), which must then
  // be given.
  // DTensor layouts are planned by `plan` (`plan_path` names it in errors), required then.
  void Plan(const Checkpoint& view, const LayoutSpec& layout, uint32_t rank,
            const std::set<std::string>& whole_names, const std::string& prefix,
            const Conversion* conversion, const SourceFingerprint& source,
            const ModelManifest* model, const ParallelPlan* plan = nullptr,
            const std::string& plan_path = "");
  // One reader thread's source; `direct`: SourceFiles() opened O_DIRECT (OpenDirect), or null.
  virtual std::unique_ptr<ThreadSource> MakeThreadSource(bool verify, uint64_t hash_piece,
                                                         const std::vector<File>* direct) const = 0;
  // The source files as their file indices (a checkpoint's) or ranks (a layout's) name them.
  virtual std::vector<const File*> SourceFiles() const = 0;
  // SourceFiles() opened again with O_DIRECT (once; later calls return the first's answer),
  // or null where one cannot be (tmpfs), and the load reads buffered.
  const std::vector<File>* OpenDirect() const {
    const std::lock_guard<std::mutex> g(direct_mu_);
    if (!direct_tried_) {
      direct_tried_ = true;
      direct_ = ReopenDirect(SourceFiles());
    }
    return direct_ ? &*direct_ : nullptr;
  }
  // Whether a cold load onto the device reads O_DIRECT (else through the page cache, a
  // thread asking the kernel to read ahead in source order). Measured per kind of source:
  // bench/HISTORY.md §18.
  virtual bool DirectWhenCold() const = 0;
  // Asks the kernel to read source bytes [offset, offset + size) of `file_index` ahead
  // (posix_fadvise WILLNEED): a hint, errors ignored.
  virtual void Advise(size_t file_index, uint64_t offset, uint64_t size) const = 0;
  // Whether the source byte at (file_index, offset) is in the page cache.
  virtual bool Cached(size_t file_index, uint64_t offset) const = 0;
  // The fraction of up to 64 pieces, spread over the load, whose first source byte is in
  // the page cache: the bytes this rank reads, not whole files (a rank reads a part of each).
  double Residency(const std::vector<Piece>& pieces) const;
  virtual const SourceTensor* FindSource(std::string_view name) const = 0;
  // Where the piece of entry map `map` that starts at byte `begin` should end, at most at
  // `end`: a source that is read in units (another layout's checksum chunks) ends it on a
  // unit boundary when one lies inside, so that later pieces read whole units straight into
  // their destination rather than the same unit twice, by two readers, through a buffer.
  virtual uint64_t PieceEnd(const EntryMap& /*map*/, uint64_t /*begin*/, uint64_t end) const { return end; }
  // Adds to used_files_ the files holding bytes [begin, end) of source tensor `t`.
  virtual void NoteFiles(const SourceTensor& t, uint64_t begin, uint64_t end) = 0;
  std::vector<std::string> files() const override { return used_files_; }
  std::vector<Range> ReadRanges() const override;
  size_t ConvertedTensors() const override { return converted_; }
  // Adds to `out` the file ranges a load reads for source bytes [offset, offset + size) of
  // file `file_index` (a SourceRead's arguments).
  virtual void AddRanges(size_t file_index, uint64_t offset, uint64_t size, std::vector<Range>& out) const = 0;

  RankFileHeader header_;
  std::vector<EntryMap> maps_;  // one per header_.tensors entry
  std::string description_;
  std::vector<std::string> used_files_;  // the files this rank's bytes are read from, in order
  size_t converted_ = 0;                 // planned entries with a source of another dtype
  std::set<std::string> noted_;
  mutable std::mutex direct_mu_;
  mutable bool direct_tried_ = false;
  mutable std::optional<std::vector<File>> direct_;
  void Note(const std::string& path) {
    if (noted_.insert(path).second) used_files_.push_back(path);
  }
};

void PlannedView::Plan(const Checkpoint& view, const LayoutSpec& layout, uint32_t rank,
                       const std::set<std::string>& whole_names, const std::string& prefix,
                       const Conversion* conversion, const SourceFingerprint& source,
                       const ModelManifest* model, const ParallelPlan* parallel,
                       const std::string& plan_path) {
  if (layout.world_size == 0 || rank >= layout.world_size) {
    Fail(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) + " is not inside world size " +
                                          std::to_string(layout.world_size));
  }
  RankPlan plan;
  if (layout.kind == LayoutKind::kFsdp1) {
    if (!model) {
      Fail(ErrorCode::kInvalidArgument,
           description_ + ": an FSDP1 layout is planned from the model manifest (its units and "
                          "parameter order), and none was given");
    }
    plan = PlanRank(view, layout, PlanFsdp1(view, *model, layout), rank);
  } else {
      std::set<std::string> whole;
    for (const std::string& n : whole_names) {
      if (const SourceTensor* t = FindSourceTensor(view, n, prefix)) whole.insert(t->name);
    }
    if (model) {  // as convert: the manifest's persistent buffers are stored whole
      for (const ModelBuffer& b : model->buffers) {
        if (!b.persistent) continue;
        if (const SourceTensor* t = FindSourceTensor(view, b.name, prefix)) whole.insert(t->name);
      }
    }
    if (layout.kind == LayoutKind::kDTensor) {
      if (!parallel) {
        Fail(ErrorCode::kInvalidArgument, description_ + ": a DTensor layout is planned from a parallel plan, "
                                                         "and none was given");
      }
      plan = PlanRank(view, layout, *parallel, rank, whole, plan_path);
    } else {
      plan = PlanRank(view, layout, rank, whole);
    }
  }
  header_.writer = std::string(WriterString());
  header_.SetLayout(layout);
  header_.rank = rank;
  header_.source = source;
  header_.chunk_size = kDefaultPiece;
  const SourceLookup lookup = [this](std::string_view name) { return FindSource(name); };
  for (const PlannedTensor& p : plan.tensors) {
    TensorEntry e = PlannedEntry(p);
    e.nbytes = p.nbytes;  // what a writer lays out; nothing is written here
    EntryMap map = MapEntry(e, layout.kind, layout.world_size, rank, description_);
    if (conversion) ExpandConversion(map, *conversion);
    if (const std::string why = CheckSources(map, lookup); !why.empty()) {
      Fail(ErrorCode::kMismatch, description_ + ": tensor \"" + e.name + "\": " + why);
    }
    bool converted = false;
    for (const EntrySegment& seg : map.segments) {
      if (seg.count == 0 || seg.kind == EntrySegment::Kind::kPadding || seg.kind == EntrySegment::Kind::kZero) {
        continue;
      }
      const SourceTensor* t = FindSource(seg.source);
      converted = converted || t->dtype != e.dtype || !seg.IsSourced();  // dequantized: converted too
      const uint64_t bits = Info(t->dtype).bits;
      if (seg.IsSourced()) {  // from its first element to its last (a strided one's rows between)
        NoteFiles(*t, seg.SourceElementAt(0) * bits / 8, ((seg.SourceElementAt(seg.count - 1) + 1) * bits + 7) / 8);
      } else {  // dequantized: the weights and their scales, whole (a superset of what is read)
        NoteFiles(*t, 0, t->nbytes);
        if (const SourceTensor* sc = FindSource(seg.scale)) NoteFiles(*sc, 0, sc->nbytes);
      }
    }
    if (converted) ++converted_;
    header_.tensors.push_back(std::move(e));
    maps_.push_back(std::move(map));
  }
}


std::vector<SourceRankView::Range> PlannedView::ReadRanges() const {
  // Every planned entry filled as a load fills it, with a read that records instead of
  // reading: strided rows, dequantization scales and conversions read what they read.
  std::vector<Range> ranges;
  const SourceLookup lookup = [this](std::string_view name) { return FindSource(name); };
  const SourceRead record = [&](size_t file_index, uint64_t offset, size_t size, void*) {
    AddRanges(file_index, offset, size, ranges);
  };
  std::vector<char> out(kDefaultPiece), scratch;
  for (size_t i = 0; i < maps_.size(); ++i) {
    const uint64_t nbytes = header_.tensors[i].nbytes;
    for (uint64_t b = 0; b < nbytes; b += kDefaultPiece) {
      FillEntry(maps_[i], lookup, record, b, std::min<uint64_t>(kDefaultPiece, nbytes - b), out.data(), scratch);
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.path != b.path ? a.path < b.path : a.offset < b.offset;
  });
  std::vector<Range> merged;
  for (Range& r : ranges) {
    if (r.length == 0) continue;
    if (!merged.empty() && merged.back().path == r.path &&
        r.offset <= merged.back().offset + merged.back().length) {
      Range& m = merged.back();
      m.length = std::max(m.offset + m.length, r.offset + r.length) - m.offset;
    } else {
      merged.push_back(std::move(r));
    }
  }
  return merged;
}

double PlannedView::Residency(const std::vector<Piece>& pieces) const {
  const size_t samples = std::min<size_t>(pieces.size(), 64);
  size_t cached = 0;
  for (size_t k = 0; k < samples; ++k) {
    const Piece& p = pieces[k * pieces.size() / samples];
    cached += Cached(p.first_source.first, p.first_source.second) ? 1 : 0;
  }
  return samples ? static_cast<double>(cached) / static_cast<double>(samples) : 1.0;
}

LoadStats PlannedView::Load(std::span<const LoadTarget> targets, DeviceCopier* copier,
                            const LoadOptions& options) const {
  const auto t0 = std::chrono::steady_clock::now();
  std::unordered_map<std::string_view, size_t> index;
  for (size_t i = 0; i < header_.tensors.size(); ++i) index.emplace(header_.tensors[i].name, i);
  struct Job {
    size_t entry;
    const LoadTarget* target;
  };
  std::vector<Job> jobs;
  std::vector<bool> seen(header_.tensors.size(), false);
  LoadStats stats;
  bool any_device = false;
  for (const LoadTarget& t : targets) {
    const auto it = index.find(t.name);
    if (it == index.end()) {
      Fail(ErrorCode::kNotFound, description_ + ": no tensor \"" + t.name + "\" in this rank's part");
    }
    if (seen[it->second]) Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\" targeted twice");
    seen[it->second] = true;
    const TensorEntry& e = header_.tensors[it->second];
    if (t.nbytes != e.nbytes) {
      Fail(ErrorCode::kMismatch, "tensor \"" + t.name + "\": target holds " + std::to_string(t.nbytes) +
                                     " bytes, this rank's part is " + std::to_string(e.nbytes));
    }
    if (e.nbytes > 0 && t.ptr == nullptr) {
      Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\": no destination");
    }
    if (e.nbytes > 0 && t.on_device) {
      if (!copier) {
        Fail(ErrorCode::kUnsupported,
             "tensor \"" + t.name + "\" is in device memory, and this build or call has no copy engine");
      }
      any_device = true;
    }
    jobs.push_back({it->second, &t});
    stats.bytes += e.nbytes;
    stats.tensors += 1;
  }
  const SourceLookup lookup = [this](std::string_view name) { return FindSource(name); };
  std::vector<Piece> pieces;
  uint64_t piece = 0;
  auto cut = [&](uint64_t bytes) {  // the pieces of `bytes` each, in source order
    piece = std::max<uint64_t>(4096, (bytes ? bytes : kDefaultPiece) / 4096 * 4096);
    pieces.clear();
    for (uint32_t j = 0; j < jobs.size(); ++j) {
      const TensorEntry& e = header_.tensors[jobs[j].entry];
      for (uint64_t b = 0; b < e.nbytes;) {
        const uint64_t end = PieceEnd(maps_[jobs[j].entry], b, std::min(b + piece, e.nbytes));
        Piece p{j, b, end - b, {}};
        p.first_source = FirstSourceByte(maps_[jobs[j].entry], lookup, b);
        pieces.push_back(p);
        b = end;
      }
    }
    // Source order: the disk sees reads in file order, however the model orders its tensors.
    std::stable_sort(pieces.begin(), pieces.end(),
                     [](const Piece& a, const Piece& b) { return a.first_source < b.first_source; });
  };
  cut(options.span_bytes);
  // A source on disk (as the rank-file loader decides, from the page cache): fewer readers,
  // pieces of cold_span_bytes, and O_DIRECT reads or (host targets) one thread asking the
  // kernel to read ahead in source order, so that the disk sees long sequential requests
  // rather than each reader's 4 MiB at a time.
  bool cold = options.io == IoMode::kReadahead || options.io == IoMode::kDirect;
  if (options.io == IoMode::kAuto && !pieces.empty()) cold = Residency(pieces) < 0.5;
  if (cold && options.cold_span_bytes && options.cold_span_bytes != options.span_bytes) {
    cut(options.cold_span_bytes);
  }
  // Another layout's rank files on disk bound for the device are read O_DIRECT, as the
  // rank-file loader reads its file (ChooseIo): buffered reads with kernel read-ahead fell
  // short of the disk there (run AP: 0.78x the rank file from another layout, cold). The
  // Hugging Face files the other way round: a rank's part of every tensor came 1.42 GB/s
  // through the page cache with read-ahead against 1.09 O_DIRECT, the rank file 1.68 (run
  // CL1, bench/HISTORY.md §18). Host targets: O_DIRECT only when asked.
  bool all_device = true;
  for (const Job& j : jobs) all_device &= j.target->on_device || header_.tensors[j.entry].nbytes == 0;
  const std::vector<File>* direct = nullptr;
  if (options.io == IoMode::kDirect ||
      (options.io == IoMode::kAuto && cold && all_device && any_device && DirectWhenCold())) {
    direct = OpenDirect();
  }
  unsigned threads = std::max(1u, options.threads);
  // Cold, a view keeps twice the rank file's cold readers busy: its reads are a part of each
  // tensor, scattered over the source, and the disk serves those faster with more requests
  // in flight (run AR, bench/HISTORY.md §14: 16 readers against 8 gave 1.31 against 1.17
  // GB/s from another layout O_DIRECT; run CL1, §18: from the HF files through the page
  // cache 1.42 at 16; the rank file's one sequential file is best at 8, §7).
  // (Doubled where measured: O_DIRECT reads, and the Hugging Face files read ahead onto the
  // device; other buffered cold loads keep the rank file's count.)
  const bool doubled = direct != nullptr || (!DirectWhenCold() && all_device && any_device);
  if (cold && options.cold_threads) threads = std::min(threads, (doubled ? 2 : 1) * options.cold_threads);
  const unsigned lanes = std::max(1u, ParallelThreads(pieces.size(), threads));
  const int slots = static_cast<int>(std::max(1u, options.slots_per_thread));
  if (any_device) {
    stats.staging_alloc_seconds = copier->Reserve(piece, static_cast<int>(lanes));
    stats.staging_bytes = piece * lanes * static_cast<uint64_t>(slots);
  }
  std::atomic<uint64_t> read_bytes{0};
  std::atomic<size_t> taken{0};  // pieces the readers have started (for the read-ahead)
  std::atomic<bool> finished{false};
  std::thread ahead;
  if (cold && direct == nullptr) {
    ahead = std::thread([&] {
      constexpr uint64_t kAhead = 512ull << 20;  // bytes advised beyond the readers
      uint64_t advised = 0;
      std::vector<uint64_t> ends(pieces.size());
      for (size_t i = 0, at = 0; i < pieces.size(); ++i) ends[i] = at += pieces[i].length;
      for (size_t i = 0; i < pieces.size() && !finished.load();) {
        const size_t t = taken.load();
        if (advised > (t ? ends[std::min(t, pieces.size()) - 1] : 0) + kAhead) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          continue;
        }
        Advise(pieces[i].first_source.first, pieces[i].first_source.second, pieces[i].length);
        advised = ends[i++];
      }
    });
  }
  struct Joiner {
    std::atomic<bool>& finished;
    std::thread& t;
    ~Joiner() {
      finished = true;
      if (t.joinable()) t.join();
    }
  } joiner{finished, ahead};
  // Each lane takes the next piece in source order. On the copy engine's pool when the
  // caller has one (reshard.prepare started its threads and bound each to its lane), else on
  // threads started for this load.
  std::atomic<size_t> next_piece{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;
  auto lane_main = [&](int lane) {
    try {
      if (any_device) copier->BindThread(lane);
      std::unique_ptr<ThreadSource> src =
          MakeThreadSource(options.verify_checksums, cold ? 0 : options.hash_piece_bytes, direct);
      const SourceRead read = [&src](size_t fi, uint64_t off, size_t n, void* dst) { src->Read(fi, off, n, dst); };
      std::vector<char> scratch;
      int slot = 0;
      uint64_t mine = 0;
      for (size_t i; !failed.load(std::memory_order_relaxed) && (i = next_piece.fetch_add(1)) < pieces.size();) {
        for (size_t t = taken.load(); t < i + 1 && !taken.compare_exchange_weak(t, i + 1);) {
        }
        const Piece& p = pieces[i];
        const Job& job = jobs[p.job];
        char* dst = static_cast<char*>(job.target->ptr) + p.begin;
        if (job.target->on_device) {
          copier->WaitSlot(lane, slot);
          char* staging = static_cast<char*>(copier->Staging(lane, slot, piece));
          mine += FillEntry(maps_[job.entry], lookup, read, p.begin, p.length, staging, scratch);
          copier->CopyAsync(lane, slot, dst, staging, p.length);
          slot = (slot + 1) % slots;
        } else {
          mine += FillEntry(maps_[job.entry], lookup, read, p.begin, p.length, dst, scratch);
        }
        if (options.progress != nullptr) options.progress->fetch_add(p.length, std::memory_order_relaxed);
      }
      read_bytes += mine;
    } catch (...) {  // the first error stops every lane at its next piece, rethrown below
      failed = true;
      const std::lock_guard<std::mutex> g(error_mu);
      if (!error) error = std::current_exception();
    }
  };
  stats.pooled = RunLanes(lanes, options.pool, lane_main);
  if (error) std::rethrow_exception(error);
  finished = true;
  if (any_device) copier->Synchronize();
  stats.cold = cold;
  stats.direct_io = direct != nullptr;
  stats.stored_bytes = read_bytes.load();
  stats.threads = lanes;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

// ---- a Hugging Face checkpoint ----------------------------------------------------------------

class CheckpointSource final : public ThreadSource {
 public:
  // `direct`: the files opened O_DIRECT, read through a DirectReader (a safetensors file's
  // tensors start anywhere: most bytes go through its bounce buffer), or null.
  CheckpointSource(const std::vector<File>& files, const std::vector<File>* direct)
      : files_(files), direct_(direct) {}
  void Read(size_t file_index, uint64_t offset, size_t size, void* dst) override {
    // Small reads stay buffered: the rows of a column split (Shard(1)) are one read each, and
    // O_DIRECT would make each a synchronous block read with no read-ahead.
    if (direct_ && size >= kDirectMin) {
      reader_.Read(direct_->at(file_index), dst, size, offset);
    } else {
      files_.at(file_index).PReadExact(dst, size, offset);
    }
  }

 private:
  static constexpr size_t kDirectMin = 64 << 10;
  const std::vector<File>& files_;
  const std::vector<File>* direct_;
  DirectReader reader_;
};

class CheckpointView final : public PlannedView {
 public:
  CheckpointView(const fs::path& src, const LayoutSpec& layout, uint32_t rank,
                 const std::set<std::string>& whole, const std::string& manifest_json,
                 const ParallelPlan* plan, const std::string& plan_path) {
    ckpt_ = OpenCheckpoint(src);
    description_ = "Hugging Face checkpoint " + ckpt_.dir.string();
    std::string prefix;
    if (!manifest_json.empty()) {
      model_ = ParseModelManifest(manifest_json, description_ + " (captured model manifest)");
      prefix = model_->base_model_prefix;
    }
    const Conversion* conversion = model_ && model_->conversion ? &*model_->conversion : nullptr;
    if (conversion && !conversion->refused.empty()) {
      Fail(ErrorCode::kUnsupported,
           description_ + ": the model (" + model_->model_class + ") is loaded from this checkpoint "
           "through transformers " + conversion->transformers_version + "' weight conversion, and " +
               std::to_string(conversion->refused.size()) +
               " of its tensors cannot be converted: " + conversion->refused.front());
    }
    view_ = conversion ? ModelView(ckpt_, *conversion, description_) : ckpt_;
    conversion_ = conversion;
    for (const auto& f : ckpt_.files) files_.push_back(File::OpenRead(f.path));
    Plan(view_, layout, rank, whole, prefix, conversion_, ckpt_.fingerprint, model_ ? &*model_ : nullptr, plan,
         plan_path);
  }

 protected:
  std::unique_ptr<ThreadSource> MakeThreadSource(bool, uint64_t, const std::vector<File>* direct) const override {
    return std::make_unique<CheckpointSource>(files_, direct);
  }
  std::vector<const File*> SourceFiles() const override {
    std::vector<const File*> out;
    for (const File& f : files_) out.push_back(&f);
    return out;
  }
  bool Cached(size_t file_index, uint64_t offset) const override {
    return file_index >= files_.size() || ByteCached(files_[file_index].fd(), offset);
  }
  bool DirectWhenCold() const override { return false; }
  void Advise(size_t file_index, uint64_t offset, uint64_t size) const override {
    if (file_index < files_.size()) {
      ::posix_fadvise(files_[file_index].fd(), static_cast<off_t>(offset), static_cast<off_t>(size),
                      POSIX_FADV_WILLNEED);
    }
  }
  void NoteFiles(const SourceTensor& t, uint64_t, uint64_t) override { Note(ckpt_.files[t.file_index].path); }
  void AddRanges(size_t file_index, uint64_t offset, uint64_t size, std::vector<Range>& out) const override {
    out.push_back({ckpt_.files.at(file_index).path, offset, size});
  }
  const SourceTensor* FindSource(std::string_view name) const override { return ckpt_.Find(name); }

 private:
  Checkpoint ckpt_;
  Checkpoint view_;
  std::optional<ModelManifest> model_;
  const Conversion* conversion_ = nullptr;
  std::vector<File> files_;
};

// ---- another layout's rank files ---------------------------------------------------------------

// Another layout's rank files through the shared virtual-file reader (reshard/ops/layout_reader.h).
class LayoutSource final : public ThreadSource {
 public:
  LayoutSource(const LayoutBytes& bytes, bool verify, uint64_t hash_piece, const std::vector<File>* direct)
      : r_(bytes, verify, hash_piece, direct) {}
  void Read(size_t, uint64_t offset, size_t size, void* dst) override { r_.Read(offset, size, dst); }

 private:
  LayoutByteReader r_;
};

class LayoutView final : public PlannedView {
 public:
  LayoutView(const fs::path& out, const std::string& key, const LayoutSpec& layout, uint32_t rank,
             const std::set<std::string>& whole, const std::string& manifest_json, HeaderCache* headers,
             const ParallelPlan* plan, const std::string& plan_path) {
    const std::optional<Manifest> manifest = ReadManifest(out);
    if (!manifest) Fail(ErrorCode::kNotFound, (out / kManifestName).string() + ": no such file");
    OpenedLayout opened;
    OpenLayout(out, *manifest, key, opened, headers);
    description_ = opened.description;
    bytes_ = std::move(opened.bytes);
    virt_ = std::move(opened.view);
    std::optional<ModelManifest> model;
    if (!manifest_json.empty()) model = ParseModelManifest(manifest_json, description_ + " (model manifest)");
    Plan(virt_, layout, rank, whole, model ? model->base_model_prefix : "", nullptr, manifest->source,
         model ? &*model : nullptr, plan, plan_path);
  }

 protected:
  std::unique_ptr<ThreadSource> MakeThreadSource(bool verify, uint64_t hash_piece,
                                                 const std::vector<File>* direct) const override {
    return std::make_unique<LayoutSource>(bytes_, verify, hash_piece, direct);
  }
  std::vector<const File*> SourceFiles() const override {
    std::vector<const File*> out;
    for (const RankFileReader& r : bytes_.readers) out.push_back(&r.file());
    return out;
  }
  bool Cached(size_t, uint64_t offset) const override {
    LayoutBytes::Spot at;
    if (!bytes_.Locate(offset, at)) return true;
    const RankFileReader& r = bytes_.readers[at.piece->rank];
    const TensorEntry& e = r.header().tensors[at.piece->entry];
    const uint64_t pos = at.pos;
    const uint64_t in_file = e.codec == Codec::kRaw ? pos : e.frames[pos / r.header().chunk_size].offset;
    return ByteCached(r.file().fd(), r.preamble().data_offset + e.offset + in_file);
  }
  bool DirectWhenCold() const override { return true; }
  void Advise(size_t, uint64_t offset, uint64_t size) const override {
    // The virtual range's pieces, as LayoutSource::Read walks them; raw entries only.
    const uint64_t end = offset + size;
    while (offset < end) {
      LayoutBytes::Spot at;
      if (!bytes_.Locate(offset, at)) return;
      const uint64_t n = std::min<uint64_t>(end - offset, at.left);
      const RankFileReader& r = bytes_.readers[at.piece->rank];
      const TensorEntry& e = r.header().tensors[at.piece->entry];
      if (e.codec == Codec::kRaw) {
        const uint64_t cs = r.header().chunk_size;
        const uint64_t a = at.pos / cs * cs;
        const uint64_t b = std::min(e.nbytes, at.pos + n);
        ::posix_fadvise(r.file().fd(), static_cast<off_t>(r.preamble().data_offset + e.offset + a),
                        static_cast<off_t>(b - a), POSIX_FADV_WILLNEED);
      }
      offset += n;
    }
  }
  void NoteFiles(const SourceTensor& t, uint64_t begin, uint64_t end) override {
    const size_t ti = static_cast<size_t>(
        std::upper_bound(bytes_.starts.begin(), bytes_.starts.end(), t.offset) - bytes_.starts.begin() - 1);
    for (const TensorPiece& p : bytes_.tensors[ti].pieces) {
      if (p.dst_offset < end && begin < p.dst_offset + p.length) Note(bytes_.readers[p.rank].path());
    }
  }
  const SourceTensor* FindSource(std::string_view name) const override { return virt_.Find(name); }
  void AddRanges(size_t, uint64_t offset, uint64_t size, std::vector<Range>& out) const override {
    for (uint64_t at = offset; at < offset + size;) {
      LayoutBytes::Spot spot;
      if (!bytes_.Locate(at, spot)) return;
      const uint64_t n = std::min<uint64_t>(offset + size - at, spot.left);
      const RankFileReader& r = bytes_.readers[spot.piece->rank];
      const TensorEntry& e = r.header().tensors[spot.piece->entry];
      const uint64_t cs = r.header().chunk_size;
      const uint64_t first = spot.pos / cs, last = (spot.pos + n - 1) / cs;  // whole chunks, as read
      const uint64_t base = r.preamble().data_offset + e.offset;
      if (e.codec == Codec::kRaw) {
        const uint64_t b = first * cs, x = std::min(e.nbytes, (last + 1) * cs);
        out.push_back({r.path(), base + b, x - b});
      } else {
        const uint64_t b = e.frames[first].offset, x = e.frames[last].offset + e.frames[last].size;
        out.push_back({r.path(), base + b, x - b});
      }
      at += n;
    }
  }
  uint64_t PieceEnd(const EntryMap& map, uint64_t begin, uint64_t end) const override {
    // The segment holding `begin`: a run of one virtual tensor's bytes in the same dtype.
    const uint64_t item = Info(map.dtype).bits / 8;
    if (item == 0) return end;
    for (const EntrySegment& s : map.segments) {
      const uint64_t s0 = s.element * item, s1 = (s.element + s.count) * item;
      if (begin < s0 || begin >= s1) continue;
      if (s.kind != EntrySegment::Kind::kSource || end > s1) return end;
      const SourceTensor* t = virt_.Find(s.source);
      if (!t || t->dtype != map.dtype) return end;
      LayoutBytes::Spot at;
      if (!bytes_.Locate(t->offset + s.source_element * item + (begin - s0), at)) return end;
      if (end - begin > at.left) return end;  // crosses into another rank file's piece
      const uint64_t cs = bytes_.readers[at.piece->rank].header().chunk_size;
      const uint64_t boundary = (at.pos + (end - begin)) / cs * cs;  // the last one inside
      if (boundary <= at.pos || (boundary - at.pos) % item != 0) return end;
      return begin + (boundary - at.pos);
    }
    return end;
  }

 private:
  LayoutBytes bytes_;
  Checkpoint virt_;
};

}  // namespace

std::unique_ptr<SourceRankView> SourceRankView::OfCheckpoint(const fs::path& src, const LayoutSpec& layout,
                                                             uint32_t rank, const std::set<std::string>& whole,
                                                             const std::string& model_manifest_json,
                                                             const ParallelPlan* plan,
                                                             const std::string& plan_path) {
  return std::make_unique<CheckpointView>(src, layout, rank, whole, model_manifest_json, plan, plan_path);
}

std::unique_ptr<SourceRankView> SourceRankView::OfLayout(const fs::path& out, const std::string& key,
                                                         const LayoutSpec& layout, uint32_t rank,
                                                         const std::set<std::string>& whole,
                                                         const std::string& model_manifest_json,
                                                         HeaderCache* headers, const ParallelPlan* plan,
                                                         const std::string& plan_path) {
  return std::make_unique<LayoutView>(out, key, layout, rank, whole, model_manifest_json, headers, plan,
                                      plan_path);
}

}  // namespace reshard
