// LoadRankFile on the CPU: device targets go through a copier whose "device" is host memory
// and whose copies land only when waited for, as asynchronous copies would. Every read
// strategy (per chunk, spans of adjacent chunks, pieces hashed as read, read-ahead, O_DIRECT
// where the file system allows it) with 1 and several threads must land every byte; a
// corrupted chunk must stop the load naming the tensor and chunk.
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/host_device_copier.h"
#include "core/test_util.h"
#include "reshard/io/file_io.h"
#include "reshard/io/rank_file.h"
#include "reshard/runtime/loader.h"
#include "reshard/runtime/rank_writer.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::Evict;
using test::HostDeviceCopier;
using test::TempDir;
using test::ThrowsError;

constexpr uint64_t kChunk = 8192;

struct Fixture {
  TempDir dir;
  fs::path path;
  std::vector<std::string> names;
  std::vector<std::string> data;
};

// One rank file (world size 1) of tensors whose sizes put chunk, tensor and span boundaries
// everywhere: several chunks with a partial tail, exactly whole chunks, tiny, empty, 0-dim.
using Specs = std::vector<std::pair<std::string, std::vector<uint64_t>>>;  // f32 tensors
void MakeFile(Fixture& f, const Specs& specs = {
                              {"a", {3 * 2048 + 517}},  // f32: 3 chunks + 2068 bytes
                              {"b", {25}},              // 100 bytes
                              {"c", {0}},               // empty
                              {"d", {5 * 2048}},        // exactly 5 chunks
                              {"s", {}},                // 0-dim
                              {"e", {4097}},            // 2 chunks + 4 bytes
                              {"f", {2048}},            // 1 chunk
                          },
              uint64_t chunk_size = kChunk) {
  RankFileHeader h;
  h.layout_key = "fsdp2-ws1";
  h.world_size = 1;
  h.rank = 0;
  h.source = SourceFingerprint::FromSaved({1, 1});
  h.chunk_size = chunk_size;
  std::vector<SaveSource> sources;
  for (size_t i = 0; i < specs.size(); ++i) {
    TensorEntry e;
    e.name = specs[i].first;
    e.dtype = DType::kF32;
    e.global_shape = specs[i].second;
    e.local_shape = specs[i].second;
    uint64_t n = 4;
    for (uint64_t d : e.global_shape) n *= d;
    if (!e.global_shape.empty()) {
      e.sharded = true;
      e.rows = {0, e.global_shape[0]};
    }
    h.tensors.push_back(e);
    f.names.push_back(e.name);
    f.data.push_back(test::PatternBytes(n, 100 + i));
  }
  for (size_t i = 0; i < f.data.size(); ++i) {
    sources.push_back({f.names[i], f.data[i].data(), f.data[i].size(), false});
  }
  f.path = f.dir / RankFileName(0, 1);
  SaveRankFile(f.path, h, sources, nullptr, {});
}

// Destinations for every tensor of the fixture, zero-filled; `on_device(i)` picks which go
// through the copier.
struct Destinations {
  std::vector<std::string> got;
  std::vector<LoadTarget> targets;
};
template <typename OnDevice>
Destinations MakeDestinations(const Fixture& f, OnDevice on_device) {
  Destinations d;
  d.got.reserve(f.data.size());
  for (size_t i = 0; i < f.data.size(); ++i) {
    d.got.emplace_back(f.data[i].size(), '\0');
    d.targets.push_back({f.names[i], d.got[i].data(), d.got[i].size(), on_device(i)});
  }
  return d;
}

void ExpectLanded(const Fixture& f, const Destinations& d) {
  for (size_t i = 0; i < f.data.size(); ++i) EXPECT_TRUE(test::SameBytes(d.got[i], f.data[i])) << f.names[i];
}

struct Strategy {
  IoMode io;
  unsigned threads;
  uint64_t span_bytes, cold_span_bytes, hash_piece_bytes;
  unsigned cold_threads;
  bool pooled = false;  // reader threads from a WorkerPool
  uint64_t lead_in = 0;  // LoadOptions::lead_in_bytes
};

std::string Describe(const Strategy& s) {
  return "io " + std::to_string(static_cast<int>(s.io)) + " threads " + std::to_string(s.threads) +
         " span " + std::to_string(s.span_bytes) + " cold span " + std::to_string(s.cold_span_bytes) +
         " piece " + std::to_string(s.hash_piece_bytes) + " cold threads " + std::to_string(s.cold_threads) +
         (s.pooled ? " pooled" : "") + " lead-in " + std::to_string(s.lead_in);
}

