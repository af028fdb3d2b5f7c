// reshard_bench_ceilings: the I/O and copy ceilings that bench/bench_load.py compares the
// loader against, measured with plain POSIX reads and cudart (no reshard loader code, no
// torch), so that a flaw in the loader cannot hide in its own reference.
//
//   read     --file F --threads T --request BYTES [--direct] [--pinned] [--hash-piece BYTES]
//            [--mmap] [--flush-mib N]
//            T threads take consecutive requests of F (in file order, from a shared counter)
//            and pread each into the thread's own buffer (pinned with cudaHostAlloc when
//            --pinned, else page-aligned malloc). Needs no GPU unless --pinned. With
//            --hash-piece, in pieces each hashed as read (the loader's way); with --mmap,
//            memcpy'd from a mapping instead; --flush-mib first pushes the file out of the CPU
//            caches.
//   h2d      --bytes N --reps R --threads T --request BYTES
//            pinned host -> device bandwidth: T threads, each with its own stream, issue
//            cudaMemcpyAsync of consecutive requests of one pinned buffer; one untimed warm-up.
//   pipeline --file F --threads T --request BYTES [--direct] [--group G --ring K --streams S]
//            the "plain C++ loop": T threads, each pread -> its own 2 pinned buffers ->
//            cudaMemcpyAsync on its own stream into one device buffer the size of the file.
//            With --group G: one pinned ring of K blocks of G requests each; the threads read
//            requests (in file order) into the ring, and whoever reads the last request of a
//            block copies the whole block (G x BYTES) on stream (block mod S): fewer, larger
//            copies from the same kind of reads.
//   setup    --threads T --request BYTES
//            the one-time costs a first load pays (each timed alone, fresh allocations,
//            median of --reps): pinned staging of T x 2 x BYTES by one cudaHostAlloc, by T
//            concurrent cudaHostAllocs, and by page-aligned memory (transparent huge pages
//            asked for, pages touched by T threads) + cudaHostRegister; T streams and 2T
//            events; T threads started with cudaSetDevice; a first copy on each new stream.
//   flush    --mib N --threads T
//            writes then reads N MiB in all, split over T threads: run before a warm
//            ceiling, it starts as cold in the CPU caches as a loader in a fresh Python process
//            (bench_load --flush-cpu-caches).
//   hash     --mib N --threads T --request BYTES
//            XXH3 throughput of every implementation this CPU supports: T threads each hash
//            its own buffer of BYTES (cache-resident when small) until N MiB are hashed in all.
//   spin     --ms N --threads T
//            T threads busy (arithmetic only, no memory traffic) for N ms: run just before a
//            load, it tells whether idle cores (sleep states, clock ramp-up) slow a first load.
//
// Each prints one JSON object on stdout (GB = 1e9 bytes). Timers start before the file is
// opened (buffers, streams and device memory are allocated before) and stop after the last
// byte is in place (device synchronized). Errors go to stderr with a non-zero exit status.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "reshard/base/checksum.h"  // the XXH3 implementations, timed alone
#include "reshard/format/rank_file_format.h"  // DecodePreamble, ParseHeader (the header mode)
#include "reshard/io/file_io.h"  // PageCacheResidency (mincore), no loading code

namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
constexpr uint64_t kAlign = 4096;

struct ToolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

uint64_t AlignUp(uint64_t a, uint64_t b) { return (a + b - 1) / b * b; }

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// "16MiB", "2M", "1GiB", "4096", "1GB" (decimal), "64k". Binary unless the suffix ends in "B"
// without "i" after a letter (KB, MB, GB are powers of 1000).
uint64_t ParseBytes(const std::string& text, const std::string& what) {
  size_t pos = 0;
  while (pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) ++pos;
  const std::string num = text.substr(0, pos);
  std::string suffix = text.substr(pos);
  for (auto& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 0;
  if (suffix.empty() || suffix == "b") mult = 1;
  else if (suffix == "k" || suffix == "kib") mult = 1024.0;
  else if (suffix == "m" || suffix == "mib") mult = 1024.0 * 1024;
  else if (suffix == "g" || suffix == "gib") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "kb") mult = 1e3;
  else if (suffix == "mb") mult = 1e6;
  else if (suffix == "gb") mult = 1e9;
  double value = -1;
  if (!num.empty()) {
    try {
      value = std::stod(num);
    } catch (const std::exception&) {
      value = -1;
    }
  }
  if (mult == 0 || value <= 0) {
    throw ToolError(what + ": cannot read \"" + text +
                    "\" as a size (examples: 4096, 2MiB, 16M, 1GiB, 1GB)");
  }
  return static_cast<uint64_t>(value * mult);
}

void CudaCheck(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    throw ToolError("CUDA error in " + what + ": " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
  }
}

void RequireCuda(int device, const std::string& why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    const std::string detail =
        err != cudaSuccess ? std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)
                           : "no device";
    cudaGetLastError();
    throw ToolError(why + " needs a CUDA GPU, and none is visible (cudaGetDeviceCount: " +
                    detail + ")");
  }
  if (device < 0 || device >= n) {
    throw ToolError("--device " + std::to_string(device) + ": only " + std::to_string(n) +
                    " CUDA device(s) visible");
  }
  CudaCheck(cudaSetDevice(device), "cudaSetDevice");
  CudaCheck(cudaFree(nullptr), "creating the CUDA context");
}

