#include "reshard/loader.h"

#include <fcntl.h>
#include <sys/mman.h>
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

#include "reshard/checksum.h"
#include "reshard/error.h"

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

}  // namespace

double DeviceCopier::Reserve(size_t) { return 0; }

void DeviceCopier::CopyToHostAsync(int, int, void*, const void*, size_t) {
  Fail(ErrorCode::kUnsupported, "this device copier copies host to device only");
}

double PageCacheResidency(const std::string& path) {
  File f = File::OpenRead(path);
  const uint64_t size = f.Size();
  if (size == 0) return 1.0;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, f.fd(), 0);
  if (map == MAP_FAILED) return 0.0;
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t pages = (size + page - 1) / page;
  // Sample up to 4096 pages spread over the file: enough to tell cold from warm without
  // walking every page of a many-GB file.
  const size_t samples = std::min<size_t>(pages, 4096);
  size_t resident = 0;
  unsigned char v = 0;
  for (size_t i = 0; i < samples; ++i) {
    const size_t page_index = i * pages / samples;
    if (::mincore(static_cast<char*>(map) + page_index * page, 1, &v) == 0) resident += v & 1;
  }
  const double fraction = static_cast<double>(resident) / static_cast<double>(samples);
  ::munmap(map, size);
  return fraction;
}

LoadReport LoadRankFile(const RankFileReader& file, std::span<const LoadTarget> targets,
                        DeviceCopier* copier, const LoadOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
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

  // Files in the page cache are read with plain buffered reads. For cold files, measured on
  // the GPU machine's virtual disk (BENCHMARKS.md), one sequential kernel read-ahead stream
  // beats O_DIRECT requests, so kAuto picks kReadahead; kDirect stays available (device
  // targets only: host targets are read into place, unaligned).
  bool direct = false;
  bool readahead = options.io == IoMode::kReadahead;
  if (options.io == IoMode::kDirect) {
    direct = any_device;
  } else if (options.io == IoMode::kAuto) {
    report.resident_fraction = PageCacheResidency(file.path());
    readahead = report.resident_fraction < 0.5;
  }
  File direct_file;
  if (direct) {
    try {
      direct_file = File::OpenRead(file.path(), /*direct=*/true);
    } catch (const Error&) {
      direct = false;  // e.g. tmpfs refuses O_DIRECT
    }
  }
  report.direct_io = direct;
  report.readahead = readahead;
  const File& buffered = file.file();

  const unsigned threads = static_cast<unsigned>(
      std::max<size_t>(1, std::min<size_t>(options.threads ? options.threads : 1, items.size())));
  const int slots = static_cast<int>(std::max(1u, options.slots_per_thread));
  report.threads = threads;
  // A staging slot holds one chunk; no chunk is longer than its tensor, so slots are sized by
  // the largest target when it is smaller than chunk_size (a header may say 16 GiB chunks).
  uint64_t stage_bytes = kDataAlignment;
  for (const auto& j : jobs) {
    stage_bytes = std::max(stage_bytes, std::min(cs, AlignUp(j.entry->nbytes, kDataAlignment)));
  }
  if (any_device) {
    report.staging_bytes = uint64_t{threads} * slots * stage_bytes;
    // Before the workers start: one allocation for every lane (a cached copier that has it
    // already, e.g. from reshard.prepare or an earlier load, returns at once).
    report.staging_alloc_seconds = copier->Reserve(stage_bytes);
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr error;

  auto worker = [&](int lane) {
    try {
      if (any_device) copier->BindThread(lane);
      AlignedBuffer scratch;
      size_t scratch_size = 0;
      int slot = 0;
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
      auto check = [&](const TensorEntry& e, uint64_t chunk, const void* data, uint64_t len) {
        if (!options.verify_checksums) return;
        const uint64_t hash = Xxh3(data, len);
        if (hash != e.chunk_xxh3[chunk]) {
          Fail(ErrorCode::kDataLoss,
               file.path() + ": tensor \"" + e.name + "\" chunk " + std::to_string(chunk) +
                   ": checksum mismatch: data hashes to " + Hex16(hash) + ", header says " +
                   Hex16(e.chunk_xxh3[chunk]) + " (the file is corrupt; convert again)");
        }
      };
      while (!failed.load(std::memory_order_relaxed)) {
        const size_t i = next.fetch_add(1);
        if (i >= items.size()) break;
        const Job& job = jobs[items[i].job];
        const TensorEntry& e = *job.entry;
        const uint64_t chunk = items[i].chunk;
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
        copier->WaitSlot(lane, slot);
        char* stage = static_cast<char*>(copier->Staging(lane, slot, stage_bytes));
        if (e.codec == Codec::kRaw) {
          const uint64_t at = data_offset + e.offset + begin;
          if (direct) {
            const size_t got = direct_file.PReadUpTo(stage, AlignUp(len, kDataAlignment), at);
            if (got < len) {
              Fail(ErrorCode::kDataLoss, what() + ": truncated file (read " + std::to_string(got) +
                                             " of " + std::to_string(len) + " bytes)");
            }
          } else {
            buffered.PReadExact(stage, len, at);
          }
        } else {
          const char* frame = read_frame(e, chunk);
          DecodeZstdFrame(frame, e.frames[chunk].size, stage, len, what());
        }
        check(e, chunk, stage, len);
        copier->CopyAsync(lane, slot, dst, stage, len);
        slot = (slot + 1) % slots;
      }
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> g(error_mu);
      if (!error) error = std::current_exception();
    }
  };

  // Read-ahead: walk the items' byte ranges in file order, coalesced into windows, and ask
  // the kernel to start reading each window, staying at most kAhead bytes in front of the
  // workers (whose position is items[next]).
  std::atomic<bool> finished{false};
  std::thread ahead;
  if (readahead && !items.empty()) {
    ahead = std::thread([&] {
      constexpr uint64_t kWindow = 32ull << 20, kAhead = 512ull << 20;
      auto offset_of = [&](size_t i) {
        const Item& it = items[i];
        const TensorEntry& e = *jobs[it.job].entry;
        return data_offset + e.offset +
               (e.codec == Codec::kRaw ? ChunkBegin(cs, it.chunk) : e.frames[it.chunk].offset);
      };
      auto end_of = [&](size_t i) {
        const Item& it = items[i];
        const TensorEntry& e = *jobs[it.job].entry;
        return e.codec == Codec::kRaw ? offset_of(i) + ChunkLength(e, cs, it.chunk)
                                      : offset_of(i) + e.frames[it.chunk].size;
      };
      size_t i = 0;
      while (i < items.size() && !finished.load() && !failed.load()) {
        const size_t consumer = next.load();
        if (consumer < items.size() && offset_of(i) > offset_of(consumer) + kAhead) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          continue;
        }
        const uint64_t begin = offset_of(i);
        uint64_t end = end_of(i);
        while (++i < items.size() && offset_of(i) <= end + kDataAlignment &&
               end_of(i) - begin <= kWindow) {
          end = std::max(end, end_of(i));
        }
        ::posix_fadvise(buffered.fd(), static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                        POSIX_FADV_WILLNEED);
      }
    });
  }

  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker, static_cast<int>(t));
  worker(0);
  for (auto& t : pool) t.join();
  finished = true;
  if (ahead.joinable()) ahead.join();
  if (any_device) {
    try {
      copier->Synchronize();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

}  // namespace reshard