std::vector<Strategy> Strategies() {
  std::vector<Strategy> out;
  for (IoMode io : {IoMode::kBuffered, IoMode::kReadahead, IoMode::kDirect, IoMode::kAuto}) {
    for (unsigned threads : {1u, 3u}) {
      for (uint64_t span : {uint64_t{0}, 3 * kChunk, 64 * kChunk}) {
        for (uint64_t piece : {uint64_t{0}, uint64_t{1000}, 4 * kChunk}) {
          // The reader threads from a WorkerPool, or started for the load.
          for (bool pooled : {false, true}) out.push_back({io, threads, span, span, piece, 0, pooled});
        }
      }
    }
    // A lead-in: each lane's first span copied in growing parts as it is read (warm only).
    for (unsigned threads : {1u, 3u}) {
      for (uint64_t span : {uint64_t{0}, 3 * kChunk, 64 * kChunk}) {
        for (uint64_t piece : {uint64_t{0}, uint64_t{1000}}) {
          for (uint64_t lead : {uint64_t{1000}, kChunk / 2}) {
            out.push_back({io, threads, span, span, piece, 0, false, lead});
            out.push_back({io, threads, span, span, piece, 0, true, lead});
          }
        }
      }
    }
    out.push_back({io, 3, 0, 5 * kChunk, 0, 2});
    out.push_back({io, 3, 0, 2 * kChunk, 0, 8});  // more cold threads than threads: capped
  }
  return out;
}

LoadOptions Options(const Strategy& s) {
  LoadOptions o;
  o.io = s.io;
  o.threads = s.threads;
  o.span_bytes = s.span_bytes;
  o.cold_span_bytes = s.cold_span_bytes;
  o.cold_threads = s.cold_threads;
  o.hash_piece_bytes = s.hash_piece_bytes;
  o.lead_in_bytes = s.lead_in;
  if (s.pooled) {
    static WorkerPool pool(8);
    o.pool = &pool;
  }
  return o;
}

TEST(LoadRankFile, EveryStrategyLandsEveryByte) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  for (const Strategy& s : Strategies()) {
    SCOPED_TRACE(Describe(s));
    for (bool subset : {false, true}) {
      // subset: "b" and "s" are not loaded, so "a" and "d" are no longer neighbours.
      std::vector<std::string> got;
      std::vector<LoadTarget> targets;
      got.reserve(f.data.size());
      for (size_t i = 0; i < f.data.size(); ++i) {
        got.emplace_back(f.data[i].size(), '\x5a');
        if (subset && (f.names[i] == "b" || f.names[i] == "s")) continue;
        // Alternate device and host destinations; the device ones through the copier.
        targets.push_back({f.names[i], got[i].data(), got[i].size(), i % 3 != 1});
      }
      HostDeviceCopier copier(static_cast<int>(s.threads));
      LoadDiagnostics diag;
      const LoadStats rep = LoadRankFile(r, targets, &copier, Options(s), &diag);
      EXPECT_EQ(copier.misuse, "");
      EXPECT_GE(copier.reserves, 1);
      EXPECT_EQ(rep.pooled, s.pooled);
      EXPECT_LE(diag.span_bytes, std::max<uint64_t>(kChunk, s.io == IoMode::kBuffered ? s.span_bytes
                                                                                   : s.cold_span_bytes));
      for (size_t i = 0; i < f.data.size(); ++i) {
        if (subset && (f.names[i] == "b" || f.names[i] == "s")) {
          EXPECT_EQ(got[i], std::string(f.data[i].size(), '\x5a')) << f.names[i] << " was not a target";
        } else {
          EXPECT_TRUE(test::SameBytes(got[i], f.data[i])) << f.names[i];
        }
      }
    }
  }
}

TEST(LoadRankFile, SpansJoinAdjacentChunksIntoFewerCopies) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  Destinations dest = MakeDestinations(f, [](size_t) { return true; });
  const std::vector<LoadTarget>& targets = dest.targets;
  LoadOptions per_chunk;
  per_chunk.io = IoMode::kBuffered;
  per_chunk.span_bytes = 0;  // no joining
  HostDeviceCopier a;
  LoadDiagnostics da, db;
  LoadRankFile(r, targets, &a, per_chunk, &da);
  LoadOptions spans = per_chunk;
  spans.span_bytes = 1 << 20;  // the whole file in one span
  HostDeviceCopier b;
  const LoadStats rb = LoadRankFile(r, targets, &b, spans, &db);
  // Per chunk: one copy per non-empty chunk (a 4, b 1, d 5, s 1, e 3, f 1). One span: one
  // copy per non-empty tensor.
  EXPECT_EQ(a.misuse, "");
  EXPECT_EQ(b.misuse, "");
  EXPECT_EQ(a.copies, 15);
  EXPECT_EQ(b.copies, 6);
  EXPECT_EQ(da.span_bytes, kChunk);
  EXPECT_GT(db.span_bytes, 10 * kChunk);
  EXPECT_EQ(rb.threads, 1u);  // one span: one thread
  ExpectLanded(f, dest);
}

