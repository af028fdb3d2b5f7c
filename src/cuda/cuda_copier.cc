#include "reshard/cuda_copier.h"

#include <cuda_runtime_api.h>

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
        if (s.buffer) cudaFreeHost(s.buffer);
      }
      if (lane.stream) cudaStreamDestroy(lane.stream);
    }
  }

  void BindThread(int) override { Check(cudaSetDevice(device_), "cudaSetDevice"); }

  void* Staging(int lane, int slot, size_t bytes) override {
    Slot& s = lanes_.at(lane).slots.at(slot);
    if (s.capacity < bytes) {
      if (s.buffer) {
        Check(cudaEventSynchronize(s.event), "cudaEventSynchronize");
        Check(cudaFreeHost(s.buffer), "cudaFreeHost");
        s.buffer = nullptr;
      }
      Check(cudaHostAlloc(&s.buffer, bytes, cudaHostAllocDefault), "cudaHostAlloc");
      s.capacity = bytes;
    }
    return s.buffer;
  }

  void CopyAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    Lane& l = lanes_.at(lane);
    Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, l.stream), "cudaMemcpyAsync");
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
    void* buffer = nullptr;
    size_t capacity = 0;
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
