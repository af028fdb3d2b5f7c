#include "reshard/cuda/cuda_copier.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "reshard/base/error.h"

namespace reshard {

namespace {

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    Fail(ErrorCode::kIo, std::string("CUDA error in ") + what + ": " + cudaGetErrorName(err) +
                             " (" + cudaGetErrorString(err) + ")");
  }
}

class PinnedBlock {
 public:
  PinnedBlock() = default;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock() { Free(); }

  void* data() const { return ptr_; }

  void Allocate(size_t bytes, PinnedMemory mode, unsigned touch_threads) {
    Free();
    if (mode == PinnedMemory::kRegister && AllocateRegistered(bytes, touch_threads)) return;
    Check(cudaHostAlloc(&ptr_, bytes, cudaHostAllocDefault), "cudaHostAlloc");
    registered_ = false;
  }

  void Free() noexcept {
    if (ptr_ == nullptr) return;
    if (registered_) {
      cudaHostUnregister(ptr_);
      ::munmap(ptr_, mapped_);
    } else {
      cudaFreeHost(ptr_);
    }
    ptr_ = nullptr;
    mapped_ = 0;
  }

 private:
  // False (nothing held) when the kernel or the driver refuses; the caller falls back.
  bool AllocateRegistered(size_t bytes, unsigned touch_threads) {
    constexpr size_t kHuge = 2u << 20;
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    // Over-allocate by one huge page to start on a 2 MiB boundary (THP needs aligned ranges).
    void* raw = ::mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
    if (raw == MAP_FAILED) return false;
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (base + kHuge - 1) / kHuge * kHuge;
    if (aligned > base) ::munmap(raw, aligned - base);
    const uintptr_t end = base + len + kHuge;
    if (end > aligned + len) ::munmap(reinterpret_cast<void*>(aligned + len), end - (aligned + len));
    char* p = reinterpret_cast<char*>(aligned);
    ::madvise(p, len, MADV_HUGEPAGE);  // a hint: without THP the pages stay 4 KiB
    // Not inherited by fork()ed children (DataLoader workers): a child sharing the pinned
    // pages copy-on-write could make the parent's next write move a page the GPU copies from.
    // cudaHostAlloc marks its memory so too.
    ::madvise(p, len, MADV_DONTFORK);
    const unsigned n = std::max(1u, std::min<unsigned>(touch_threads, static_cast<unsigned>(len / kHuge)));
    std::vector<std::thread> ts;
    const size_t per = (len / kHuge + n - 1) / n * kHuge;
    for (unsigned t = 0; t < n; ++t) {
      ts.emplace_back([p, len, per, t] {
        for (size_t off = t * per; off < std::min(len, (t + 1) * per); off += 4096) p[off] = 0;
      });
    }
    for (auto& t : ts) t.join();
    if (cudaHostRegister(p, len, cudaHostRegisterDefault) != cudaSuccess) {
      cudaGetLastError();
      ::munmap(p, len);
      return false;
    }
    ptr_ = p;
    mapped_ = len;
    registered_ = true;
    return true;
  }