TEST(LoadRankFile, LeadInCopiesTheFirstSpanInGrowingParts) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  LoadOptions o;
  o.io = IoMode::kBuffered;
  o.threads = 1;
  o.span_bytes = 1 << 20;  // the whole file in one span: 6 copies, one per non-empty tensor
  o.hash_piece_bytes = 1024;
  Destinations whole = MakeDestinations(f, [](size_t) { return true; });
  HostDeviceCopier a;
  LoadDiagnostics ra;
  LoadRankFile(r, whole.targets, &a, o, &ra);
  EXPECT_EQ(a.misuse, "");
  EXPECT_EQ(a.copies, 6);
  ExpectLanded(f, whole);

  // Parts after 1 KiB, then 2, 4, 8, 16, 32, 64 KiB more (each at a piece boundary, split
  // where tensors end): more copies, the same bytes.
  o.lead_in_bytes = 1024;
  Destinations lead = MakeDestinations(f, [](size_t) { return true; });
  HostDeviceCopier b;
  LoadDiagnostics rb;
  const LoadStats sb = LoadRankFile(r, lead.targets, &b, o, &rb);
  EXPECT_EQ(b.misuse, "");
  EXPECT_GE(b.copies, 6 + 6);
  ExpectLanded(f, lead);
  EXPECT_GT(rb.first_copy_seconds, 0);
  EXPECT_LE(rb.first_copy_seconds, rb.reads_done_seconds);
  EXPECT_LE(rb.reads_done_seconds, sb.seconds);
  EXPECT_LE(ra.first_copy_seconds, ra.reads_done_seconds);

  // Only a lane's first span: with one chunk per span, every later span is one copy.
  o.span_bytes = 0;
  o.lead_in_bytes = 1024;
  Destinations per_chunk = MakeDestinations(f, [](size_t) { return true; });
  HostDeviceCopier c;
  LoadRankFile(r, per_chunk.targets, &c, o);
  EXPECT_EQ(c.misuse, "");
  EXPECT_GT(c.copies, 15);            // the first chunk (8 KiB) in parts: 1, 2, 4 KiB, the rest
  EXPECT_LE(c.copies, 15 + 3);
  ExpectLanded(f, per_chunk);
}

TEST(LoadRankFile, DefaultLeadInOnMiBSizedTensors) {
  // The default options on files with tensors of several MiB, at the default chunk size and
  // at 2 MiB (the default before 2026-12): every thread's first span (4 MiB) goes out in
  // parts of 1 MiB, 2 MiB, then the rest.
  for (const uint64_t chunk : {kDefaultChunkSize, uint64_t{2} << 20}) {
    SCOPED_TRACE("chunk_size " + std::to_string(chunk));
    Fixture f;
    MakeFile(f, {{"w", {(5 << 20) / 4 + 123}}, {"v", {(3 << 20) / 4}}, {"t", {1000}}}, chunk);
    RankFileReader r = RankFileReader::Open(f.path);
    LoadOptions o;
    o.io = IoMode::kBuffered;
    o.threads = 2;
    ASSERT_EQ(o.lead_in_bytes, 1u << 20);
    Destinations lead = MakeDestinations(f, [](size_t) { return true; });
    HostDeviceCopier a;
    LoadDiagnostics ra;
    LoadRankFile(r, lead.targets, &a, o, &ra);
    o.lead_in_bytes = 0;
    Destinations whole = MakeDestinations(f, [](size_t) { return true; });
    HostDeviceCopier b;
    LoadRankFile(r, whole.targets, &b, o);
    EXPECT_EQ(a.misuse, "");
    EXPECT_EQ(b.misuse, "");
    EXPECT_GE(a.copies, b.copies + 2);  // at least two parts split off the first spans
    EXPECT_EQ(ra.span_bytes, 4u << 20);
    ExpectLanded(f, lead);
    ExpectLanded(f, whole);
  }
}

