// Copy engines kept for the life of a process, so that streams, pinned staging and reader
// threads are made once: one copier (and one WorkerPool of its reader threads, one per lane)
// per (device, lanes, slots). reshard.prepare makes one in the background while the caller
// builds its model; loads and saves lease it. The Python binding keeps the process's cache;
// the copier itself comes from a factory it gives (the CUDA copy engine), so this layer
// needs no CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include <sys/types.h>

#include "reshard/io/rank_file.h"
#include "reshard/io/worker_pool.h"
#include "reshard/runtime/device_copier.h"
#include "reshard/runtime/loader.h"

namespace reshard {

/// Makes the copier of (device, lanes, slots); throws on a device error.
using CopierFactory = std::function<std::unique_ptr<DeviceCopier>(int device, int lanes, int slots)>;

/// Exclusive use of a cached copier and its reader threads while held.
struct CopierLease {
  DeviceCopier* copier = nullptr;
  WorkerPool* pool = nullptr;  // the copier's reader threads, one per lane
  std::unique_lock<std::mutex> lock;
};

class CopierCache {
 public:
  explicit CopierCache(CopierFactory make);
  CopierCache(const CopierCache&) = delete;
  CopierCache& operator=(const CopierCache&) = delete;

  /// The copier of (device, lanes, slots), made on first use, with its pool of `lanes`
  /// threads. A copier is used by one load, save or prepare at a time: each holds the lease
  /// throughout (two at once would share lanes, and a Reserve during a load would re-carve the
  /// staging under it); an Acquire while another lease is held waits for it. In a fork()ed
  /// child the parent's copiers are forgotten (not destroyed: their threads and device state
  /// are not the child's) and made anew.
  CopierLease Acquire(int device, int lanes, int slots);

  /// On another thread, returning at once: Acquire, Reserve `slot_bytes` of staging per
  /// (lane, slot) for `lanes` lanes, and with `warm` each lane's Warm on the pool thread that
  /// drives it in loads. Errors are kept for WaitPrepared.
  void PrepareAsync(int device, int lanes, int slots, size_t slot_bytes, bool warm);

  /// Waits for every PrepareAsync still running; rethrows the first error one of them met.
  void WaitPrepared();

 private:
  struct Entry {
    std::mutex use;  // held by the one load / save / prepare using the copier
    std::unique_ptr<DeviceCopier> copier;
    std::unique_ptr<WorkerPool> pool;
  };
  void ForgetParentPreparesLocked();

  CopierFactory make_;
  std::mutex mu_;  // guards cache_ and pid_
  std::map<std::tuple<int, int, int>, std::unique_ptr<Entry>> cache_;
  pid_t pid_;  // the process that made cache_'s entries
  std::mutex prep_mu_;  // guards pending_ and prep_pid_
  std::vector<std::future<void>> pending_;
  pid_t prep_pid_;
};

/// The staging per (lane, slot) a prepare reserves for `threads` lanes: enough for a warm and
/// a cold load of files of the default chunk size with the environment's knobs
/// (KnobbedLoadOptions, PreparedSlotBytes).
uint64_t DefaultPreparedSlotBytes(unsigned threads, unsigned slots);

/// A load as reshard.load runs it: device targets go through `cache`'s copier of (device,
/// max(1, options.threads), options.slots_per_thread), whose lease is held throughout and
/// whose pool runs the reader threads. Without a cache (a build without CUDA) device targets
/// throw kUnsupported. The returned seconds include waiting for the lease (a prepare still
/// running, or another load), which `copier_wait` gets too when given.
LoadStats LoadThroughCache(CopierCache* cache, const RankFileReader& file,
                           std::span<const LoadTarget> targets, int device, LoadOptions options,
                           LoadDiagnostics* diagnostics = nullptr, double* copier_wait = nullptr);
/// The same for any loader of targets (a SourceRankView): `load(copier, options)` runs with
/// the lease held (copier null when no target is in device memory; options.pool the lease's
/// pool).
using TargetLoader = std::function<LoadStats(DeviceCopier* copier, const LoadOptions& options)>;
LoadStats LoadThroughCache(CopierCache* cache, std::span<const LoadTarget> targets, int device,
                           LoadOptions options, const TargetLoader& load,
                           double* copier_wait = nullptr);

}  // namespace reshard