  void* ptr_ = nullptr;
  size_t mapped_ = 0;
  bool registered_ = false;
};

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(int device, int lanes, int slots, int streams, PinnedMemory pinned)
      : device_(device), slots_(slots), pinned_(pinned) {
    if (lanes < 1 || slots < 1) {
      Fail(ErrorCode::kInvalidArgument, "a CUDA copier needs at least one lane and one slot, not " +
                                            std::to_string(lanes) + " lanes of " +
                                            std::to_string(slots) + " slots");
    }
    try {
      Check(cudaSetDevice(device), "cudaSetDevice");
      streams_.resize(streams > 0 ? std::min(streams, std::max(1, lanes)) : std::max(1, lanes));
      for (auto& s : streams_) {
        Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      }
      lanes_.resize(lanes);
      for (size_t i = 0; i < lanes_.size(); ++i) {
        Lane& lane = lanes_[i];
        lane.stream = streams_[i % streams_.size()];
        lane.slots.resize(slots);
        for (auto& s : lane.slots) {
          Check(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming), "cudaEventCreate");
        }
      }
    } catch (...) {
      Release();  // what was made before the failure
      throw;
    }
  }

  ~CudaCopier() override { Release(); }

  void BindThread(int) override { Check(cudaSetDevice(device_), "cudaSetDevice"); }

  void Warm(int lane) override {
    BindThread(lane);
    Lane& l = LaneAt(lane);
    const void* src = nullptr;
    {
      std::lock_guard<std::mutex> g(pool_mu_);
      // Where warm-up copies land: kWarmBytes per lane, the only device memory a copier
      // owns, made by the first Warm. Without it (the device is full) there is no warm-up
      // copy, and nothing fails: the copy was only to pay a one-time cost early.
      if (scratch_ == nullptr && !scratch_failed_ &&
          cudaMalloc(&scratch_, kWarmBytes * lanes_.size()) != cudaSuccess) {
        cudaGetLastError();
        scratch_ = nullptr;
        scratch_failed_ = true;
      }
      const size_t at = static_cast<size_t>(lane) * slots_ * slot_bytes_;
      if (scratch_ != nullptr && slot_bytes_ >= kWarmBytes && at + kWarmBytes <= capacity_) {
        src = static_cast<const char*>(pool_.data()) + at;
      }
    }
    if (src != nullptr) {  // the lane's first copy, from its own staging
      Check(cudaMemcpyAsync(static_cast<char*>(scratch_) + kWarmBytes * lane, src, kWarmBytes,
                            cudaMemcpyHostToDevice, l.stream),
            "cudaMemcpyAsync");
    }
    for (Slot& s : l.slots) {
      Check(cudaEventRecord(s.event, l.stream), "cudaEventRecord");
      Check(cudaEventSynchronize(s.event), "cudaEventSynchronize");
      s.pending = false;
    }
  }

  double Reserve(size_t bytes, int lanes) override {
    // One pinned block carved into (lane, slot) buffers of `bytes`: one allocation instead
    // of lanes × slots of them. It only grows: a load with fewer lanes or smaller spans
    // reuses it.
    std::lock_guard<std::mutex> g(pool_mu_);
    lanes = std::clamp(lanes, 1, static_cast<int>(lanes_.size()));
    const size_t need = bytes * static_cast<size_t>(lanes) * static_cast<size_t>(slots_);
    if (need <= capacity_) {
      slot_bytes_ = bytes;
      return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    Check(cudaSetDevice(device_), "cudaSetDevice");
    if (pool_.data() != nullptr) {
      Synchronize();
      pool_.Free();
      capacity_ = 0;
      slot_bytes_ = 0;
    }
    pool_.Allocate(need, pinned_, static_cast<unsigned>(std::min<size_t>(lanes_.size(), 16)));
    capacity_ = need;
    slot_bytes_ = bytes;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void* Staging(int lane, int slot, size_t bytes) override {
    std::lock_guard<std::mutex> g(pool_mu_);
    const size_t at = (static_cast<size_t>(lane) * slots_ + slot) * slot_bytes_;
    if (bytes <= slot_bytes_ && at + slot_bytes_ <= capacity_) return static_cast<char*>(pool_.data()) + at;
    Fail(ErrorCode::kInvalidArgument, "staging of lane " + std::to_string(lane) + " slot " +
                                   std::to_string(slot) + " (" + std::to_string(bytes) +
                                   " bytes) asked for without Reserve");
  }

  void CopyAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    Lane& l = LaneAt(lane);
    Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, l.stream), "cudaMemcpyAsync");
    Slot& s = SlotAt(l, slot);
    Check(cudaEventRecord(s.event, l.stream), "cudaEventRecord");
    s.pending = true;
  }

  void CopyToHostAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    Lane& l = LaneAt(lane);
    Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, l.stream), "cudaMemcpyAsync");
    Slot& s = SlotAt(l, slot);
    Check(cudaEventRecord(s.event, l.stream), "cudaEventRecord");
    s.pending = true;
  }

  void WaitSlot(int lane, int slot) override {
    Slot& s = SlotAt(LaneAt(lane), slot);
    if (s.pending) {
      Check(cudaEventSynchronize(s.event), "cudaEventSynchronize");
      s.pending = false;
    }
  }

  void Synchronize() override {
    Check(cudaSetDevice(device_), "cudaSetDevice");
    cudaError_t first = cudaSuccess;
    for (cudaStream_t s : streams_) {
      cudaError_t err = cudaStreamSynchronize(s);
      if (first == cudaSuccess) first = err;
    }
    for (auto& lane : lanes_) {
      for (auto& s : lane.slots) s.pending = false;
    }
    Check(first, "cudaStreamSynchronize");
  }

 private:
  struct Slot {
    cudaEvent_t event = nullptr;
    bool pending = false;
  };
  struct Lane {
    cudaStream_t stream = nullptr;  // one of streams_
    std::vector<Slot> slots;
  };

  Lane& LaneAt(int lane) {
    if (lane < 0 || static_cast<size_t>(lane) >= lanes_.size()) {
      Fail(ErrorCode::kInvalidArgument, "CUDA copier: lane " + std::to_string(lane) + " of a copier of " +
                                            std::to_string(lanes_.size()) + " lanes");
    }
    return lanes_[lane];
  }
  Slot& SlotAt(Lane& l, int slot) {
    if (slot < 0 || static_cast<size_t>(slot) >= l.slots.size()) {
      Fail(ErrorCode::kInvalidArgument, "CUDA copier: slot " + std::to_string(slot) + " of a lane of " +
                                            std::to_string(l.slots.size()) + " slots");
    }
    return l.slots[slot];
  }

  // Everything the copier made (also what a failed constructor had made so far).
  void Release() noexcept {
    cudaSetDevice(device_);
    for (cudaStream_t s : streams_) {
      if (s) cudaStreamSynchronize(s);
    }
    for (auto& lane : lanes_) {
      for (auto& s : lane.slots) {
        if (s.event) cudaEventDestroy(s.event);
        s.event = nullptr;
      }
    }
    for (cudaStream_t& s : streams_) {
      if (s) cudaStreamDestroy(s);
      s = nullptr;
    }
    pool_.Free();
    if (scratch_) cudaFree(scratch_);
    scratch_ = nullptr;
  }

  static constexpr size_t kWarmBytes = 4096;
  int device_;
  int slots_;
  PinnedMemory pinned_;
  void* scratch_ = nullptr;  // kWarmBytes per lane, for Warm (guarded by pool_mu_)
  bool scratch_failed_ = false;
  std::vector<cudaStream_t> streams_;
  std::vector<Lane> lanes_;
  std::mutex pool_mu_;
  PinnedBlock pool_;         // pinned staging for all lanes and slots
  size_t capacity_ = 0;      // bytes in pool_
  size_t slot_bytes_ = 0;    // the current carving: (lane, slot) at (lane·slots + slot)·slot_bytes_
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool CudaAvailable() { return CudaDeviceCount() > 0; }

std::unique_ptr<DeviceCopier> MakeCudaCopier(int device, int lanes, int slots, int streams,
                                             PinnedMemory pinned) {
  return std::make_unique<CudaCopier>(device, lanes, slots, streams, pinned);
}

void* CudaMalloc(int device, size_t bytes) {
  Check(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  Check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

void CudaFree(void* ptr) { cudaFree(ptr); }

void CudaCopyToHost(int device, void* dst, const void* src, size_t bytes) {
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

void CudaMemset(int device, void* ptr, int value, size_t bytes) {
  Check(cudaSetDevice(device), "cudaSetDevice");
  Check(cudaMemset(ptr, value, bytes), "cudaMemset");
}

}  // namespace reshard
