// The CUDA copy engine: pinned staging buffers and asynchronous host-to-device copies on one
// stream per lane. This header includes no CUDA header; the implementation links cudart.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "reshard/runtime/device_copier.h"

namespace reshard {

/// True when the CUDA runtime sees at least one device.
bool CudaAvailable();
int CudaDeviceCount();

/// How pinned staging is made. kRegister: anonymous memory with transparent huge pages asked
/// for, faulted in by several threads at once, then cudaHostRegister'ed (fewer, larger pages
/// to pin; falls back to kHostAlloc where the kernel or the driver refuses). kHostAlloc:
/// cudaHostAlloc (the driver faults in, zeroes and pins every 4 KiB page on the calling
/// thread). BENCHMARKS.md has what each costs on the GPU machine.
enum class PinnedMemory { kRegister, kHostAlloc };

/// A copier for `device` with `lanes` lanes and `slots` staging slots per lane. Pinned
/// staging is allocated by Reserve and kept until the copier is destroyed (or a larger
/// Reserve), so a copier can be reused across loads. Its copies go to `streams` CUDA streams
/// (lane i to stream i mod streams; 0 or more than `lanes`: one stream per lane). Throws
/// kIo naming the CUDA call on a device error; Staging beyond what Reserve made, and a lane
/// or slot out of range, throw kInvalidArgument.
std::unique_ptr<DeviceCopier> MakeCudaCopier(int device, int lanes, int slots, int streams = 0,
                                             PinnedMemory pinned = PinnedMemory::kRegister);

/// Allocation helpers for tests and benchmarks that have no framework (device memory).
void* CudaMalloc(int device, size_t bytes);
void CudaFree(void* ptr);
void CudaCopyToHost(int device, void* dst, const void* src, size_t bytes);
void CudaMemset(int device, void* ptr, int value, size_t bytes);

}  // namespace reshard
