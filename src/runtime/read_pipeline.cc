#include "runtime/read_pipeline.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"
#include "reshard/io/rank_file.h"

namespace reshard {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, AlignedFree>;

AlignedBuffer AllocAligned(size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, kDataAlignment, AlignUp(bytes, kDataAlignment)) != 0) {
    Fail(ErrorCode::kIo, "out of host memory allocating " + std::to_string(bytes) + " bytes");
  }
  return AlignedBuffer(static_cast<char*>(p));
}

// This thread's CPU time in seconds and its involuntary context switches so far.
struct ThreadUsage {
  double cpu = 0;
  long involuntary = 0;
};

ThreadUsage ThisThreadUsage() {
  ThreadUsage u;
  timespec ts{};
  if (::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) u.cpu = ts.tv_sec + ts.tv_nsec * 1e-9;
  rusage ru{};
  if (::getrusage(RUSAGE_THREAD, &ru) == 0) u.involuntary = ru.ru_nivcsw;
  return u;
}

// The first error of a run; once there is one, the reader threads stop at their next span.
class FirstError {
 public:
  void Record(std::exception_ptr e) {
    failed_ = true;
    std::lock_guard<std::mutex> g(mu_);
    if (!error_) error_ = std::move(e);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void RethrowIfAny() const {
    std::lock_guard<std::mutex> g(mu_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::exception_ptr error_;
};

// The plan's spans, handed out in file order to whichever reader thread asks next.
class SpanQueue {
 public:
  explicit SpanQueue(size_t size) : size_(size) {}
  // The index of the next span, or size() when none is left.
  size_t Take() { return std::min(next_.fetch_add(1), size_); }
  // The next span not yet taken (what the read-ahead stays in front of).
  size_t position() const { return next_.load(); }
  size_t size() const { return size_; }

 private:
  const size_t size_;
  std::atomic<size_t> next_{0};
};

// One reader thread: drives copier lane `lane` and cycles through its staging slots, one per
// span bound for the device.
class ReaderLane {
 public:
  ReaderLane(const LoadPlan& plan, const PlanSource& source, DeviceCopier* copier, int lane,
             LaneTimes* times, Clock::time_point t0)
      : plan_(plan), source_(source), copier_(copier), lane_(lane), times_(times), t0_(t0) {}

  // Takes spans until none is left or another thread failed; records its own error.
  void Run(SpanQueue& queue, FirstError& errors) {
    ThreadUsage usage0;
    if (times_ != nullptr) {
      times_->start = Seconds(Clock::now() - t0_);
      usage0 = ThisThreadUsage();
      times_->start_cpu = ::sched_getcpu();
    }
    try {
      if (plan_.any_device) copier_->BindThread(lane_);
      while (!errors.failed()) {
        const size_t si = queue.Take();
        if (si >= queue.size()) break;
        const LoadSpan& span = plan_.spans[si];
        Read(span);
        if (plan_.progress != nullptr) {
          const uint64_t landed = span.kind == SpanKind::kDeviceRaw ? span.bytes()
                                                                     : plan_.chunks[span.first_chunk].length;
          plan_.progress->fetch_add(landed, std::memory_order_relaxed);
        }
      }
    } catch (...) {
      errors.Record(std::current_exception());
    }
    if (times_ != nullptr) {
      const ThreadUsage usage1 = ThisThreadUsage();
      times_->cpu = usage1.cpu - usage0.cpu;
      times_->involuntary = usage1.involuntary - usage0.involuntary;
      times_->end = Seconds(Clock::now() - t0_);
    }
  }

 private:
  void Read(const LoadSpan& s) {
    const PlannedChunk& k = plan_.chunks[s.first_chunk];
    switch (s.kind) {
      case SpanKind::kDeviceRaw: return DeviceRawSpan(s);
      case SpanKind::kDeviceZstd: return DeviceZstdChunk(k);
      case SpanKind::kHostRaw:
        source_.buffered->PReadExact(k.dst, k.length, k.at);
        return Check(k, k.dst);
      case SpanKind::kHostZstd:
        DecodeZstdFrame(ReadFrame(k), k.stored, k.dst, k.length, What(k));
        return Check(k, k.dst);
    }
  }

  // Raw chunks bound for the device: read into a staging slot, checked, then copied.
  void DeviceRawSpan(const LoadSpan& s) {
    Clock::time_point tr;
    if (times_ != nullptr) {
      const Clock::time_point tw = Clock::now();
      copier_->WaitSlot(lane_, slot_);
      tr = Clock::now();
      times_->wait += Seconds(tr - tw);
    } else {
      copier_->WaitSlot(lane_, slot_);
    }
    char* stage = static_cast<char*>(copier_->Staging(lane_, slot_, plan_.slot_bytes));
    uint64_t copied = s.begin;  // the span's bytes [begin, copied) have been copied
    const bool lead = plan_.lead_in > 0 && first_span_ && source_.direct == nullptr;
    if (source_.direct != nullptr) {
      ReadDirect(s, stage);
    } else if (plan_.hash_piece || lead) {
      ReadInPieces(s, stage, lead, copied);
    } else {
      source_.buffered->PReadExact(stage, s.bytes(), s.begin);
    }
    if (!plan_.hash_piece) {  // pieces were hashed as they were read
      for (size_t i = s.first_chunk; i < s.first_chunk + s.chunk_count; ++i) {
        const PlannedChunk& k = plan_.chunks[i];
        Check(k, stage + (k.at - s.begin));
      }
    }
    if (times_ != nullptr) times_->read += Seconds(Clock::now() - tr);
    CopyRange(s, stage, copied, s.end);
    first_span_ = false;
    NextSlot();
  }

  void ReadDirect(const LoadSpan& s, char* stage) {
    const size_t got = source_.direct->PReadUpTo(stage, AlignUp(s.bytes(), kDataAlignment), s.begin);
    if (got < s.bytes()) {
      const PlannedChunk& k = plan_.chunks[s.first_chunk];
      Fail(ErrorCode::kDataLoss, *source_.path + ": tensor \"" + Entry(k).name + "\" chunk " +
                                     std::to_string(k.chunk) + ": truncated file (read " +
                                     std::to_string(got) + " of " + std::to_string(s.bytes()) +
                                     " bytes)");
    }
  }

  // Each chunk in pieces of read_step bytes, each hashed while it is still in this core's
  // cache. In a lane's first span with a lead-in, parts are copied as soon as they are read.
  void ReadInPieces(const LoadSpan& s, char* stage, bool lead, uint64_t& copied) {
    const uint64_t step = plan_.read_step;
    LeadIn lead_in(plan_.lead_in);
    for (size_t i = s.first_chunk; i < s.first_chunk + s.chunk_count; ++i) {
      const PlannedChunk& k = plan_.chunks[i];
      char* dst = stage + (k.at - s.begin);
      hasher_.Reset();
      for (uint64_t off = 0; off < k.stored; off += step) {
        const uint64_t m = std::min(step, k.stored - off);
        source_.buffered->PReadExact(dst + off, m, k.at + off);
        if (plan_.hash_piece) hasher_.Update(dst + off, m);
        if (lead && lead_in.Due(copied, k.at + off + m, s.end)) {
          CopyRange(s, stage, copied, k.at + off + m);
          copied = k.at + off + m;
        }
      }
      if (plan_.hash_piece) {
        const uint64_t hash = hasher_.Digest();
        if (hash != Entry(k).chunk_xxh3[k.chunk]) Mismatch(k, hash);
      }
    }
  }

  // A zstd chunk bound for the device: decoded into staging, checked, copied.
  void DeviceZstdChunk(const PlannedChunk& k) {
    copier_->WaitSlot(lane_, slot_);
    char* stage = static_cast<char*>(copier_->Staging(lane_, slot_, plan_.slot_bytes));
    DecodeZstdFrame(ReadFrame(k), k.stored, stage, k.length, What(k));
    Check(k, stage);
    Copy(k.dst, stage, k.length);
    NextSlot();
  }

  // Reads the stored bytes of a zstd frame into scratch; returns a pointer to them.
  const char* ReadFrame(const PlannedChunk& k) {
    const bool direct = source_.direct != nullptr;
    const uint64_t begin = direct ? k.at / kDataAlignment * kDataAlignment : k.at;
    const uint64_t end = direct ? AlignUp(k.at + k.stored, kDataAlignment) : k.at + k.stored;
    if (scratch_size_ < end - begin) {
      scratch_ = AllocAligned(end - begin);
      scratch_size_ = end - begin;
    }
    const File& src = direct ? *source_.direct : *source_.buffered;
    const size_t got = src.PReadUpTo(scratch_.get(), end - begin, begin);
    if (got < k.at + k.stored - begin) {
      Fail(ErrorCode::kDataLoss, *source_.path + ": truncated: tensor \"" + Entry(k).name +
                                     "\" frame " + std::to_string(k.chunk) + " ends past the file");
    }
    return scratch_.get() + (k.at - begin);
  }

  void Check(const PlannedChunk& k, const void* data) {
    if (!plan_.verify_checksums) return;
    const uint64_t hash = Xxh3(data, k.length);
    if (hash != Entry(k).chunk_xxh3[k.chunk]) Mismatch(k, hash);
  }

  [[noreturn]] void Mismatch(const PlannedChunk& k, uint64_t hash) const {
    const TensorEntry& e = Entry(k);
    Fail(ErrorCode::kDataLoss,
         *source_.path + ": tensor \"" + e.name + "\" chunk " + std::to_string(k.chunk) +
             ": checksum mismatch: data hashes to " + Hex16(hash) + ", header says " +
             Hex16(e.chunk_xxh3[k.chunk]) +
             " (the file is corrupt: `reshard verify` on its directory lists every damaged file; "
             "convert again, or restore a saved checkpoint from a copy)");
  }

  // The span's file bytes [from, to), from its staging slot: its planned copies clipped.
  void CopyRange(const LoadSpan& s, const char* stage, uint64_t from, uint64_t to) {
    ForEachCopy(plan_, s, from, to, [&](char* dst, uint64_t at, uint64_t n) { Copy(dst, stage + at, n); });
  }

  // This lane's next copy, from its current staging slot.
  void Copy(void* dst, const void* src, uint64_t n) {
    if (times_ == nullptr) {
      copier_->CopyAsync(lane_, slot_, dst, src, n);
      return;
    }
    const Clock::time_point tc = Clock::now();
    if (times_->first_copy < 0) times_->first_copy = Seconds(tc - t0_);
    copier_->CopyAsync(lane_, slot_, dst, src, n);
    times_->issue += Seconds(Clock::now() - tc);
  }

  void NextSlot() { slot_ = (slot_ + 1) % plan_.slots; }

  const TensorEntry& Entry(const PlannedChunk& k) const { return *plan_.jobs[k.job].entry; }
  std::string What(const PlannedChunk& k) const {
    return *source_.path + ": tensor \"" + Entry(k).name + "\" chunk " + std::to_string(k.chunk);
  }

  const LoadPlan& plan_;
  const PlanSource& source_;
  DeviceCopier* const copier_;
  const int lane_;
  LaneTimes* const times_;  // null: no diagnostics
  const Clock::time_point t0_;
  int slot_ = 0;
  bool first_span_ = true;  // no device raw span read yet (the lead-in's span)
  AlignedBuffer scratch_;   // zstd frames as stored
  size_t scratch_size_ = 0;
  Xxh3Hasher hasher_;
};

// Read-ahead: walks the spans' byte ranges in file order, coalesced into windows, and asks
// the kernel to start reading each window, staying at most kAhead bytes in front of the
// readers (whose position is the queue's).
class ReadAhead {
 public:
  ReadAhead(const LoadPlan& plan, const File& file, const SpanQueue& queue, const FirstError& errors)
      : plan_(plan), file_(file), queue_(queue), errors_(errors) {
    if (!plan.spans.empty()) thread_ = std::thread([this] { Loop(); });
  }
  ~ReadAhead() { Stop(); }
  void Stop() {
    finished_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    constexpr uint64_t kWindow = 32ull << 20, kAhead = 512ull << 20;
    const std::vector<LoadSpan>& spans = plan_.spans;
    size_t i = 0;
    while (i < spans.size() && !finished_.load() && !errors_.failed()) {
      const size_t consumer = queue_.position();
      if (consumer < spans.size() && spans[i].begin > spans[consumer].begin + kAhead) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      const uint64_t begin = spans[i].begin;
      uint64_t end = spans[i].end;
      while (++i < spans.size() && spans[i].begin <= end + kDataAlignment &&
             spans[i].end - begin <= kWindow) {
        end = std::max(end, spans[i].end);
      }
      ::posix_fadvise(file_.fd(), static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                      POSIX_FADV_WILLNEED);
    }
  }

  const LoadPlan& plan_;
  const File& file_;
  const SpanQueue& queue_;
  const FirstError& errors_;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};


}  // namespace

PipelineResult RunPlan(const LoadPlan& plan, const PlanSource& source, DeviceCopier* copier,
                       WorkerPool* pool, bool timed, Clock::time_point t0) {
  PipelineResult result;
  if (timed) result.lanes.resize(plan.lanes);
  SpanQueue queue(plan.spans.size());
  FirstError errors;
  {
    std::unique_ptr<ReadAhead> ahead;
    if (source.readahead) ahead = std::make_unique<ReadAhead>(plan, *source.buffered, queue, errors);
    result.pooled = RunLanes(plan.lanes, pool, [&](int lane) {
      ReaderLane(plan, source, copier, lane, timed ? &result.lanes[lane] : nullptr, t0).Run(queue, errors);
    });
    if (timed) result.reads_done = Seconds(Clock::now() - t0);
  }  // the read-ahead stops
  if (plan.any_device) {
    const Clock::time_point ts = timed ? Clock::now() : Clock::time_point();
    try {
      copier->Synchronize();
    } catch (...) {
      errors.Record(std::current_exception());
    }
    if (timed) result.sync = Seconds(Clock::now() - ts);
  }
  errors.RethrowIfAny();
  return result;
}

}  // namespace reshard