// Keeps the calling thread on one of its CPUs alone until destroyed (threads it starts
// inherit that).
class OnOneCpu {
 public:
  OnOneCpu() {
    CPU_ZERO(&saved_);
    if (::sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    int cpu = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &saved_)) ++cpu;
    if (cpu == CPU_SETSIZE) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    ok_ = ::sched_setaffinity(0, sizeof(one), &one) == 0;
  }
  ~OnOneCpu() {
    if (ok_) ::sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  bool ok() const { return ok_; }

 private:
  cpu_set_t saved_;
  bool ok_ = false;
};

// Busy until this thread has used `seconds` of CPU time (however long that takes on a
// loaded machine).
void Spin(double seconds) {
  auto cpu = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  };
  const double end = cpu() + seconds;
  volatile uint64_t x = 0;
  while (cpu() < end) x = x + 1;
}

TEST(LoadRankFile, ReportsHowTheReaderThreadsWereScheduled) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  LoadOptions o;
  o.io = IoMode::kBuffered;
  o.threads = 3;
  o.span_bytes = 0;  // one chunk a span: work for every thread
  {
    // Lane 0 burns 60 ms of CPU, lanes 1 and 2 sleep 60 ms: each thread's own CPU time
    // averages to ~20 ms (a process-wide clock would give every lane ~60 ms, a sum 60 ms),
    // while each thread was running for at least 60 ms.
    Destinations dest = MakeDestinations(f, [](size_t) { return true; });
    HostDeviceCopier copier;
    copier.on_bind = [](int lane) {
      if (lane == 0) {
        Spin(0.06);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(60));
      }
    };
    LoadDiagnostics rep;
    const LoadStats stats = LoadRankFile(r, dest.targets, &copier, o, &rep);
    EXPECT_EQ(copier.misuse, "");
    ExpectLanded(f, dest);
    ASSERT_EQ(stats.threads, 3u);
    EXPECT_GE(rep.lane_wall_seconds, 0.055);
    EXPECT_GT(rep.lane_cpu_seconds, 0.012);
    EXPECT_LT(rep.lane_cpu_seconds, 0.04);
    EXPECT_LE(rep.lane_wall_seconds, stats.seconds);
  }
  {
    // All three on one CPU, each burning 30 ms: they share it (and take turns: the
    // scheduler switches them out involuntarily), and each still used ~30 ms of CPU.
    OnOneCpu one;
    ASSERT_TRUE(one.ok());
    Destinations dest = MakeDestinations(f, [](size_t) { return true; });
    HostDeviceCopier copier;
    copier.on_bind = [](int) { Spin(0.03); };
    LoadDiagnostics rep;
    const LoadStats stats = LoadRankFile(r, dest.targets, &copier, o, &rep);
    EXPECT_EQ(copier.misuse, "");
    ExpectLanded(f, dest);
    ASSERT_EQ(stats.threads, 3u);
    EXPECT_EQ(rep.lanes_on_shared_cpus, 3u);
    EXPECT_GT(rep.preemptions, 0u);
    EXPECT_LT(rep.lane_cpu_seconds, 0.06);
    EXPECT_GT(rep.lane_wall_seconds, rep.lane_cpu_seconds + 0.015);
  }
  {
    // One thread: no other reader to share a CPU with.
    o.threads = 1;
    Destinations dest = MakeDestinations(f, [](size_t) { return true; });
    HostDeviceCopier copier;
    LoadDiagnostics rep;
    LoadRankFile(r, dest.targets, &copier, o, &rep);
    ExpectLanded(f, dest);
    EXPECT_EQ(rep.lanes_on_shared_cpus, 0u);
  }
}

