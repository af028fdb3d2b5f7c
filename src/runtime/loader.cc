#include "reshard/runtime/loader.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "reshard/base/checksum.h"
#include "reshard/base/error.h"

namespace reshard {

namespace {

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

struct Job {
  const TensorEntry* entry;
  const LoadTarget* target;
};

struct Item {
  uint32_t job;
  uint64_t chunk;
};

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

}  // namespace

uint64_t SpanLimit(const LoadOptions& o, bool cold) {
  return cold && o.cold_span_bytes ? o.cold_span_bytes : o.span_bytes;
}

unsigned LaneCount(const LoadOptions& o, bool cold) {
  const unsigned threads = std::max(1u, o.threads);
  return cold && o.cold_threads ? std::min(o.cold_threads, threads) : threads;
}

uint64_t PreparedSlotBytes(const LoadOptions& o, uint64_t chunk_size) {
  // A slot holds one span, or one chunk when the chunk is longer.
  auto slot = [&](bool cold) {
    return AlignUp(std::max(SpanLimit(o, cold), chunk_size), kDataAlignment);
  };
  const unsigned lanes = LaneCount(o, false);
  const uint64_t need = std::max(uint64_t{lanes} * slot(false), uint64_t{LaneCount(o, true)} * slot(true));
  return AlignUp((need + lanes - 1) / lanes, kDataAlignment);
}

LoadReport LoadRankFile(const RankFileReader& file, std::span<const LoadTarget> targets,
                        DeviceCopier* copier, const LoadOptions& options) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const RankFileHeader& h = file.header();
  const uint64_t cs = h.chunk_size;
  const uint64_t data_offset = file.preamble().data_offset;

