// A DeviceCopier whose "device" is host memory, for loader tests on the CPU (shared by
// tests/core/runtime/loader_test.cc and source_load_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "reshard/runtime/device_copier.h"

namespace reshard::test {

// Copies are recorded and carried out at WaitSlot/Synchronize, from the staging buffer as it
// is then: a loader that reuses a slot before waiting, or writes into staging after
// enqueueing its copy, lands wrong bytes. Each copy's source bytes are also kept as they were
// when it was issued, and a copy whose source changed before it landed (issued before its
// bytes were read) is a misuse; so is a destination byte written twice within one load
// (between Synchronize calls).
class HostDeviceCopier final : public DeviceCopier {
 public:
  // A copier has a fixed number of lanes (the module makes one per thread of `threads`) and
  // slots, and carves one staging block as the CUDA copier does: Reserve(bytes, lanes) grows
  // the block to bytes × lanes × slots when it is smaller (an "allocation") and hands (lane,
  // slot) the bytes at (lane·slots + slot)·bytes; Staging outside that carving is a misuse.
  explicit HostDeviceCopier(int lanes = 64, int slots = 2) : lanes_(lanes), slots_(slots) {}
  double Reserve(size_t bytes, int lanes) override {
    std::lock_guard<std::mutex> g(mu_);
    ++reserves;
    lanes = std::clamp(lanes, 1, lanes_);
    const size_t need = bytes * static_cast<size_t>(lanes) * static_cast<size_t>(slots_);
    if (need > capacity_) {
      ++allocations;
      capacity_ = need;
    }
    slot_bytes_ = bytes;
    return 0;
  }
  void* Staging(int lane, int slot, size_t bytes) override {
    std::lock_guard<std::mutex> g(mu_);
    if (bytes > slot_bytes_ ||
        (static_cast<size_t>(lane) * slots_ + slot + 1) * slot_bytes_ > capacity_) {
      misuse = "staging of lane " + std::to_string(lane) + " slot " + std::to_string(slot) +
               " outside the reserved carving";
    }
    if (lane < 0 || lane >= lanes_ || slot < 0 || slot >= slots_) {
      misuse = "lane " + std::to_string(lane) + " of a copier with " + std::to_string(lanes_);
    }
    if (!pending_[{lane, slot}].empty()) misuse = "staging handed out with copies in flight";
    auto& b = buffers_[{lane, slot}];
    if (b.size < bytes) {  // page-aligned, as pinned memory is (O_DIRECT reads into it)
      b.data.reset(static_cast<char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)));
      b.size = bytes;
    }
    return b.data.get();
  }
  void CopyAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    std::lock_guard<std::mutex> g(mu_);
    const auto lo = reinterpret_cast<uintptr_t>(dst), hi = lo + n;
    for (const auto& [a, b] : written_) {
      if (lo < b && a < hi) misuse = "a destination byte written twice in one load";
    }
    if (n > 0) written_.emplace_back(lo, hi);
    pending_[{lane, slot}].push_back(
        {dst, src, n, std::string(static_cast<const char*>(src), n)});
    ++copies;
  }
  void WaitSlot(int lane, int slot) override {
    std::lock_guard<std::mutex> g(mu_);
    Land(pending_[{lane, slot}]);
  }
  void Synchronize() override {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [k, p] : pending_) Land(p);
    written_.clear();
  }
  void BindThread(int lane) override {
    if (on_bind) on_bind(lane);
  }

  std::function<void(int)> on_bind;  // runs on each reader thread as it starts (tests)
  std::string misuse;
  int copies = 0;
  int reserves = 0;
  int allocations = 0;  // Reserves that had to grow the block

 private:
  struct Copy {
    void* dst;
    const void* src;
    size_t n;
    std::string issued;  // the source bytes when the copy was issued
  };
  void Land(std::vector<Copy>& p) {
    for (const Copy& c : p) {
      if (std::memcmp(c.src, c.issued.data(), c.n) != 0) {
        misuse = "staging bytes changed between a copy's issue and its landing";
      }
      std::memcpy(c.dst, c.src, c.n);
    }
    p.clear();
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> written_;  // destination ranges of this load
  int lanes_, slots_;
  size_t capacity_ = 0, slot_bytes_ = 0;
  std::mutex mu_;
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Buffer {
    std::unique_ptr<char, Free> data;
    size_t size = 0;
  };
  std::map<std::pair<int, int>, Buffer> buffers_;
  std::map<std::pair<int, int>, std::vector<Copy>> pending_;
};

}  // namespace reshard::test
