// The process's copy engines (reshard/runtime/copier_cache.h) with a host-memory copier from
// a test factory, and the environment knobs (reshard/runtime/knobs.h).
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/runtime/copier_cache.h"
#include "reshard/runtime/knobs.h"
#include "reshard/runtime/rank_writer.h"

namespace reshard {
namespace {

using test::ScopedEnv;
using test::ThrowsError;

// Copies land at once; records what the cache asked of it.
class RecordingCopier final : public DeviceCopier {
 public:
  RecordingCopier(int lanes, int slots) : lanes(lanes), slots(slots) {}
  double Reserve(size_t bytes, int n) override {
    std::lock_guard<std::mutex> g(mu);
    reserved.push_back({bytes, n});
    if (bytes * n * slots > block.size()) block.assign(bytes * n * slots, '\0');
    slot_bytes = bytes;
    return 0;
  }
  void* Staging(int lane, int slot, size_t) override {
    return block.data() + (static_cast<size_t>(lane) * slots + slot) * slot_bytes;
  }
  void CopyAsync(int, int, void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void WaitSlot(int, int) override {}
  void Synchronize() override {}
  void BindThread(int) override {}
  void Warm(int lane) override {
    std::lock_guard<std::mutex> g(mu);
    warmed[lane] = std::this_thread::get_id();
  }

  const int lanes, slots;
  std::mutex mu;
  std::vector<std::pair<size_t, int>> reserved;
  std::map<int, std::thread::id> warmed;
  std::vector<char> block;
  size_t slot_bytes = 0;
};

struct Factory {
  std::atomic<int> made{0};
  std::atomic<bool> fail{false};
  CopierFactory Make() {
    return [this](int device, int lanes, int slots) -> std::unique_ptr<DeviceCopier> {
      if (fail) Fail(ErrorCode::kIo, "device " + std::to_string(device) + " is gone");
      ++made;
      return std::make_unique<RecordingCopier>(lanes, slots);
    };
  }
};

TEST(CopierCache, OneCopierAndPoolPerDeviceLanesAndSlots) {
  Factory f;
  CopierCache cache(f.Make());
  DeviceCopier* a = nullptr;
  WorkerPool* pool = nullptr;
  {
    CopierLease l = cache.Acquire(0, 3, 2);
    a = l.copier;
    pool = l.pool;
    ASSERT_NE(a, nullptr);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(pool->size(), 3u);
  }
  {
    CopierLease again = cache.Acquire(0, 3, 2);
    EXPECT_EQ(again.copier, a);
    EXPECT_EQ(again.pool, pool);
  }
  EXPECT_EQ(f.made, 1);
  EXPECT_NE(cache.Acquire(1, 3, 2).copier, a);
  EXPECT_NE(cache.Acquire(0, 2, 2).copier, a);
  EXPECT_NE(cache.Acquire(0, 3, 1).copier, a);
  EXPECT_EQ(f.made, 4);
}

TEST(CopierCache, ALeaseIsExclusive) {
  Factory f;
  CopierCache cache(f.Make());
  CopierLease held = cache.Acquire(0, 1, 2);
  std::atomic<bool> got{false};
  std::thread other([&] {
    CopierLease l = cache.Acquire(0, 1, 2);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(got) << "a second lease of the same copier while the first is held";
  CopierLease different = cache.Acquire(0, 2, 2);  // another copier: not blocked
  held = CopierLease();
  other.join();
  EXPECT_TRUE(got);
}

TEST(CopierCache, PrepareReservesAndWarmsEachLaneOnItsPoolThread) {
  Factory f;
  CopierCache cache(f.Make());
  cache.PrepareAsync(0, 3, 2, 65536, /*warm=*/true);
  cache.WaitPrepared();
  CopierLease l = cache.Acquire(0, 3, 2);
  auto* c = static_cast<RecordingCopier*>(l.copier);
  ASSERT_EQ(c->reserved.size(), 1u);
  EXPECT_EQ(c->reserved[0], (std::pair<size_t, int>{65536, 3}));
  ASSERT_EQ(c->warmed.size(), 3u);
  // Each lane warmed on its own pool thread, none on this one.
  EXPECT_NE(c->warmed[0], c->warmed[1]);
  EXPECT_NE(c->warmed[1], c->warmed[2]);
  for (const auto& [lane, id] : c->warmed) EXPECT_NE(id, std::this_thread::get_id()) << lane;

  cache.PrepareAsync(0, 2, 2, 4096, /*warm=*/false);
  cache.WaitPrepared();
  auto* d = static_cast<RecordingCopier*>(cache.Acquire(0, 2, 2).copier);
  EXPECT_EQ(d->reserved.size(), 1u);
  EXPECT_TRUE(d->warmed.empty());
  cache.WaitPrepared();  // nothing pending: returns at once
}

TEST(CopierCache, APrepareErrorIsRaisedByWaitPrepared) {
  Factory f;
  f.fail = true;
  CopierCache cache(f.Make());
  cache.PrepareAsync(7, 1, 2, 4096, true);
  EXPECT_TRUE(ThrowsError([&] { cache.WaitPrepared(); }, ErrorCode::kIo, {"device 7 is gone"}));
  cache.WaitPrepared();  // raised once
  f.fail = false;
  EXPECT_NE(cache.Acquire(7, 1, 2).copier, nullptr);  // a later use makes it
}

// A small rank file (world size 1) of two tensors.
struct SmallFile {
  test::TempDir dir;
  std::filesystem::path path;
  std::vector<std::string> data{test::PatternBytes(20000, 1), test::PatternBytes(5000, 2)};
  SmallFile() {
    RankFileHeader h;
    h.layout_key = "fsdp2-ws1";
    h.world_size = 1;
    h.source = SourceFingerprint::FromSaved({1, 1});
    h.chunk_size = 8192;
    std::vector<SaveSource> sources;
    for (size_t i = 0; i < data.size(); ++i) {
      TensorEntry e;
      e.name = "t" + std::to_string(i);
      e.dtype = DType::kU8;
      e.global_shape = e.local_shape = {data[i].size()};
      e.sharded = true;
      e.rows = {0, data[i].size()};
      h.tensors.push_back(e);
      sources.push_back({e.name, data[i].data(), data[i].size(), false});
    }
    path = dir / RankFileName(0, 1);
    SaveRankFile(path, h, sources, nullptr, {});
  }
};

TEST(LoadThroughCache, DeviceTargetsLeaseTheCopierAndRunOnItsPool) {
  SmallFile file;
  const RankFileReader r = RankFileReader::Open(file.path);
  Factory f;
  CopierCache cache(f.Make());
  std::vector<std::string> got = {std::string(20000, '\0'), std::string(5000, '\0')};
  std::vector<LoadTarget> targets = {{"t0", got[0].data(), 20000, true}, {"t1", got[1].data(), 5000, false}};
  LoadOptions o;
  o.io = IoMode::kBuffered;
  o.threads = 2;
  o.slots_per_thread = 3;
  o.span_bytes = 0;  // one chunk a span: work for both threads
  double wait = -1;
  const LoadStats s = LoadThroughCache(&cache, r, targets, 0, o, nullptr, &wait);
  EXPECT_GE(wait, 0);
  EXPECT_TRUE(s.pooled);
  EXPECT_EQ(s.bytes, 25000u);
  EXPECT_EQ(got, file.data);
  EXPECT_EQ(f.made, 1);
  auto* c = static_cast<RecordingCopier*>(cache.Acquire(0, 2, 3).copier);  // the key used
  EXPECT_EQ(c->lanes, 2);
  EXPECT_EQ(c->slots, 3);
  EXPECT_EQ(f.made, 1);
}

TEST(LoadThroughCache, HostTargetsNeedNoCopierAndDeviceTargetsNeedACache) {
  SmallFile file;
  const RankFileReader r = RankFileReader::Open(file.path);
  std::vector<std::string> got = {std::string(20000, '\0'), std::string(5000, '\0')};
  std::vector<LoadTarget> host = {{"t0", got[0].data(), 20000, false}, {"t1", got[1].data(), 5000, false}};
  Factory f;
  CopierCache cache(f.Make());
  const LoadStats s = LoadThroughCache(&cache, r, host, 0, LoadOptions{});
  EXPECT_FALSE(s.pooled);
  EXPECT_EQ(f.made, 0);
  EXPECT_EQ(got, file.data);
  LoadThroughCache(nullptr, r, host, 0, LoadOptions{});  // no cache: fine for the host
  std::vector<LoadTarget> device = {{"t1", got[1].data(), 5000, true}};
  EXPECT_TRUE(ThrowsError([&] { LoadThroughCache(nullptr, r, device, 0, LoadOptions{}); },
                          ErrorCode::kUnsupported, {"no CUDA support"}));
}

TEST(Knobs, ArgumentThenEnvironmentThenDefault) {
  ScopedEnv unset("RESHARD_TEST_KNOB", nullptr);
  EXPECT_EQ(Knob(std::nullopt, "RESHARD_TEST_KNOB", 7, 100), 7u);
  ScopedEnv empty("RESHARD_TEST_KNOB", "");
  EXPECT_EQ(Knob(std::nullopt, "RESHARD_TEST_KNOB", 7, 100), 7u);
  ScopedEnv set("RESHARD_TEST_KNOB", "42");
  EXPECT_EQ(Knob(std::nullopt, "RESHARD_TEST_KNOB", 7, 100), 42u);
  EXPECT_EQ(Knob(3, "RESHARD_TEST_KNOB", 7, 100), 3u);
  EXPECT_TRUE(ThrowsError([] { Knob(101, "RESHARD_TEST_KNOB", 7, 100); }, ErrorCode::kInvalidArgument,
                          {"RESHARD_TEST_KNOB = 101: at most 100"}));
  ScopedEnv big("RESHARD_TEST_KNOB", "101");
  EXPECT_TRUE(ThrowsError([] { Knob(std::nullopt, "RESHARD_TEST_KNOB", 7, 100); },
                          ErrorCode::kInvalidArgument, {"environment RESHARD_TEST_KNOB = 101: at most 100"}));
  for (const char* bad : {"4k", "-1", " 1", "1.5", "12345678901234567890"}) {
    ScopedEnv b("RESHARD_TEST_KNOB", bad);
    EXPECT_TRUE(ThrowsError([] { Knob(std::nullopt, "RESHARD_TEST_KNOB", 7, 100); },
                            ErrorCode::kInvalidArgument, {"expected a whole number of at most 19 digits"}))
        << bad;
  }
}

TEST(Knobs, LoadOptionsFromTheEnvironment) {
  ScopedEnv span("RESHARD_SPAN_BYTES", "65536");
  ScopedEnv cold_span("RESHARD_COLD_SPAN_BYTES", nullptr);
  ScopedEnv cold_threads("RESHARD_COLD_THREADS", "3");
  ScopedEnv piece("RESHARD_HASH_PIECE_BYTES", "0");
  ScopedEnv lead("RESHARD_LEAD_IN_BYTES", nullptr);
  ScopedEnv slots("RESHARD_SLOTS", "5");
  const LoadOptions defaults;
  LoadOptions o = KnobbedLoadOptions(6, SlotsKnob(std::nullopt));
  EXPECT_EQ(o.threads, 6u);
  EXPECT_EQ(o.slots_per_thread, 5u);
  EXPECT_EQ(o.span_bytes, 65536u);
  EXPECT_EQ(o.cold_span_bytes, defaults.cold_span_bytes);
  EXPECT_EQ(o.cold_threads, 3u);
  EXPECT_EQ(o.hash_piece_bytes, 0u);
  EXPECT_EQ(o.lead_in_bytes, defaults.lead_in_bytes);
  // Arguments win.
  o = KnobbedLoadOptions(1, SlotsKnob(9), {.span_bytes = 0, .cold_threads = 2, .lead_in_bytes = 7});
  EXPECT_EQ(o.slots_per_thread, 9u);
  EXPECT_EQ(o.span_bytes, 0u);
  EXPECT_EQ(o.cold_threads, 2u);
  EXPECT_EQ(o.lead_in_bytes, 7u);
  EXPECT_EQ(SlotsKnob(0), 1u);  // at least one
  EXPECT_TRUE(ThrowsError([] { SlotsKnob(65); }, ErrorCode::kInvalidArgument, {"RESHARD_SLOTS = 65: at most 64"}));
  ScopedEnv huge("RESHARD_SPAN_BYTES", "2147483648");
  EXPECT_TRUE(ThrowsError([] { KnobbedLoadOptions(1, 1); }, ErrorCode::kInvalidArgument,
                          {"environment RESHARD_SPAN_BYTES = 2147483648: at most 1073741824"}));
}

TEST(Knobs, CopierKnobsAndWarmup) {
  {
    ScopedEnv streams("RESHARD_STREAMS", nullptr);
    ScopedEnv pinned("RESHARD_PINNED", nullptr);
    ScopedEnv warm("RESHARD_WARMUP", nullptr);
    EXPECT_EQ(CopierKnobsFromEnv().streams, 0);
    EXPECT_FALSE(CopierKnobsFromEnv().pinned_host_alloc);
    EXPECT_TRUE(WarmupKnob());
  }
  ScopedEnv streams("RESHARD_STREAMS", "4");
  ScopedEnv pinned("RESHARD_PINNED", "hostalloc");
  ScopedEnv warm("RESHARD_WARMUP", "0");
  EXPECT_EQ(CopierKnobsFromEnv().streams, 4);
  EXPECT_TRUE(CopierKnobsFromEnv().pinned_host_alloc);
  EXPECT_FALSE(WarmupKnob());
  {
    ScopedEnv other("RESHARD_PINNED", "register");
    EXPECT_FALSE(CopierKnobsFromEnv().pinned_host_alloc);
  }
  ScopedEnv bad("RESHARD_WARMUP", "2");
  EXPECT_TRUE(ThrowsError([] { WarmupKnob(); }, ErrorCode::kInvalidArgument, {"RESHARD_WARMUP = 2: at most 1"}));
}

}  // namespace
}  // namespace reshard