TEST(LoadRankFile, AutoReadsAnEvictedFileAsColdAndACachedOneAsWarm) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  for (bool all_device : {true, false}) {
    SCOPED_TRACE(all_device ? "device targets" : "device and host targets");
    Destinations dest = MakeDestinations(f, [&](size_t i) { return all_device || i % 2 == 0; });
    std::vector<std::string>& got = dest.got;
    const std::vector<LoadTarget>& targets = dest.targets;
    LoadOptions o;  // kAuto, the defaults
    Evict(f.path);
    if (PageCacheResidency(f.path.string()) > 0.5) GTEST_SKIP() << "the kernel kept the pages";
    HostDeviceCopier cold_copier(static_cast<int>(o.threads));
    LoadDiagnostics cold_diag;
    const LoadStats cold = LoadRankFile(r, targets, &cold_copier, o, &cold_diag);
    EXPECT_TRUE(cold.cold);
    EXPECT_LT(cold_diag.resident_fraction, 0.5);
    // O_DIRECT for an all-device load where the file system allows it, else read-ahead.
    bool direct_possible = true;
    try {
      File::OpenRead(f.path, /*direct=*/true);
    } catch (const Error&) {
      direct_possible = false;
    }
    EXPECT_EQ(cold.direct_io, all_device && direct_possible);
    EXPECT_EQ(cold_diag.readahead, !cold.direct_io);
    EXPECT_LE(cold.threads, std::min(o.cold_threads, o.threads));
    EXPECT_EQ(cold_copier.misuse, "");
    ExpectLanded(f, dest);

    for (auto& g : got) std::fill(g.begin(), g.end(), '\0');
    {
      std::string all;  // read the file: now it is in the page cache
      all.resize(fs::file_size(f.path));
      File::OpenRead(f.path).PReadExact(all.data(), all.size(), 0);
    }
    HostDeviceCopier warm_copier(static_cast<int>(o.threads));
    LoadDiagnostics warm_diag;
    const LoadStats warm = LoadRankFile(r, targets, &warm_copier, o, &warm_diag);
    EXPECT_FALSE(warm.cold);
    EXPECT_GE(warm_diag.resident_fraction, 0.5);
    EXPECT_FALSE(warm.direct_io || warm_diag.readahead);
    ExpectLanded(f, dest);
  }
}

TEST(LoadRankFile, PreparedStagingServesWarmAndColdLoadsWithoutAllocating) {
  Fixture f;
  MakeFile(f);
  RankFileReader r = RankFileReader::Open(f.path);
  for (unsigned threads : {1u, 3u, 4u, 8u, 16u}) {
    for (uint64_t chunk : {kChunk, uint64_t{2} << 20, uint64_t{8} << 20}) {
      LoadOptions o;
      o.threads = threads;
      SCOPED_TRACE("threads " + std::to_string(threads) + " chunk size " + std::to_string(chunk));
      // What reshard.prepare reserves for files of this chunk size ...
      HostDeviceCopier copier(static_cast<int>(threads));
      copier.Reserve(PreparedSlotBytes(o, chunk), static_cast<int>(threads));
      ASSERT_EQ(copier.allocations, 1);
      // ... covers what a warm and a cold load of such a file ask for (their largest span is
      // a chunk, or the span limit).
      for (bool cold : {false, true}) {
        const uint64_t slot = AlignUp(std::max(SpanLimit(o, cold), chunk), kDataAlignment);
        copier.Reserve(slot, static_cast<int>(LaneCount(o, cold)));
        EXPECT_EQ(copier.allocations, 1) << (cold ? "cold" : "warm");
      }
    }
    // And a real load of the fixture (8 KiB chunks) through it, warm and cold.
    LoadOptions o;
    o.threads = threads;
    HostDeviceCopier copier(static_cast<int>(threads));
    copier.Reserve(PreparedSlotBytes(o, kChunk), static_cast<int>(threads));
    Destinations dest = MakeDestinations(f, [](size_t) { return true; });
    const std::vector<LoadTarget>& targets = dest.targets;
    for (IoMode io : {IoMode::kBuffered, IoMode::kReadahead}) {
      o.io = io;
      LoadRankFile(r, targets, &copier, o);
      EXPECT_EQ(copier.misuse, "");
      EXPECT_EQ(copier.allocations, 1);
      ExpectLanded(f, dest);
    }
  }
}

TEST(LoadRankFile, CorruptChunkStopsEveryStrategy) {
  Fixture f;
  MakeFile(f);
  // Flip one byte inside chunk 1 of "d" (its second chunk).
  RankFileHeader h = RankFileReader::Open(f.path).header();
  const TensorEntry& d = *h.Find("d");
  const uint64_t data_offset = RankFileReader::Open(f.path).preamble().data_offset;
  std::string bytes = test::ReadBytes(f.path);
  bytes[data_offset + d.offset + kChunk + 123] ^= 0x10;
  test::WriteBytes(f.path, bytes);
  RankFileReader r = RankFileReader::Open(f.path);
  for (const Strategy& s : Strategies()) {
    SCOPED_TRACE(Describe(s));
    Destinations dest = MakeDestinations(f, [](size_t) { return true; });
    const std::vector<LoadTarget>& targets = dest.targets;
    HostDeviceCopier copier(static_cast<int>(s.threads));
    EXPECT_TRUE(ThrowsError([&] { LoadRankFile(r, targets, &copier, Options(s)); },
                            ErrorCode::kDataLoss,
                            {f.path.string(), "tensor \"d\" chunk 1", "checksum mismatch"}));
  }
}

}  // namespace
}  // namespace reshard