// One host buffer: pinned (cudaHostAlloc) or page-aligned malloc; touched on allocation so
// page faults stay out of the timed region.
class HostBuffer {
 public:
  HostBuffer(uint64_t bytes, bool pinned) : bytes_(AlignUp(bytes, kAlign)), pinned_(pinned) {
    if (pinned_) {
      CudaCheck(cudaHostAlloc(&ptr_, bytes_, cudaHostAllocDefault),
                "cudaHostAlloc(" + std::to_string(bytes_) + " bytes)");
      if (reinterpret_cast<uintptr_t>(ptr_) % kAlign != 0) {
        throw ToolError("cudaHostAlloc returned memory not aligned to 4096 bytes");
      }
    } else if (::posix_memalign(&ptr_, kAlign, bytes_) != 0) {
      ptr_ = nullptr;
      throw ToolError("out of host memory allocating " + std::to_string(bytes_) + " bytes");
    }
    std::memset(ptr_, 0x5a, bytes_);
  }
  ~HostBuffer() {
    if (!ptr_) return;
    if (pinned_) cudaFreeHost(ptr_);
    else std::free(ptr_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  char* data() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  uint64_t bytes_;
  bool pinned_;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t bytes) {
    CudaCheck(cudaMalloc(&ptr_, std::max<uint64_t>(bytes, 1)),
              "cudaMalloc(" + std::to_string(bytes) + " bytes)");
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

class Fd {
 public:
  Fd(const std::string& path, bool direct) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd_ < 0) {
      const int e = errno;
      std::string msg = path + ": cannot open" + (direct ? " with O_DIRECT" : "") + ": " +
                        std::strerror(e);
      if (direct && e == EINVAL) msg += " (this file system refuses O_DIRECT; drop --direct)";
      throw ToolError(msg);
    }
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int fd() const { return fd_; }
  uint64_t Size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw ToolError(path_ + ": fstat: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw ToolError(path_ + ": not a regular file");
    return static_cast<uint64_t>(st.st_size);
  }

  // Reads bytes [off, off + len) into buf (which holds AlignUp(len, 4096) bytes when direct:
  // O_DIRECT reads whole aligned blocks). Throws on an error or if the file ends early.
  void ReadRange(char* buf, uint64_t len, uint64_t off, bool direct) const {
    const uint64_t want = direct ? AlignUp(len, kAlign) : len;
    uint64_t got = 0;
    while (got < len) {
      const ssize_t n = ::pread(fd_, buf + got, want - got, static_cast<off_t>(off + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw ToolError(path_ + ": pread of " + std::to_string(want - got) + " bytes at offset " +
                        std::to_string(off + got) + ": " + std::strerror(errno));
      }
      if (n == 0) break;
      got += static_cast<uint64_t>(n);
    }
    if (got < len) {
      throw ToolError(path_ + ": file ended at " + std::to_string(off + got) +
                      " while reading up to " + std::to_string(off + len) +
                      " (did it change during the run?)");
    }
  }

 private:
  int fd_ = -1;
  std::string path_;
};

// Runs fn(lane) on `threads` threads; rethrows the first exception after all have joined.
template <typename Fn>
void RunThreads(unsigned threads, Fn fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::atomic<bool> failed{false};
  auto body = [&](unsigned lane) {
    try {
      fn(lane, failed);
    } catch (...) {
      failed = true;
      std::lock_guard<std::mutex> g(mu);
      if (!first) first = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

double Gbps(uint64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

// The fields every file-reading mode reports.
Json FileResult(const char* mode, const std::string& path, uint64_t size, double seconds,
                unsigned threads, uint64_t request, bool direct, bool pinned,
                uint64_t host_buffer_bytes, double resident) {
  Json j;
  j["mode"] = mode;
  j["file"] = path;
  j["bytes"] = size;
  j["seconds"] = seconds;
  j["gbps"] = Gbps(size, seconds);
  j["threads"] = threads;
  j["request"] = request;
  j["direct"] = direct;
  j["pinned"] = pinned;
  j["host_buffer_bytes"] = host_buffer_bytes;
  j["resident_fraction_before"] = resident;
  return j;
}

void CheckRequest(uint64_t request, bool direct) {
  if (request == 0) throw ToolError("--request must be positive");
  if (direct && request % kAlign != 0) {
    throw ToolError("--request " + std::to_string(request) +
                    " must be a multiple of 4096 with --direct");
  }
}

// ---- flush -------------------------------------------------------------------------------
// Writes then reads `mib` MiB with T threads, pushing whatever a previous run left in the CPU
// caches (e.g. the page cache's metadata for the file just read) out of them, so that a tool
// run that follows starts as cold as a Python child after its interpreter start-up.

Json CmdFlush(uint64_t mib, unsigned threads) {
  const uint64_t bytes = mib << 20;
  std::vector<char> buf(bytes);
  std::atomic<uint64_t> sum{0};
  const auto t0 = Clock::now();
  RunThreads(threads, [&](unsigned lane, std::atomic<bool>&) {
    const uint64_t per = (bytes + threads - 1) / threads;
    const uint64_t begin = std::min<uint64_t>(bytes, lane * per), end = std::min<uint64_t>(bytes, begin + per);
    std::memset(buf.data() + begin, static_cast<int>(lane + 1), end - begin);
    uint64_t s = 0;
    for (uint64_t i = begin; i < end; i += 64) s += static_cast<unsigned char>(buf[i]);
    sum += s;
  });
  Json j;
  j["mode"] = "flush";
  j["bytes"] = bytes;
  j["seconds"] = Since(t0);
  j["threads"] = threads;
  j["checksum"] = sum.load();
  return j;
}

// ---- read --------------------------------------------------------------------------------
// hash_piece > 0: each request is read (or copied) in pieces of that many bytes, each hashed
// (XXH3, streaming over the request) right after it is in the buffer, as the loader does.
// via_mmap: the file is mapped and each piece memcpy'd from the mapping instead of pread
// (mapping, page faults and unmapping inside the timer). flush_mib > 0: one thread per core
// writes and reads that many MiB in all first, so the pass starts with cold CPU caches. The
// buffers are touched before the timer (since f65c163; before, a non-pinned buffer's first
// page faults were timed).
Json CmdRead(const std::string& path, unsigned threads, uint64_t request, bool direct,
             bool pinned, int device, uint64_t hash_piece, bool via_mmap, uint64_t flush_mib) {
  CheckRequest(request, direct);
  if (pinned) RequireCuda(device, "read --pinned");
  if (via_mmap && direct) throw ToolError("--mmap and --direct exclude each other");
  if (hash_piece > 0 && direct) throw ToolError("--hash-piece and --direct exclude each other");
  const double resident = reshard::PageCacheResidency(path);
  std::vector<std::unique_ptr<HostBuffer>> bufs;
  for (unsigned t = 0; t < threads; ++t) bufs.push_back(std::make_unique<HostBuffer>(request, pinned));
  for (auto& b : bufs) std::memset(b->data(), 0, request);
  if (flush_mib > 0) CmdFlush(flush_mib, std::max(1u, std::thread::hardware_concurrency()));

  std::atomic<uint64_t> sink{0};
  const auto t0 = Clock::now();
  Fd fd(path, direct);
  const uint64_t size = fd.Size();
  const uint64_t n_req = (size + request - 1) / request;
  const char* map = nullptr;
  if (via_mmap && size > 0) {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.fd(), 0);
    if (m == MAP_FAILED) throw ToolError(path + ": mmap: " + std::strerror(errno));
    map = static_cast<const char*>(m);
  }
  std::atomic<uint64_t> next{0};
  RunThreads(threads, [&](unsigned lane, std::atomic<bool>& failed) {
    char* buf = bufs[lane]->data();
    reshard::Xxh3Hasher hasher;
    uint64_t digests = 0;
    while (!failed.load(std::memory_order_relaxed)) {
      const uint64_t i = next.fetch_add(1);
      if (i >= n_req) break;
      const uint64_t off = i * request, len = std::min(request, size - off);
      const uint64_t step = hash_piece > 0 ? hash_piece : len;
      hasher.Reset();
      for (uint64_t at = 0; at < len; at += step) {
        const uint64_t m = std::min(step, len - at);
        if (map != nullptr) {
          std::memcpy(buf + at, map + off + at, m);
        } else {  // --direct comes without pieces: one aligned read of the whole request
          fd.ReadRange(buf + at, m, off + at, direct);
        }
        if (hash_piece > 0) hasher.Update(buf + at, m);
      }
      if (hash_piece > 0) digests ^= hasher.Digest();
    }
    sink ^= digests;
  });
  if (map != nullptr) ::munmap(const_cast<char*>(map), size);
  const double seconds = Since(t0);

  Json j = FileResult("read", path, size, seconds, threads, request, direct, pinned,
                      uint64_t{threads} * AlignUp(request, kAlign), resident);
  j["hash_piece"] = hash_piece;
  j["mmap"] = via_mmap;
  j["flush_mib"] = flush_mib;
  j["digest_xor"] = sink.load();
  return j;
}

// ---- ranges: the reads of a load without the rank file -------------------------------------
// The file ranges of a list (lines "OFFSET LENGTH PATH", e.g. from reshard._C.SourceRankView's
// read_ranges(): what a rank's load from the HF files or another layout reads), cut into
// requests of at most `request` bytes, taken in list order by `threads` threads into their own
// buffers: the least any reader of the same bytes must do on this disk. With --direct each
// request is widened to whole 4096-byte blocks (the bytes counted are the listed ones).
// Order: "list" (as listed), "spread" (round robin over the ranges: request k of every range
// before request k+1 of any, so the requests in flight are far apart), "shuffle" (a fixed
// pseudo-random permutation).
Json CmdRanges(const std::string& list, unsigned threads, uint64_t request, bool direct,
               const std::string& order) {
  CheckRequest(request, direct);
  std::ifstream in(list);
  if (!in) throw ToolError(list + ": cannot open");
  struct Req {
    size_t file, line;
    uint64_t offset, length;
  };
  std::vector<std::unique_ptr<Fd>> fds;
  std::map<std::string, size_t> index;
  std::vector<Req> reqs;
  uint64_t bytes = 0;
  std::string line;
  for (size_t no = 1; std::getline(in, line); ++no) {
    if (line.empty()) continue;
    std::istringstream ls(line);
    uint64_t off = 0, len = 0;
    std::string path;
    const std::string where = list + ":" + std::to_string(no) + ": ";
    if (!(ls >> off >> len) || !std::getline(ls >> std::ws, path)) path.clear();
    while (!path.empty() && std::isspace(static_cast<unsigned char>(path.back()))) path.pop_back();  // \r too
    if (path.empty()) throw ToolError(where + "expected \"OFFSET LENGTH PATH\", found \"" + line + "\"");
    auto [it, added] = index.emplace(path, fds.size());
    if (added) {
      try {
        fds.push_back(std::make_unique<Fd>(path, direct));
      } catch (const ToolError& e) {
        throw ToolError(where + e.what());
      }
    }
    for (uint64_t at = off; at < off + len; at += request) {
      reqs.push_back({it->second, no, at, std::min(request, off + len - at)});
    }
    bytes += len;
  }
  if (reqs.empty()) throw ToolError(list + ": no ranges");
  if (order == "spread") {
    std::map<size_t, uint64_t> seen;  // line -> requests of that range so far
    std::vector<std::pair<uint64_t, size_t>> key;  // (index within its range, position)
    for (size_t i = 0; i < reqs.size(); ++i) key.emplace_back(seen[reqs[i].line]++, i);
    std::stable_sort(key.begin(), key.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<Req> spread;
    for (const auto& k : key) spread.push_back(reqs[k.second]);
    reqs.swap(spread);
  } else if (order == "shuffle") {
    uint64_t x = 0x9E3779B97F4A7C15ull;  // splitmix64, fixed seed: the same order every run
    for (size_t i = reqs.size() - 1; i > 0; --i) {
      x += 0x9E3779B97F4A7C15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      std::swap(reqs[i], reqs[(z ^ (z >> 31)) % (i + 1)]);
    }
  } else if (order != "list") {
    throw ToolError("--order " + order + ": expected list, spread or shuffle");
  }
  const uint64_t buf_bytes = request + 2 * kAlign;
  std::vector<std::unique_ptr<HostBuffer>> bufs;
  for (unsigned t = 0; t < threads; ++t) bufs.push_back(std::make_unique<HostBuffer>(buf_bytes, false));
  for (auto& b : bufs) std::memset(b->data(), 0, buf_bytes);
  std::atomic<size_t> next{0};
  const auto t0 = Clock::now();
  RunThreads(threads, [&](unsigned lane, std::atomic<bool>& failed) {
    char* buf = bufs[lane]->data();
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t i = next.fetch_add(1);
      if (i >= reqs.size()) break;
      const Req& r = reqs[i];
      const uint64_t b = direct ? r.offset / kAlign * kAlign : r.offset;
      try {
        fds[r.file]->ReadRange(buf, r.offset + r.length - b, b, direct);
      } catch (const ToolError& e) {
        throw ToolError(list + ":" + std::to_string(r.line) + ": " + e.what());
      }
    }
  });
  const double seconds = Since(t0);
  Json j;
  j["mode"] = "ranges";
  j["list"] = list;
  j["files"] = fds.size();
  j["ranges_requests"] = reqs.size();
  j["bytes"] = bytes;
  j["seconds"] = seconds;
  j["gbps"] = Gbps(bytes, seconds);
  j["threads"] = threads;
  j["request"] = request;
  j["direct"] = direct;
  j["order"] = order;
  return j;
}

// ---- h2d ---------------------------------------------------------------------------------
Json CmdH2d(uint64_t bytes, unsigned reps, unsigned threads, uint64_t request, int device) {
  CheckRequest(request, false);
  if (bytes == 0) throw ToolError("--bytes must be positive");
  if (reps == 0) throw ToolError("--reps must be positive");
  RequireCuda(device, "h2d");
  HostBuffer host(bytes, /*pinned=*/true);
  // Non-constant contents: a position-dependent pattern, checked after the copies.
  for (uint64_t i = 0; i + 8 <= bytes; i += 4096) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(host.data() + i, &v, 8);
  }
  DeviceBuffer dev(bytes);
  std::vector<cudaStream_t> streams(threads);
  for (auto& s : streams) CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const uint64_t n_req = (bytes + request - 1) / request;

  auto one_rep = [&]() {
    std::atomic<uint64_t> next{0};
    const auto t0 = Clock::now();
    RunThreads(threads, [&](unsigned lane, std::atomic<bool>& failed) {
      CudaCheck(cudaSetDevice(device), "cudaSetDevice");
      while (!failed.load(std::memory_order_relaxed)) {
        const uint64_t i = next.fetch_add(1);
        if (i >= n_req) break;
        const uint64_t off = i * request;
        CudaCheck(cudaMemcpyAsync(dev.data() + off, host.data() + off,
                                  std::min(request, bytes - off), cudaMemcpyHostToDevice,
                                  streams[lane]),
                  "cudaMemcpyAsync");
      }
      CudaCheck(cudaStreamSynchronize(streams[lane]), "cudaStreamSynchronize");
    });
    return Since(t0);
  };

  one_rep();  // warm-up, not counted
  std::vector<double> secs;
  for (unsigned r = 0; r < reps; ++r) secs.push_back(one_rep());

  // Spot check: the pattern arrived.
  for (uint64_t at : {uint64_t{0}, (bytes / 2) / 4096 * 4096, (bytes - 1) / 4096 * 4096}) {
    if (at + 8 > bytes) continue;
    uint64_t got = 0, want = 0;
    CudaCheck(cudaMemcpy(&got, dev.data() + at, 8, cudaMemcpyDeviceToHost), "cudaMemcpy (check)");
    std::memcpy(&want, host.data() + at, 8);
    if (got != want) throw ToolError("h2d: device copy differs from the host at offset " + std::to_string(at));
  }
  for (auto& s : streams) cudaStreamDestroy(s);

  std::vector<double> sorted = secs;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                          : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]);
  Json j;
  j["mode"] = "h2d";
  j["bytes"] = bytes;
  j["seconds"] = median;
  j["gbps"] = Gbps(bytes, median);
  j["gbps_max"] = Gbps(bytes, sorted.front());
  j["gbps_min"] = Gbps(bytes, sorted.back());
  j["seconds_all"] = secs;
  j["reps"] = reps;
  j["threads"] = threads;
  j["request"] = request;
  j["pinned"] = true;
  return j;
}

// ---- pipeline ----------------------------------------------------------------------------
// The device bytes against the file: 64 KiB at 17 places spread evenly from the first byte
// to the last.
void SpotCheck(const std::string& path, const char* dev, uint64_t size) {
  const uint64_t probe_len = std::min<uint64_t>(size, 64 * 1024);
  if (probe_len == 0) return;
  Fd check(path, false);
  std::vector<char> want(probe_len), got(probe_len);
  for (uint64_t k = 0; k <= 16; ++k) {
    const uint64_t at = (size - probe_len) / 16 * k + (k == 16 ? (size - probe_len) % 16 : 0);
    check.ReadRange(want.data(), probe_len, at, false);
    CudaCheck(cudaMemcpy(got.data(), dev + at, probe_len, cudaMemcpyDeviceToHost), "cudaMemcpy (check)");
    if (std::memcmp(want.data(), got.data(), probe_len) != 0) {
      throw ToolError("pipeline: device bytes differ from the file at offset " + std::to_string(at));
    }
  }
}

Json CmdPipelineGrouped(const std::string& path, unsigned threads, uint64_t request, unsigned group,
                        unsigned ring, unsigned streams, int device) {
  CheckRequest(request, false);
  RequireCuda(device, "pipeline");
  const double resident = reshard::PageCacheResidency(path);
  const uint64_t size = Fd(path, false).Size();
  const uint64_t block = uint64_t{group} * request;
  DeviceBuffer dev(AlignUp(std::max<uint64_t>(size, 1), kAlign));
  HostBuffer pool(uint64_t{ring} * block, /*pinned=*/true);
  std::vector<cudaStream_t> ss(streams);
  for (auto& st : ss) CudaCheck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  // Per ring slot: the block whose copy was issued last from it (slot k starts as if block
  // k - ring had been), an event recorded after that copy, and the requests read so far.
  struct Slot {
    std::atomic<int64_t> issued{0};
    std::atomic<unsigned> done{0};
    cudaEvent_t ev = nullptr;
  };
  std::vector<Slot> slots(ring);
  for (unsigned k = 0; k < ring; ++k) {
    slots[k].issued = static_cast<int64_t>(k) - static_cast<int64_t>(ring);
    CudaCheck(cudaEventCreateWithFlags(&slots[k].ev, cudaEventDisableTiming), "cudaEventCreate");
  }

  const auto t0 = Clock::now();
  Fd fd(path, false);
  const uint64_t n_req = (size + request - 1) / request;
  std::atomic<uint64_t> next{0};
  RunThreads(threads, [&](unsigned, std::atomic<bool>& failed) {
    CudaCheck(cudaSetDevice(device), "cudaSetDevice");
    while (!failed.load(std::memory_order_relaxed)) {
      const uint64_t i = next.fetch_add(1);
      if (i >= n_req) break;
      const uint64_t b = i / group;
      Slot& slot = slots[b % ring];
      // The slot's previous block must have left for the device before it is overwritten.
      const int64_t prev = static_cast<int64_t>(b) - static_cast<int64_t>(ring);
      while (slot.issued.load(std::memory_order_acquire) < prev) {
        if (failed.load(std::memory_order_relaxed)) return;
        std::this_thread::yield();
      }
      if (prev >= 0) CudaCheck(cudaEventSynchronize(slot.ev), "cudaEventSynchronize");
      const uint64_t off = i * request;
      const uint64_t len = std::min(request, size - off);
      char* stage = pool.data() + (b % ring) * block + (i % group) * request;
      fd.ReadRange(stage, len, off, false);
      const uint64_t first = b * group;
      const unsigned in_block = static_cast<unsigned>(std::min<uint64_t>(group, n_req - first));
      if (slot.done.fetch_add(1, std::memory_order_acq_rel) + 1 == in_block) {
        slot.done.store(0, std::memory_order_relaxed);
        const uint64_t at = first * request;
        const uint64_t n = std::min(block, size - at);
        cudaStream_t st = ss[b % streams];
        CudaCheck(cudaMemcpyAsync(dev.data() + at, pool.data() + (b % ring) * block, n,
                                  cudaMemcpyHostToDevice, st),
                  "cudaMemcpyAsync");
        CudaCheck(cudaEventRecord(slot.ev, st), "cudaEventRecord");
        slot.issued.store(static_cast<int64_t>(b), std::memory_order_release);
      }
    }
  });
  for (auto& st : ss) CudaCheck(cudaStreamSynchronize(st), "cudaStreamSynchronize");
  const double seconds = Since(t0);
  SpotCheck(path, dev.data(), size);
  for (auto& sl : slots) cudaEventDestroy(sl.ev);
  for (auto& st : ss) cudaStreamDestroy(st);

  Json j = FileResult("pipeline", path, size, seconds, threads, request, /*direct=*/false,
                      /*pinned=*/true, uint64_t{ring} * block, resident);
  j["group"] = group;
  j["ring"] = ring;
  j["streams"] = streams;
  j["copy_bytes"] = block;
  return j;
}

Json CmdPipeline(const std::string& path, unsigned threads, uint64_t request, bool direct,
                 int device) {
  CheckRequest(request, direct);
  RequireCuda(device, "pipeline");
  const double resident = reshard::PageCacheResidency(path);
  const uint64_t size = Fd(path, false).Size();
  // Everything allocated before the timer: 2 pinned buffers and a stream per thread, and the
  // device destination (aligned up: O_DIRECT may read past the end into the last block).
  DeviceBuffer dev(AlignUp(std::max<uint64_t>(size, 1), kAlign));
  struct Lane {
    std::unique_ptr<HostBuffer> buf[2];
    cudaEvent_t ev[2] = {nullptr, nullptr};
    bool pending[2] = {false, false};
    cudaStream_t stream = nullptr;
  };
  std::vector<Lane> lanes(threads);
  for (auto& l : lanes) {
    CudaCheck(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    for (int s = 0; s < 2; ++s) {
      l.buf[s] = std::make_unique<HostBuffer>(request, /*pinned=*/true);
      CudaCheck(cudaEventCreateWithFlags(&l.ev[s], cudaEventDisableTiming), "cudaEventCreate");
    }
  }

  const auto t0 = Clock::now();
  Fd fd(path, direct);
  const uint64_t n_req = (size + request - 1) / request;
  std::atomic<uint64_t> next{0};
  RunThreads(threads, [&](unsigned lane, std::atomic<bool>& failed) {
    CudaCheck(cudaSetDevice(device), "cudaSetDevice");
    Lane& l = lanes[lane];
    int slot = 0;
    while (!failed.load(std::memory_order_relaxed)) {
      const uint64_t i = next.fetch_add(1);
      if (i >= n_req) break;
      const uint64_t off = i * request;
      const uint64_t len = std::min(request, size - off);
      if (l.pending[slot]) {
        CudaCheck(cudaEventSynchronize(l.ev[slot]), "cudaEventSynchronize");
        l.pending[slot] = false;
      }
      fd.ReadRange(l.buf[slot]->data(), len, off, direct);
      CudaCheck(cudaMemcpyAsync(dev.data() + off, l.buf[slot]->data(), len,
                                cudaMemcpyHostToDevice, l.stream),
                "cudaMemcpyAsync");
      CudaCheck(cudaEventRecord(l.ev[slot], l.stream), "cudaEventRecord");
      l.pending[slot] = true;
      slot ^= 1;
    }
    CudaCheck(cudaStreamSynchronize(l.stream), "cudaStreamSynchronize");
  });
  const double seconds = Since(t0);

  SpotCheck(path, dev.data(), size);
  for (auto& l : lanes) {
    for (auto& e : l.ev) cudaEventDestroy(e);
    cudaStreamDestroy(l.stream);
  }

  return FileResult("pipeline", path, size, seconds, threads, request, direct, /*pinned=*/true,
                    uint64_t{threads} * 2 * AlignUp(request, kAlign), resident);
}

// ---- setup -------------------------------------------------------------------------------
Json CmdSetup(unsigned threads, uint64_t request, unsigned reps, int device) {
  if (reps == 0) throw ToolError("--reps must be positive");
  const auto t_ctx = Clock::now();
  RequireCuda(device, "setup");
  const double context_s = Since(t_ctx);
  const uint64_t total = uint64_t{threads} * 2 * AlignUp(request, kAlign);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  Json j;
  j["mode"] = "setup";
  j["threads"] = threads;
  j["request"] = request;
  j["staging_bytes"] = total;
  j["reps"] = reps;
  j["context_seconds"] = context_s;
  auto record = [&](const std::string& name, std::vector<double> secs) {
    j[name] = {{"median_ms", 1e3 * median(secs)},
               {"min_ms", 1e3 * *std::min_element(secs.begin(), secs.end())},
               {"max_ms", 1e3 * *std::max_element(secs.begin(), secs.end())}};
  };
  // Sizes around the staging pool: how the cost scales.
  for (uint64_t size : {total / 4, total, total * 4}) {
    std::vector<double> one, first_touch;
    for (unsigned r = 0; r < reps; ++r) {
      void* p = nullptr;
      const auto t0 = Clock::now();
      CudaCheck(cudaHostAlloc(&p, size, cudaHostAllocDefault), "cudaHostAlloc");
      one.push_back(Since(t0));
      const auto t1 = Clock::now();
      for (uint64_t i = 0; i < size; i += kAlign) static_cast<volatile char*>(p)[i] = 1;
      first_touch.push_back(Since(t1));
      CudaCheck(cudaFreeHost(p), "cudaFreeHost");
    }
    record("hostalloc_" + std::to_string(size >> 20) + "MiB", one);
    record("hostalloc_touch_after_" + std::to_string(size >> 20) + "MiB", first_touch);
  }
  {  // T concurrent cudaHostAllocs of total / T each
    std::vector<double> secs;
    for (unsigned r = 0; r < reps; ++r) {
      std::vector<void*> ptrs(threads, nullptr);
      const auto t0 = Clock::now();
      std::vector<std::thread> ts;
      std::atomic<int> bad{0};
      for (unsigned t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
          if (cudaSetDevice(device) != cudaSuccess ||
              cudaHostAlloc(&ptrs[t], total / threads, cudaHostAllocDefault) != cudaSuccess) {
            ++bad;
          }
        });
      }
      for (auto& t : ts) t.join();
      secs.push_back(Since(t0));
      if (bad) throw ToolError("setup: concurrent cudaHostAlloc failed");
      for (void* p : ptrs) cudaFreeHost(p);
    }
    record("hostalloc_concurrent_total", secs);
  }
  {  // page-aligned memory, huge pages asked for, touched by T threads, then registered
    std::vector<double> alloc_touch, reg, all;
    for (unsigned r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw ToolError("setup: mmap failed");
      ::madvise(p, total, MADV_HUGEPAGE);
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
          const uint64_t part = total / threads;
          char* b = static_cast<char*>(p) + t * part;
          for (uint64_t i = 0; i < part; i += kAlign) b[i] = 0;
        });
      }
      for (auto& t : ts) t.join();
      alloc_touch.push_back(Since(t0));
      const auto t1 = Clock::now();
      CudaCheck(cudaHostRegister(p, total, cudaHostRegisterDefault), "cudaHostRegister");
      reg.push_back(Since(t1));
      all.push_back(Since(t0));
      cudaHostUnregister(p);
      ::munmap(p, total);
    }
    record("mmap_thp_touch_T", alloc_touch);
    record("hostregister_after_touch", reg);
    record("mmap_thp_touch_register_total", all);
  }
  {  // streams and events
    std::vector<double> secs;
    for (unsigned r = 0; r < reps; ++r) {
      std::vector<cudaStream_t> ss(threads);
      std::vector<cudaEvent_t> es(2 * threads);
      const auto t0 = Clock::now();
      for (auto& s : ss) CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      for (auto& e : es) CudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      secs.push_back(Since(t0));
      for (auto& e : es) cudaEventDestroy(e);
      for (auto& s : ss) cudaStreamDestroy(s);
    }
    record("streams_and_events", secs);
  }
  {  // threads that bind the device
    std::vector<double> secs;
    for (unsigned r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < threads; ++t) ts.emplace_back([&] { cudaSetDevice(device); });
      for (auto& t : ts) t.join();
      secs.push_back(Since(t0));
    }
    record("threads_setdevice", secs);
  }
  {  // the first small copy on each new stream (lazy per-stream work), from pinned memory
    std::vector<double> secs;
    void* host = nullptr;
    void* dev = nullptr;
    CudaCheck(cudaHostAlloc(&host, 1 << 20, cudaHostAllocDefault), "cudaHostAlloc");
    CudaCheck(cudaMalloc(&dev, 1 << 20), "cudaMalloc");
    for (unsigned r = 0; r < reps; ++r) {
      std::vector<cudaStream_t> ss(threads);
      for (auto& s : ss) CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      const auto t0 = Clock::now();
      for (auto& s : ss) CudaCheck(cudaMemcpyAsync(dev, host, 4096, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
      for (auto& s : ss) CudaCheck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      secs.push_back(Since(t0));
      for (auto& s : ss) cudaStreamDestroy(s);
    }
    cudaFree(dev);
    cudaFreeHost(host);
    record("first_copy_per_new_stream", secs);
  }
  return j;
}

// ---- hash --------------------------------------------------------------------------------
Json CmdHash(uint64_t mib, unsigned threads, uint64_t request) {
  const uint64_t total = mib << 20;
  Json j;
  j["mode"] = "hash";
  const uint64_t per_thread = std::max<uint64_t>(1, total / threads / request);
  const uint64_t hashed = per_thread * threads * request;  // by each implementation
  j["bytes"] = hashed;
  j["threads"] = threads;
  j["request"] = request;
  j["used_by_loader"] = reshard::Xxh3Implementation();
  for (const std::string& impl : reshard::Xxh3Implementations()) {
    std::vector<std::unique_ptr<HostBuffer>> bufs;
    for (unsigned t = 0; t < threads; ++t) {
      bufs.push_back(std::make_unique<HostBuffer>(request, /*pinned=*/false));
      std::memset(bufs.back()->data(), static_cast<int>(t + 1), request);
    }
    std::atomic<uint64_t> sink{0};
    const auto t0 = Clock::now();
    RunThreads(threads, [&](unsigned lane, std::atomic<bool>&) {
      uint64_t h = 0;
      for (uint64_t i = 0; i < per_thread; ++i) h += reshard::Xxh3With(impl, bufs[lane]->data(), request);
      sink += h;
    });
    const double seconds = Since(t0);
    j["gbps"][impl] = Gbps(hashed, seconds);
    j["checksum"][impl] = sink.load();
  }
  return j;
}

// ---- spin --------------------------------------------------------------------------------
Json CmdSpin(uint64_t ms, unsigned threads) {
  std::atomic<uint64_t> sum{0};
  const auto t0 = Clock::now();
  RunThreads(threads, [&](unsigned lane, std::atomic<bool>&) {
    uint64_t x = lane + 1;
    while (Since(t0) * 1e3 < static_cast<double>(ms)) {
      for (int i = 0; i < 4096; ++i) x = x * 6364136223846793005ull + 1442695040888963407ull;
    }
    sum += x;
  });
  Json j;
  j["mode"] = "spin";
  j["seconds"] = Since(t0);
  j["threads"] = threads;
  j["checksum"] = sum.load();
  return j;
}

// The parse a first load pays once per process: the header's JSON text (the preamble and the
// header read first, not timed) through ParseHeader, best and median of `reps`.
Json CmdHeader(const std::string& path, unsigned reps) {
  const reshard::File f = reshard::File::OpenRead(path);
  if (f.Size() < reshard::kPreambleSize) throw ToolError(path + ": shorter than a rank file's preamble");
  uint8_t pre[reshard::kPreambleSize];
  f.PReadExact(pre, sizeof pre, 0);
  const reshard::Preamble p = reshard::DecodePreamble(pre, f.Size(), path);
  std::string text(p.header_size, '\0');
  f.PReadExact(text.data(), text.size(), p.header_offset);
  std::vector<double> ms;
  uint64_t chunks = 0, tensors = 0;
  for (unsigned i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const reshard::RankFileHeader h = reshard::ParseHeader(text, p.data_size, path);
    ms.push_back(Since(t0) * 1e3);
    tensors = h.tensors.size();
    chunks = 0;
    for (const reshard::TensorEntry& t : h.tensors) chunks += t.chunk_xxh3.size();
  }
  std::sort(ms.begin(), ms.end());
  Json j;
  j["mode"] = "header";
  j["file"] = path;
  j["header_bytes"] = p.header_size;
  j["tensors"] = tensors;
  j["chunks"] = chunks;
  j["reps"] = reps;
  j["best_ms"] = ms.front();
  j["median_ms"] = ms[ms.size() / 2];
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "I/O and copy ceilings for the reshard loader benchmark (bench/bench_load.py). Each "
      "subcommand prints one JSON object; GB = 1e9 bytes."};
  app.require_subcommand(1);
  std::string file, request_text = "2MiB", bytes_text = "1GiB";
  unsigned threads = 1, reps = 5;
  bool direct = false, pinned = false;
  int device = 0;

  auto common = [&](CLI::App* sub, bool with_file) {
    if (with_file) sub->add_option("--file", file, "file to read")->required();
    sub->add_option("--threads", threads, "threads (each with its own buffers / stream)")
        ->check(CLI::Range(1u, 1024u));
    sub->add_option("--request", request_text, "bytes per request, e.g. 2MiB, 16M, 1048576");
    sub->add_option("--device", device, "CUDA device (default 0)");
  };
  CLI::App* read = app.add_subcommand("read", "T threads pread a file into their own buffers");
  common(read, true);
  read->add_flag("--direct", direct, "O_DIRECT reads");
  read->add_flag("--pinned", pinned, "buffers pinned with cudaHostAlloc (needs a GPU)");
  uint64_t read_flush_mib = 0;
  bool via_mmap = false;
  std::string hash_piece_text = "0";
  read->add_option("--hash-piece", hash_piece_text,
                   "read each request in pieces of this many bytes, XXH3 each right after it is read (0: no hashing)");
  read->add_flag("--mmap", via_mmap, "memcpy from a mapping of the file instead of pread");
  read->add_option("--flush-mib", read_flush_mib, "first write and read this many MiB in all, one thread per core (cold CPU caches)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 20));
  CLI::App* ranges = app.add_subcommand("ranges", "T threads pread the file ranges of a list (OFFSET LENGTH PATH per line) in order");
  std::string ranges_list;
  ranges->add_option("--list", ranges_list, "the list of ranges")->required();
  ranges->add_option("--threads", threads, "threads (each with its own buffer)")->check(CLI::Range(1u, 1024u));
  ranges->add_option("--request", request_text, "at most this many bytes per request, e.g. 4MiB");
  ranges->add_flag("--direct", direct, "O_DIRECT reads (each request widened to whole 4096-byte blocks)");
  std::string ranges_order = "list";
  ranges->add_option("--order", ranges_order, "list (as listed), spread (round robin over the ranges) or shuffle");
  ranges->add_option("--device", device, "unused (every mode takes it)");
  CLI::App* h2d = app.add_subcommand("h2d", "pinned host -> device copy bandwidth");
  common(h2d, false);
  h2d->add_option("--bytes", bytes_text, "bytes copied per repetition (default 1GiB)");
  h2d->add_option("--reps", reps, "timed repetitions after one warm-up (default 5)")
      ->check(CLI::Range(1u, 1000u));
  CLI::App* setup = app.add_subcommand("setup", "one-time costs of a first load (pinned staging, streams, threads)");
  common(setup, false);
  setup->add_option("--reps", reps, "repetitions of each measurement (default 5)")
      ->check(CLI::Range(1u, 1000u));
  uint64_t flush_mib = 1024;
  CLI::App* flush = app.add_subcommand("flush", "write then read a large buffer: push other data out of the CPU caches");
  flush->add_option("--mib", flush_mib, "MiB to write and read (default 1024)")->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20));
  flush->add_option("--threads", threads, "threads (default 1)")->check(CLI::Range(1u, 1024u));
  uint64_t hash_mib = 4096;
  CLI::App* hash = app.add_subcommand("hash", "XXH3 throughput of each implementation the CPU supports");
  hash->add_option("--mib", hash_mib, "MiB hashed in all (default 4096)")->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20));
  hash->add_option("--threads", threads, "threads (default 1)")->check(CLI::Range(1u, 1024u));
  hash->add_option("--request", request_text, "bytes per hash call, each thread's buffer (default 2MiB)");
  uint64_t spin_ms = 50;
  CLI::App* spin = app.add_subcommand("spin", "keep T threads busy for N ms (no memory traffic)");
  spin->add_option("--ms", spin_ms, "milliseconds (default 50)")->check(CLI::Range(uint64_t{1}, uint64_t{600000}));
  spin->add_option("--threads", threads, "threads (default 1)")->check(CLI::Range(1u, 1024u));
  std::string header_file;
  unsigned header_reps = 20;
  CLI::App* header = app.add_subcommand("header", "time ParseHeader of a rank file's header (in memory, --reps times)");
  header->add_option("--file", header_file, "a rank file")->required();
  header->add_option("--reps", header_reps, "parses timed (default 20)")->check(CLI::Range(1u, 100000u));
  CLI::App* pipe = app.add_subcommand(
      "pipeline", "T threads: pread -> 2 pinned buffers each -> cudaMemcpyAsync on own stream");
  common(pipe, true);
  pipe->add_flag("--direct", direct, "O_DIRECT reads");
  unsigned group = 0, ring = 4, pipe_streams = 4;
  CLI::Option* group_opt =
      pipe->add_option("--group", group, "requests per copy, read into one pinned ring (without it: per-thread buffers)")
          ->check(CLI::Range(1u, 4096u));
  pipe->add_option("--ring", ring, "blocks in the ring with --group (default 4)")
      ->check(CLI::Range(2u, 4096u))
      ->needs(group_opt);
  pipe->add_option("--streams", pipe_streams, "streams with --group (default 4)")
      ->check(CLI::Range(1u, 1024u))
      ->needs(group_opt);
  group_opt->excludes("--direct");  // the ring is read through the page cache

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    const uint64_t request = ParseBytes(request_text, "--request");
    Json out;
    if (*read) {
      out = CmdRead(file, threads, request, direct, pinned, device,
                    hash_piece_text == "0" ? 0 : ParseBytes(hash_piece_text, "--hash-piece"), via_mmap,
                    read_flush_mib);
    } else if (*ranges) {
      out = CmdRanges(ranges_list, threads, request, direct, ranges_order);
    } else if (*setup) {
      out = CmdSetup(threads, request, reps, device);
    } else if (*flush) {
      out = CmdFlush(flush_mib, threads);
    } else if (*hash) {
      out = CmdHash(hash_mib, threads, request);
    } else if (*header) {
      out = CmdHeader(header_file, header_reps);
    } else if (*spin) {
      out = CmdSpin(spin_ms, threads);
    } else if (*h2d) {
      out = CmdH2d(ParseBytes(bytes_text, "--bytes"), reps, threads, request, device);
    } else if (group > 0) {
      out = CmdPipelineGrouped(file, threads, request, group, ring, pipe_streams, device);
    } else {
      out = CmdPipeline(file, threads, request, direct, device);
    }
    std::cout << out.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "reshard_bench_ceilings: error: " << e.what() << std::endl;
    return 1;
  }
}