  std::map<std::string_view, const TensorEntry*> by_name;
  for (const auto& e : h.tensors) by_name[e.name] = &e;
  std::vector<Job> jobs;
  std::map<std::string_view, bool> seen;
  bool any_device = false;
  LoadReport report;
  for (const auto& t : targets) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      Fail(ErrorCode::kMismatch, file.path() + ": has no tensor \"" + t.name + "\"");
    }
    if (!seen.emplace(t.name, true).second) {
      Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\" is a load target twice");
    }
    const TensorEntry& e = *it->second;
    if (e.nbytes != t.nbytes) {
      Fail(ErrorCode::kMismatch, file.path() + ": tensor \"" + t.name + "\" holds " +
                                     std::to_string(e.nbytes) + " bytes, the destination has " +
                                     std::to_string(t.nbytes));
    }
    if (t.nbytes > 0 && t.ptr == nullptr) {
      Fail(ErrorCode::kInvalidArgument, "tensor \"" + t.name + "\": null destination");
    }
    if (t.on_device && copier == nullptr) {
      Fail(ErrorCode::kInvalidArgument,
           "tensor \"" + t.name + "\" goes to device memory but no device copier was given");
    }
    any_device |= t.on_device && t.nbytes > 0;
    jobs.push_back({&e, &t});
    report.bytes += e.nbytes;
    report.stored_bytes += e.stored_size;
  }
  report.tensors = jobs.size();
  std::sort(jobs.begin(), jobs.end(),
            [](const Job& a, const Job& b) { return a.entry->offset < b.entry->offset; });
  std::vector<Item> items;
  for (uint32_t j = 0; j < jobs.size(); ++j) {
    const TensorEntry& e = *jobs[j].entry;
    for (uint64_t c = 0; c < e.ChunkCount(cs); ++c) items.push_back({j, c});
  }

  // Files in the page cache are read with plain buffered reads. Files on disk, measured on
  // the GPU machine's virtual disk (bench/HISTORY.md §7, bench/bench_loader_knobs.py): O_DIRECT
  // spans of several MiB from a few threads reach the sequential-read ceiling (0.95-1.02×),
  // buffered reads with kernel read-ahead 0.63-0.96×; so kAuto picks kDirect for device
  // targets (host targets are read into place, unaligned: kReadahead).
  bool direct = false;
  bool readahead = options.io == IoMode::kReadahead;
  if (options.io == IoMode::kDirect) {
    direct = any_device;
  } else if (options.io == IoMode::kAuto) {
    const auto tr = Clock::now();
    report.resident_fraction = PageCacheResidency(file.path());
    report.residency_seconds = since(tr);
    if (report.resident_fraction < 0.5) {
      bool all_device = true;
      for (const auto& j : jobs) all_device &= j.target->on_device || j.entry->nbytes == 0;
      direct = any_device && all_device;
      readahead = !direct;
    }
  }
  File direct_file;
  if (direct) {
    try {
      direct_file = File::OpenRead(file.path(), /*direct=*/true);
    } catch (const Error&) {
      direct = false;  // e.g. tmpfs refuses O_DIRECT
      readahead = options.io == IoMode::kAuto;
    }
  }
  report.direct_io = direct;
  report.readahead = readahead;
  const bool cold = direct || readahead;
  report.cold = cold;
  const File& buffered = file.file();

  // Spans: what one reader thread takes at once. Consecutive raw chunks bound for the
  // device whose bytes are adjacent in the file (tensors start at multiples of 4096, so
  // adjacent tensors leave gaps under 4096 bytes) join one span while it stays within
  // span_limit bytes (0: no joining); a chunk longer than the limit is a span of its own, as
  // is every chunk that is not raw or not bound for the device.
  const uint64_t span_limit = SpanLimit(options, cold);
  struct Span {
    size_t first = 0, count = 0;  // items [first, first + count)
    uint64_t begin = 0, end = 0;  // stored bytes in the file
    bool device_raw = false;
  };
  auto item_at = [&](const Item& it) {
    const TensorEntry& e = *jobs[it.job].entry;
    return data_offset + e.offset +
           (e.codec == Codec::kRaw ? ChunkBegin(cs, it.chunk) : e.frames[it.chunk].offset);
  };
  auto item_len = [&](const Item& it) {
    const TensorEntry& e = *jobs[it.job].entry;
    return e.codec == Codec::kRaw ? ChunkLength(e, cs, it.chunk) : e.frames[it.chunk].size;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < items.size(); ++i) {
    const Job& job = jobs[items[i].job];
    const bool device_raw = job.target->on_device && job.entry->codec == Codec::kRaw;
    const uint64_t at = item_at(items[i]), len = item_len(items[i]);
    if (device_raw && !spans.empty()) {
      Span& last = spans.back();
      if (span_limit > 0 && last.device_raw && at >= last.end && at - last.end < kDataAlignment &&
          at + len - last.begin <= span_limit) {
        last.count += 1;
        last.end = at + len;
        continue;
      }
    }
    spans.push_back({i, 1, at, at + len, device_raw});
  }

  // Cold loads use at most `threads` too: a copier has one lane per thread of `threads`.
  const unsigned want_threads = LaneCount(options, cold);
  const unsigned threads = static_cast<unsigned>(
      std::max<size_t>(1, std::min<size_t>(want_threads ? want_threads : 1, spans.size())));
  const int slots = static_cast<int>(std::max(1u, options.slots_per_thread));
  report.threads = threads;
  // A staging slot holds one span (raw) or one decoded chunk (zstd); sized by the largest
  // (a header may say 16 GiB chunks: slots follow the data, not the header's chunk size).
  uint64_t stage_bytes = kDataAlignment;
  for (const Span& sp : spans) {
    const TensorEntry& e = *jobs[items[sp.first].job].entry;
    if (sp.device_raw) {
      stage_bytes = std::max(stage_bytes, AlignUp(sp.end - sp.begin, kDataAlignment));
      report.span_bytes = std::max(report.span_bytes, sp.end - sp.begin);
    } else if (jobs[items[sp.first].job].target->on_device) {
      stage_bytes = std::max(stage_bytes, std::min(cs, AlignUp(e.nbytes, kDataAlignment)));
    }
  }
  if (any_device) {
    report.staging_bytes = uint64_t{threads} * slots * stage_bytes;
    // Before the workers start: one allocation for every lane (a cached copier that has it
    // already, e.g. from reshard.prepare or an earlier load, returns at once).
    report.staging_alloc_seconds = copier->Reserve(stage_bytes, static_cast<int>(threads));
  }
  const uint64_t piece =
      !cold && options.verify_checksums && options.hash_piece_bytes > 0 ? options.hash_piece_bytes : 0;
  // Lead-in (warm loads): a lane's first span is copied in parts as it is read.
  const uint64_t lead_in = cold ? 0 : options.lead_in_bytes;
  constexpr uint64_t kLeadPiece = 256ull << 10;  // read size of a lead-in without checksums

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  // What each reader thread did, in seconds (times since t0, durations summed).
  struct LaneTimes {
    double start = 0, end = 0;  // when it started (woken) and ran out of spans
    double first_copy = -1;     // when it issued its first copy to the device (-1: none)
    double wait = 0;            // blocked on a staging slot whose copy was in flight
    double read = 0;            // reading (and hashing) raw spans bound for the device
    double issue = 0;           // issuing copies
    double cpu = 0;             // CPU time of the thread from start to end
    long involuntary = 0;       // involuntary context switches from start to end
    int start_cpu = -1;         // the CPU it started on
  };
  std::vector<LaneTimes> lane_times(threads);
  std::mutex error_mu;
  std::exception_ptr error;

  auto worker = [&](int lane) {
    LaneTimes& times = lane_times[lane];
    times.start = since(t0);
    const ThreadUsage usage0 = ThisThreadUsage();
    times.start_cpu = ::sched_getcpu();
    try {
      if (any_device) copier->BindThread(lane);
      AlignedBuffer scratch;
      size_t scratch_size = 0;
      int slot = 0;
      Xxh3Hasher hasher;
      // Reads the stored bytes of a zstd frame into scratch; returns a pointer to them.
      auto read_frame = [&](const TensorEntry& e, uint64_t chunk) -> const char* {
        const Frame& f = e.frames[chunk];
        const uint64_t at = data_offset + e.offset + f.offset;
        const uint64_t begin = direct ? at / kDataAlignment * kDataAlignment : at;
        const uint64_t end = direct ? AlignUp(at + f.size, kDataAlignment) : at + f.size;
        if (scratch_size < end - begin) {
          scratch = AllocAligned(end - begin);
          scratch_size = end - begin;
        }
        const File& src = direct ? direct_file : buffered;
        const size_t got = src.PReadUpTo(scratch.get(), end - begin, begin);
        if (got < at + f.size - begin) {
          Fail(ErrorCode::kDataLoss, file.path() + ": truncated: tensor \"" + e.name +
                                         "\" frame " + std::to_string(chunk) + " ends past the file");
        }
        return scratch.get() + (at - begin);
      };
      auto mismatch = [&](const TensorEntry& e, uint64_t chunk, uint64_t hash) {
        Fail(ErrorCode::kDataLoss,
             file.path() + ": tensor \"" + e.name + "\" chunk " + std::to_string(chunk) +
                 ": checksum mismatch: data hashes to " + Hex16(hash) + ", header says " +
                 Hex16(e.chunk_xxh3[chunk]) + " (the file is corrupt; convert again)");
      };
      auto check = [&](const TensorEntry& e, uint64_t chunk, const void* data, uint64_t len) {
        if (!options.verify_checksums) return;
        const uint64_t hash = Xxh3(data, len);
        if (hash != e.chunk_xxh3[chunk]) mismatch(e, chunk, hash);
      };
      // This lane's next copy, from its current staging slot.
      auto copy_async = [&](void* dst, const void* src, uint64_t n) {
        const auto tc = Clock::now();
        if (times.first_copy < 0) times.first_copy = std::chrono::duration<double>(tc - t0).count();
        copier->CopyAsync(lane, slot, dst, src, n);
        times.issue += since(tc);
      };
      // The current span's bytes [copied, upto) (file offsets), copied from its staging slot:
      // one copy per run of chunks of the same tensor (contiguous on both sides). `part`: the
      // next lead-in part's length.
      bool first_span = true;
      uint64_t copied = 0, part = 0;
      auto copy_upto = [&](const Span& sp, char* stage, uint64_t upto) {
        const TensorEntry* run = nullptr;
        char* run_dst = nullptr;
        uint64_t run_at = 0, run_end = 0;
        auto flush = [&] {
          if (run != nullptr && run_end > run_at) {
            copy_async(run_dst, stage + (run_at - sp.begin), run_end - run_at);
          }
          run = nullptr;
        };
        for (size_t k = sp.first; k < sp.first + sp.count; ++k) {
          const uint64_t at = item_at(items[k]), len = item_len(items[k]);
          const uint64_t lo = std::max(at, copied), hi = std::min(at + len, upto);
          if (lo >= hi) continue;
          const Job& job = jobs[items[k].job];
          if (run != job.entry || run_end != lo) {
            flush();
            run = job.entry;
            run_at = lo;
            run_dst = static_cast<char*>(job.target->ptr) + ChunkBegin(cs, items[k].chunk) + (lo - at);
          }
          run_end = hi;
        }
        flush();
        copied = upto;
      };
      while (!failed.load(std::memory_order_relaxed)) {
        const size_t si = next.fetch_add(1);
        if (si >= spans.size()) break;
        const Span& sp = spans[si];
        if (sp.device_raw) {
          const auto tw = Clock::now();
          copier->WaitSlot(lane, slot);
          const auto tr = Clock::now();
          times.wait += std::chrono::duration<double>(tr - tw).count();
          char* stage = static_cast<char*>(copier->Staging(lane, slot, stage_bytes));
          const uint64_t n = sp.end - sp.begin;
          copied = sp.begin;
          part = lead_in;
          const bool lead = lead_in > 0 && first_span && !direct;
          if (direct) {
            const size_t got = direct_file.PReadUpTo(stage, AlignUp(n, kDataAlignment), sp.begin);
            if (got < n) {
              const Item& it = items[sp.first];
              Fail(ErrorCode::kDataLoss,
                   file.path() + ": tensor \"" + jobs[it.job].entry->name + "\" chunk " +
                       std::to_string(it.chunk) + ": truncated file (read " + std::to_string(got) +
                       " of " + std::to_string(n) + " bytes)");
            }
          } else if (piece || lead) {
            // Each chunk in pieces, each hashed while it is still in this core's cache. In a
            // lane's first span with a lead-in, parts are copied as soon as they are read.
            const uint64_t step = piece ? piece : kLeadPiece;
            for (size_t k = sp.first; k < sp.first + sp.count; ++k) {
              const TensorEntry& e = *jobs[items[k].job].entry;
              const uint64_t at = item_at(items[k]), len = item_len(items[k]);
              char* dst = stage + (at - sp.begin);
              hasher.Reset();
              for (uint64_t off = 0; off < len; off += step) {
                const uint64_t m = std::min(step, len - off);
                buffered.PReadExact(dst + off, m, at + off);
                if (piece) hasher.Update(dst + off, m);
                if (lead && at + off + m - copied >= part && at + off + m < sp.end) {
                  copy_upto(sp, stage, at + off + m);
                  part *= 2;
                }
              }
              if (piece) {
                const uint64_t hash = hasher.Digest();
                if (hash != e.chunk_xxh3[items[k].chunk]) mismatch(e, items[k].chunk, hash);
              }
            }
          } else {
            buffered.PReadExact(stage, n, sp.begin);
          }
          if (!piece) {  // pieces were hashed as they were read
            for (size_t k = sp.first; k < sp.first + sp.count; ++k) {
              check(*jobs[items[k].job].entry, items[k].chunk,
                    stage + (item_at(items[k]) - sp.begin), item_len(items[k]));
            }
          }
          times.read += since(tr);
          copy_upto(sp, stage, sp.end);
          first_span = false;
          slot = (slot + 1) % slots;
          continue;
        }
        const Item& item = items[sp.first];
        const Job& job = jobs[item.job];
        const TensorEntry& e = *job.entry;
        const uint64_t chunk = item.chunk;
        const uint64_t begin = ChunkBegin(cs, chunk);
        const uint64_t len = ChunkLength(e, cs, chunk);
        char* dst = static_cast<char*>(job.target->ptr) + begin;
        auto what = [&] {
          return file.path() + ": tensor \"" + e.name + "\" chunk " + std::to_string(chunk);
        };
        if (!job.target->on_device) {
          if (e.codec == Codec::kRaw) {
            buffered.PReadExact(dst, len, data_offset + e.offset + begin);
          } else {
            const char* frame = read_frame(e, chunk);
            DecodeZstdFrame(frame, e.frames[chunk].size, dst, len, what());
          }
          check(e, chunk, dst, len);
          continue;
        }
        // A zstd chunk bound for the device: decoded into staging.
        copier->WaitSlot(lane, slot);
        char* stage = static_cast<char*>(copier->Staging(lane, slot, stage_bytes));
        const char* frame = read_frame(e, chunk);
        DecodeZstdFrame(frame, e.frames[chunk].size, stage, len, what());
        check(e, chunk, stage, len);
        copy_async(dst, stage, len);
        slot = (slot + 1) % slots;
      }
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> g(error_mu);
      if (!error) error = std::current_exception();
    }
    const ThreadUsage usage1 = ThisThreadUsage();
    times.cpu = usage1.cpu - usage0.cpu;
    times.involuntary = usage1.involuntary - usage0.involuntary;
    times.end = since(t0);
  };

  // Read-ahead: walk the spans' byte ranges in file order, coalesced into windows, and ask
  // the kernel to start reading each window, staying at most kAhead bytes in front of the
  // workers (whose position is spans[next]).
  std::atomic<bool> finished{false};
  std::thread ahead;
  if (readahead && !spans.empty()) {
    ahead = std::thread([&] {
      constexpr uint64_t kWindow = 32ull << 20, kAhead = 512ull << 20;
      size_t i = 0;
      while (i < spans.size() && !finished.load() && !failed.load()) {
        const size_t consumer = next.load();
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
        ::posix_fadvise(buffered.fd(), static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                        POSIX_FADV_WILLNEED);
      }
    });
  }

  if (options.pool != nullptr && options.pool->size() >= threads) {
    // Every lane on a pool thread (started once, so this load starts none).
    report.pooled = true;
    options.pool->Run(threads, [&](unsigned lane) { worker(static_cast<int>(lane)); });
  } else {
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker, static_cast<int>(t));
    worker(0);
    for (auto& t : pool) t.join();
  }
  report.reads_done_seconds = since(t0);
  finished = true;
  if (ahead.joinable()) ahead.join();
  if (any_device) {
    const auto ts = Clock::now();
    try {
      copier->Synchronize();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    report.sync_seconds = since(ts);
  }
  for (unsigned t = 0; t < threads; ++t) {
    const LaneTimes& l = lane_times[t];
    report.wait_seconds += l.wait / threads;
    report.read_seconds += l.read / threads;
    report.lane_start_seconds = std::max(report.lane_start_seconds, l.start);
    report.lane_end_seconds += l.end / threads;
    report.issue_seconds += l.issue / threads;
    report.lane_cpu_seconds += l.cpu / threads;
    report.lane_wall_seconds += (l.end - l.start) / threads;
    report.preemptions += static_cast<uint64_t>(std::max(0L, l.involuntary));
    for (unsigned u = 0; u < threads; ++u) {
      if (u != t && l.start_cpu >= 0 && lane_times[u].start_cpu == l.start_cpu) {
        ++report.lanes_on_shared_cpus;
        break;
      }
    }
    if (l.first_copy >= 0 && (report.first_copy_seconds == 0 || l.first_copy < report.first_copy_seconds)) {
      report.first_copy_seconds = l.first_copy;
    }
  }
  if (error) std::rethrow_exception(error);
  report.seconds = since(t0);
  return report;
}

}  // namespace reshard
