#include "reshard/runtime/copier_cache.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "reshard/base/error.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/runtime/knobs.h"

namespace reshard {

CopierCache::CopierCache(CopierFactory make)
    : make_(std::move(make)), pid_(::getpid()), prep_pid_(::getpid()) {}

CopierLease CopierCache::Acquire(int device, int lanes, int slots) {
  Entry* e = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (pid_ != ::getpid()) {
      // This process is a fork()ed child of the one that made the entries: it has neither
      // their pools' threads nor the parent's device state, and an entry's `use` may be held
      // by a thread that does not exist here. Left alone (not destroyed), made anew.
      for (auto& [key, entry] : cache_) (void)entry.release();
      cache_.clear();
      pid_ = ::getpid();
    }
    auto& slot = cache_[{device, lanes, slots}];
    if (!slot) slot = std::make_unique<Entry>();
    e = slot.get();
  }
  std::unique_lock<std::mutex> use(e->use);
  if (!e->copier) e->copier = make_(device, lanes, slots);
  // Started once with the copier (by a prepare, in the background), so loads start no threads.
  if (!e->pool) e->pool = std::make_unique<WorkerPool>(static_cast<unsigned>(std::max(1, lanes)));
  return {e->copier.get(), e->pool.get(), std::move(use)};
}

void CopierCache::PrepareAsync(int device, int lanes, int slots, size_t slot_bytes, bool warm) {
  std::lock_guard<std::mutex> g(prep_mu_);
  ForgetParentPreparesLocked();
  pending_.push_back(std::async(std::launch::async, [=, this] {
    CopierLease lease = Acquire(device, lanes, slots);
    lease.copier->Reserve(slot_bytes, lanes);
    // Each lane's one-time costs paid now, on the pool thread that will drive it in loads.
    if (warm) {
      lease.pool->Run(static_cast<unsigned>(lanes),
                      [&](unsigned lane) { lease.copier->Warm(static_cast<int>(lane)); });
    }
  }));
}

void CopierCache::WaitPrepared() {
  std::vector<std::future<void>> p;
  {
    std::lock_guard<std::mutex> g(prep_mu_);
    ForgetParentPreparesLocked();
    p.swap(pending_);
  }
  for (auto& f : p) f.get();  // rethrows the first error
}

// In a fork()ed child, the parent's pending prepares have no threads: waiting for (or
// destroying) their futures would block forever. Left alone.
void CopierCache::ForgetParentPreparesLocked() {
  if (prep_pid_ == ::getpid()) return;
  (void)new std::vector<std::future<void>>(std::move(pending_));
  pending_.clear();
  prep_pid_ = ::getpid();
}

uint64_t DefaultPreparedSlotBytes(unsigned threads, unsigned slots) {
  return PreparedSlotBytes(KnobbedLoadOptions(threads, slots), kDefaultChunkSize);
}

LoadStats LoadThroughCache(CopierCache* cache, const RankFileReader& file,
                           std::span<const LoadTarget> targets, int device, LoadOptions options,
                           LoadDiagnostics* diagnostics, double* copier_wait) {
  return LoadThroughCache(
      cache, targets, device, options,
      [&](DeviceCopier* copier, const LoadOptions& o) {
        return LoadRankFile(file, targets, copier, o, diagnostics);
      },
      copier_wait);
}

LoadStats LoadThroughCache(CopierCache* cache, std::span<const LoadTarget> targets, int device,
                           LoadOptions options, const TargetLoader& load, double* copier_wait) {
  bool any_device = false;
  for (const auto& t : targets) any_device |= t.on_device;
  CopierLease lease;
  double wait = 0;
  if (any_device) {
    if (cache == nullptr) {
      Fail(ErrorCode::kUnsupported,
           "this reshard build has no CUDA support; rebuild with a CUDA toolkit to load onto a GPU");
    }
    const auto t0 = std::chrono::steady_clock::now();
    lease = cache->Acquire(device, static_cast<int>(std::max(1u, options.threads)),
                           static_cast<int>(std::max(1u, options.slots_per_thread)));
    options.pool = lease.pool;
    // Waiting for a prepare still running (or another load) is part of this load.
    wait = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (copier_wait != nullptr) *copier_wait = wait;
  LoadStats stats = load(lease.copier, options);
  stats.seconds += wait;
  return stats;
}

}  // namespace reshard
