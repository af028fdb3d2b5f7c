#include "reshard/cuda_copier.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "reshard/error.h"

namespace reshard {

namespace {

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    Fail(ErrorCode::kIo, std::string("CUDA error in ") + what + ": " + cudaGetErrorName(err) +
                             " (" + cudaGetErrorString(err) + ")");
  }
}

class CudaCopier final : public DeviceCopier {
 public:
  CudaCopier(int device, int lanes, int slots) : device_(device), slots_(slots) {
    Check(cudaSetDevice(device), "cudaSetDevice");
    lanes_.resize(lanes);
    for (auto& lane : lanes_) {
      Check(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      lane.slots.resize(slots);
      for (auto& s : lane.slots) {
        Check(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming), "cudaEventCreate");
      }
    }
  }

  ~CudaCopier() override {
    cudaSetDevice(device_);
    for (auto& lane : lanes_) {
      if (lane.stream) cudaStreamSynchronize(lane.stream);
      for (auto& s : lane.slots) {
        if (s.event) cudaEventDestroy(s.event);
      }
      if (lane.stream) cudaStreamDestroy(lane.stream);
    }
    if (pool_) cudaFreeHost(pool_);
  }

  void BindThread(int) override { Check(cudaSetDevice(device_), "cudaSetDevice"); }

  void* Staging(int lane, int slot, size_t bytes) override {
    // One pinned block for every (lane, slot), allocated by the first lane that asks: one
    // cudaHostAlloc instead of lanes × slots of them (each call has a fixed cost that
    // dominated the set-up of a first load).
    {
      std::lock_guard<std::mutex> g(pool_mu_);
      if (slot_bytes_ < bytes) {
        if (pool_) {
          Synchronize();
          Check(cudaFreeHost(pool_), "cudaFreeHost");
          pool_ = nullptr;
        }
        const size_t total = bytes * lanes_.size() * static_cast<size_t>(slots_);
        Check(cudaHostAlloc(&pool_, total, cudaHostAllocDefault), "cudaHostAlloc");
        slot_bytes_ = bytes;
      }
    }
    return static_cast<char*>(pool_) + (static_cast<size_t>(lane) * slots_ + slot) * slot_bytes_;
  }

  void CopyAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    Lane& l = lanes_.at(lane);
    Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, l.stream), "cudaMemcpyAsync");
    Check(cudaEventRecord(l.slots.at(slot).event, l.stream), "cudaEventRecord");
    l.slots[slot].pending = true;
  }

  void CopyToHostAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    Lane& l = lanes_.at(lane);
    Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, l.stream), "cudaMemcpyAsync");
    Check(cudaEventRecord(l.slots.at(slot).event, l.stream), "cudaEventRecord");
    l.slots[slot].pending = true;
  }

  void WaitSlot(int lane, int slot) override {
    Slot& s = lanes_.at(lane).slots.at(slot);
    if (s.pending) {
      Check(cudaEventSynchronize(s.event), "cudaEventSynchronize");
      s.pending = false;
    }
  }

  void Synchronize() override {
    Check(cudaSetDevice(device_), "cudaSetDevice");
    cudaError_t first = cudaSuccess;
    for (auto& lane : lanes_) {
      cudaError_t err = cudaStreamSynchronize(lane.stream);
      if (first == cudaSuccess) first = err;
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
    cudaStream_t stream = nullptr;
    std::vector<Slot> slots;
  };
  int device_;
  int slots_;
  std::vector<Lane> lanes_;
  std::mutex pool_mu_;
  void* pool_ = nullptr;     // pinned staging for all lanes and slots
  size_t slot_bytes_ = 0;
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

std::unique_ptr<DeviceCopier> MakeCudaCopier(int device, int lanes, int slots) {
  return std::make_unique<CudaCopier>(device, lanes, slots);
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
