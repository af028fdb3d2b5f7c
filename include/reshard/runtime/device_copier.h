// The copier interface of the loader and the saver (loader.h, rank_writer.h): pinned host
// staging buffers and asynchronous copies between them and device memory. No CUDA here: the
// CUDA copier (reshard/cuda/cuda_copier.h, src/cuda) implements it.
#pragma once

#include <cstddef>

namespace reshard {

/// Copies from pinned host staging memory to device memory. One lane per reader thread;
/// each lane owns `slots` staging buffers. Implementations must be usable from the lane's
/// thread only (lane i is only ever driven by reader thread i).
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  /// Pinned host buffer for (lane, slot) of at least `bytes`, aligned to 4096 bytes (O_DIRECT
  /// reads land in it), valid until the copier dies or the next Reserve (which may carve the
  /// staging anew).
  virtual void* Staging(int lane, int slot, size_t bytes) = 0;
  /// Makes sure lanes [0, lanes) have `bytes` of staging per slot, allocating now rather
  /// than on a lane's first Staging call; returns the seconds spent allocating (0 when the
  /// copier's staging was already large enough). Thread-safe; not while copies are in
  /// flight. The default does nothing.
  virtual double Reserve(size_t bytes, int lanes);
  /// Enqueues an asynchronous copy of `n` bytes from the staging buffer (lane, slot) to `dst`.
  virtual void CopyAsync(int lane, int slot, void* dst, const void* src, size_t n) = 0;
  /// Enqueues an asynchronous copy of `n` bytes from device memory `src` into the staging
  /// buffer (lane, slot) at `dst` (the save direction). WaitSlot(lane, slot) waits for it.
  /// Copiers that only load throw kUnsupported.
  virtual void CopyToHostAsync(int lane, int slot, void* dst, const void* src, size_t n);
  /// Blocks until the last copy issued from (lane, slot) has completed.
  virtual void WaitSlot(int lane, int slot) = 0;
  /// Blocks until every copy of every lane has completed; throws on a device error.
  virtual void Synchronize() = 0;
  /// Prepares the calling thread to drive `lane` (e.g. cudaSetDevice).
  virtual void BindThread(int lane) = 0;
  /// Called on the thread that will drive `lane`, after Reserve, with no copies in flight:
  /// binds the thread and pays now the one-time costs a lane's first copies would otherwise
  /// pay inside a load (e.g. a small copy on the lane's stream, each slot's event recorded
  /// and waited for). The default does nothing.
  virtual void Warm(int lane);
};

}  // namespace reshard
