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

/// A copier for `device` with `lanes` lanes. Pinned staging memory is allocated on first
/// use and kept until the copier is destroyed, so a copier can be reused across loads.
/// Its copies go to `streams` CUDA streams (lane i to stream i mod streams; 0 or more than
/// `lanes`: one stream per lane).
std::unique_ptr<DeviceCopier> MakeCudaCopier(int device, int lanes, int slots, int streams = 0);

/// Allocation helpers for tests and benchmarks that have no framework (device memory).
void* CudaMalloc(int device, size_t bytes);
void CudaFree(void* ptr);
void CudaCopyToHost(int device, void* dst, const void* src, size_t bytes);
void CudaMemset(int device, void* ptr, int value, size_t bytes);

}  // namespace reshard
