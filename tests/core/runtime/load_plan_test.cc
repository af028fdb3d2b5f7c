// The span planner (reshard/runtime/load_plan.h) on hand-made headers: no file, no thread,
// no copier. The exact spans, copies, lanes, staging, lead-in cuts and read-mode choices.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/runtime/load_plan.h"

namespace reshard {
namespace {

using test::ThrowsError;

constexpr uint64_t kCs = 8192;        // chunk size of the hand-made headers
constexpr uint64_t kData = 4096;      // data_offset
constexpr uint64_t kMiB = 1ull << 20;

struct Tensor {
  std::string name;
  uint64_t nbytes;
  uint64_t offset;                    // relative to the data region
  std::vector<uint64_t> frames = {};  // zstd: each chunk's stored size (empty: raw)
};

// A header of `tensors` (offsets as given), chunks of `cs`; zstd frames one after another.
RankFileHeader Header(const std::vector<Tensor>& tensors, uint64_t cs = kCs) {
  RankFileHeader h;
  h.chunk_size = cs;
  for (const Tensor& t : tensors) {
    TensorEntry e;
    e.name = t.name;
    e.dtype = DType::kU8;
    e.nbytes = t.nbytes;
    e.offset = t.offset;
    e.chunk_xxh3.assign(e.ChunkCount(cs), 0);
    if (t.frames.empty()) {
      e.codec = Codec::kRaw;
      e.stored_size = t.nbytes;
    } else {
      e.codec = Codec::kZstd;
      uint64_t at = 0;
      for (uint64_t size : t.frames) {
        e.frames.push_back({at, size});
        at += size;
      }
      e.stored_size = at;
    }
    h.tensors.push_back(e);
  }
  return h;
}

// Destinations for the header's tensors (only the named ones, when `only` is given).
struct Targets {
  std::vector<std::string> memory;
  std::vector<LoadTarget> list;
  char* dst(size_t i) { return memory[i].data(); }
};
Targets MakeTargets(const RankFileHeader& h, const std::vector<bool>& on_device,
                    const std::vector<std::string>& only = {}) {
  Targets t;
  t.memory.reserve(h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    t.memory.emplace_back(h.tensors[i].nbytes + 1, '\0');  // +1: a distinct pointer when empty
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const std::string& name = h.tensors[i].name;
    if (!only.empty() && std::find(only.begin(), only.end(), name) == only.end()) continue;
    t.list.push_back({name, t.memory[i].data(), h.tensors[i].nbytes, on_device[i]});
  }
  return t;
}

LoadOptions Warm(uint64_t span_bytes) {
  LoadOptions o;
  o.threads = 4;
  o.span_bytes = span_bytes;
  o.lead_in_bytes = 0;
  return o;
}

// The fixture file of most tests, raw, 8 KiB chunks:
//   a 20000 bytes at 0      chunks 8192, 8192, 3616   file [4096, 24096)
//   b 100 bytes at 20480    one chunk                 file [24576, 24676)
//   c empty at 24000        no chunk
//   d 40960 bytes at 24576  5 chunks                  file [28672, 69632)
// Between a and b, b and d: gaps under 4096 bytes (alignment): adjacent in the file.
RankFileHeader Fixture() {
  return Header({{"a", 20000, 0}, {"b", 100, 20480}, {"c", 0, 24000}, {"d", 40960, 24576}});
}

struct SpanWant {
  SpanKind kind;
  uint64_t begin, end;
  size_t chunks;
};
void ExpectSpans(const LoadPlan& p, const std::vector<SpanWant>& want) {
  ASSERT_EQ(p.spans.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("span " + std::to_string(i));
    EXPECT_EQ(p.spans[i].kind, want[i].kind);
    EXPECT_EQ(p.spans[i].begin, want[i].begin);
    EXPECT_EQ(p.spans[i].end, want[i].end);
    EXPECT_EQ(p.spans[i].chunk_count, want[i].chunks);
  }
}

TEST(PlanLoad, ChunksInFileOrderWithTheirBytesAndDestinations) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  // Targets in another order than the file's: planned in file order.
  std::swap(t.list[0], t.list[3]);
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), /*cold=*/false);
  ASSERT_EQ(p.jobs.size(), 4u);
  EXPECT_EQ(p.jobs[0].entry->name, "a");
  EXPECT_EQ(p.jobs[3].entry->name, "d");
  EXPECT_EQ(p.tensors, 4u);
  EXPECT_EQ(p.bytes, 20000u + 100 + 40960);
  EXPECT_EQ(p.stored_bytes, p.bytes);
  // The empty tensor has no chunk; the others one per 8 KiB.
  ASSERT_EQ(p.chunks.size(), 3u + 1 + 5);
  const PlannedChunk& a2 = p.chunks[2];
  EXPECT_EQ(a2.chunk, 2u);
  EXPECT_EQ(a2.at, kData + 2 * kCs);
  EXPECT_EQ(a2.stored, 20000 - 2 * kCs);
  EXPECT_EQ(a2.length, a2.stored);
  EXPECT_EQ(a2.dst, t.dst(0) + 2 * kCs);
  const PlannedChunk& b0 = p.chunks[3];
  EXPECT_EQ(b0.at, kData + 20480);
  EXPECT_EQ(b0.dst, t.dst(1));
  EXPECT_EQ(p.chunks[8].at, kData + 24576 + 4 * kCs);
  EXPECT_EQ(p.chunks[8].dst, t.dst(3) + 4 * kCs);
}

TEST(PlanLoad, AdjacentDeviceTensorsJoinOneSpanWithOneCopyPerTensor) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  ExpectSpans(p, {{SpanKind::kDeviceRaw, 4096, 69632, 9}});
  ASSERT_EQ(p.copies.size(), 3u);  // a, b, d: one copy per non-empty tensor
  EXPECT_EQ(p.spans[0].first_copy, 0u);
  EXPECT_EQ(p.spans[0].copy_count, 3u);
  EXPECT_EQ(p.copies[0].begin, 4096u);
  EXPECT_EQ(p.copies[0].end, 24096u);
  EXPECT_EQ(p.copies[0].dst, t.dst(0));
  EXPECT_EQ(p.copies[1].begin, 24576u);
  EXPECT_EQ(p.copies[1].end, 24676u);
  EXPECT_EQ(p.copies[1].dst, t.dst(1));
  EXPECT_EQ(p.copies[2].begin, 28672u);
  EXPECT_EQ(p.copies[2].end, 69632u);
  EXPECT_EQ(p.copies[2].dst, t.dst(3));
  EXPECT_EQ(p.largest_span, 69632u - 4096);
  EXPECT_EQ(p.lanes, 1u);  // one span: one reader thread
  EXPECT_EQ(p.slot_bytes, AlignUp(69632 - 4096, kDataAlignment));
}

TEST(PlanLoad, SpanLimitEndsSpansAtChunks) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  // 3 chunks' worth: a's three chunks and b (20580 bytes) fit; d0-d2 (24576) fit; d3-d4.
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(3 * kCs), false);
  ExpectSpans(p, {{SpanKind::kDeviceRaw, 4096, 24676, 4},
                  {SpanKind::kDeviceRaw, 28672, 28672 + 3 * kCs, 3},
                  {SpanKind::kDeviceRaw, 28672 + 3 * kCs, 69632, 2}});
  // d is cut in two spans: a copy in each.
  ASSERT_EQ(p.copies.size(), 4u);
  EXPECT_EQ(p.spans[1].first_copy, 2u);
  EXPECT_EQ(p.copies[2].dst, t.dst(3));
  EXPECT_EQ(p.copies[3].begin, 28672 + 3 * kCs);
  EXPECT_EQ(p.copies[3].dst, t.dst(3) + 3 * kCs);
  EXPECT_EQ(p.largest_span, 3 * kCs);
  EXPECT_EQ(p.lanes, 3u);
}

TEST(PlanLoad, SpanLimitZeroReadsChunkByChunk) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(0), false);
  ASSERT_EQ(p.spans.size(), 9u);
  ASSERT_EQ(p.copies.size(), 9u);
  for (size_t i = 0; i < p.spans.size(); ++i) {
    EXPECT_EQ(p.spans[i].kind, SpanKind::kDeviceRaw);
    EXPECT_EQ(p.spans[i].chunk_count, 1u);
    EXPECT_EQ(p.spans[i].copy_count, 1u);
    EXPECT_EQ(p.spans[i].begin, p.chunks[i].at);
  }
  EXPECT_EQ(p.largest_span, kCs);
  EXPECT_EQ(p.lanes, 4u);  // threads
}

TEST(PlanLoad, AChunkLongerThanTheLimitIsASpanOfItsOwn) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  // 5000 bytes: every 8 KiB chunk alone; a2 (3616 bytes) cannot join a1 (8 KiB already),
  // but b (100 bytes, 480 after a2) joins a2: 24676 - 20480 = 4196 bytes.
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(5000), false);
  ExpectSpans(p, {{SpanKind::kDeviceRaw, 4096, 12288, 1},
                  {SpanKind::kDeviceRaw, 12288, 20480, 1},
                  {SpanKind::kDeviceRaw, 20480, 24676, 2},
                  {SpanKind::kDeviceRaw, 28672, 36864, 1},
                  {SpanKind::kDeviceRaw, 36864, 45056, 1},
                  {SpanKind::kDeviceRaw, 45056, 53248, 1},
                  {SpanKind::kDeviceRaw, 53248, 61440, 1},
                  {SpanKind::kDeviceRaw, 61440, 69632, 1}});
  EXPECT_EQ(p.spans[2].copy_count, 2u);  // a's tail and b
  EXPECT_EQ(p.largest_span, kCs);        // longer than the limit: chunks are never split
}

TEST(PlanLoad, ATensorNotLoadedBetweenTwoBreaksTheSpan) {
  const RankFileHeader h = Fixture();
  // Without b, a ends at 24096 and d starts at 28672: 4576 bytes apart, not adjacent.
  Targets t = MakeTargets(h, {true, true, true, true}, {"a", "c", "d"});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  ExpectSpans(p, {{SpanKind::kDeviceRaw, 4096, 24096, 3}, {SpanKind::kDeviceRaw, 28672, 69632, 5}});
  EXPECT_EQ(p.tensors, 3u);
  EXPECT_EQ(p.bytes, 20000u + 40960);
}

TEST(PlanLoad, EmptyTensorsAndNoTargetsPlanNothing) {
  const RankFileHeader h = Fixture();
  Targets only_empty = MakeTargets(h, {true, true, true, true}, {"c"});
  const LoadPlan p = PlanLoad(h, kData, only_empty.list, Warm(kMiB), false);
  EXPECT_TRUE(p.chunks.empty());
  EXPECT_TRUE(p.spans.empty());
  EXPECT_EQ(p.tensors, 1u);
  EXPECT_FALSE(p.any_device);  // an empty device target needs no staging
  EXPECT_EQ(p.staging_bytes, 0u);
  EXPECT_EQ(p.lanes, 1u);
  const LoadPlan none = PlanLoad(h, kData, {}, Warm(kMiB), false);
  EXPECT_TRUE(none.spans.empty());
  EXPECT_EQ(none.tensors, 0u);
  EXPECT_EQ(none.lanes, 1u);
}

TEST(PlanLoad, HostChunksAreSpansOfTheirOwnAndNeedNoStaging) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {false, false, false, false});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  ASSERT_EQ(p.spans.size(), 9u);
  for (size_t i = 0; i < p.spans.size(); ++i) {
    EXPECT_EQ(p.spans[i].kind, SpanKind::kHostRaw);
    EXPECT_EQ(p.spans[i].chunk_count, 1u);
    EXPECT_EQ(p.spans[i].copy_count, 0u);
  }
  EXPECT_TRUE(p.copies.empty());
  EXPECT_FALSE(p.any_device);
  EXPECT_EQ(p.staging_bytes, 0u);
  EXPECT_EQ(p.largest_span, 0u);
  EXPECT_EQ(p.lanes, 4u);
}

TEST(PlanLoad, MixedTargetsJoinOnlyDeviceRawNeighbours) {
  const RankFileHeader h = Fixture();
  // b on the host, between a and d on the device: a's chunks join, b alone, then d's chunks
  // do not join a span across b.
  Targets t = MakeTargets(h, {true, false, true, true});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  ExpectSpans(p, {{SpanKind::kDeviceRaw, 4096, 24096, 3},
                  {SpanKind::kHostRaw, 24576, 24676, 1},
                  {SpanKind::kDeviceRaw, 28672, 69632, 5}});
  EXPECT_TRUE(p.any_device);
  EXPECT_EQ(p.slot_bytes, 40960u);
  EXPECT_EQ(p.staging_bytes, 3u * 2 * 40960);  // 3 lanes (3 spans) × 2 slots
}

TEST(PlanLoad, ZstdChunksAreSpansOfTheirOwnAtTheirFrames) {
  // z: zstd, 3 chunks (8192, 8192, 1000 bytes) in frames of 300, 200 and 50 bytes at 0; r: raw
  // right after, device.
  const RankFileHeader h = Header({{"z", 17384, 0, {300, 200, 50}}, {"r", 5000, 4096}});
  Targets t = MakeTargets(h, {true, true});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  ExpectSpans(p, {{SpanKind::kDeviceZstd, 4096, 4396, 1},
                  {SpanKind::kDeviceZstd, 4396, 4596, 1},
                  {SpanKind::kDeviceZstd, 4596, 4646, 1},
                  {SpanKind::kDeviceRaw, 8192, 13192, 1}});
  EXPECT_EQ(p.chunks[1].stored, 200u);
  EXPECT_EQ(p.chunks[1].length, kCs);
  EXPECT_EQ(p.chunks[2].length, 1000u);
  EXPECT_EQ(p.chunks[2].dst, t.dst(0) + 2 * kCs);
  EXPECT_EQ(p.stored_bytes, 550u + 5000);
  // A slot holds a decoded chunk (min(chunk size, tensor rounded up)), or the raw span.
  EXPECT_EQ(p.slot_bytes, kCs);
  EXPECT_EQ(p.largest_span, 5000u);
  EXPECT_EQ(p.copies.size(), 1u);  // the zstd chunks' copies are one per chunk, not planned

  // A small zstd tensor: its slot is the tensor rounded up to 4096, not a whole chunk.
  const RankFileHeader small = Header({{"z", 100, 0, {40}}});
  Targets ts = MakeTargets(small, {true});
  EXPECT_EQ(PlanLoad(small, kData, ts.list, Warm(kMiB), false).slot_bytes, 4096u);
  // On the host: decoded into place.
  Targets th = MakeTargets(h, {false, false});
  const LoadPlan ph = PlanLoad(h, kData, th.list, Warm(kMiB), false);
  EXPECT_EQ(ph.spans[0].kind, SpanKind::kHostZstd);
  EXPECT_EQ(ph.spans[3].kind, SpanKind::kHostRaw);
}

TEST(PlanLoad, ColdLoadsUseTheColdSpanLimitAndThreadsAndNoPiecesOrLeadIn) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  LoadOptions o;
  o.threads = 8;
  o.span_bytes = 0;
  o.cold_span_bytes = 3 * kCs;
  o.cold_threads = 2;
  o.hash_piece_bytes = 1000;
  o.lead_in_bytes = 1000;
  const LoadPlan warm = PlanLoad(h, kData, t.list, o, false);
  EXPECT_EQ(warm.span_limit, 0u);
  EXPECT_EQ(warm.spans.size(), 9u);
  EXPECT_EQ(warm.lanes, 8u);
  EXPECT_EQ(warm.hash_piece, 1000u);
  EXPECT_EQ(warm.lead_in, 1000u);
  EXPECT_EQ(warm.read_step, 1000u);
  const LoadPlan cold = PlanLoad(h, kData, t.list, o, true);
  EXPECT_TRUE(cold.cold);
  EXPECT_EQ(cold.span_limit, 3 * kCs);
  EXPECT_EQ(cold.spans.size(), 3u);
  EXPECT_EQ(cold.lanes, 2u);
  EXPECT_EQ(cold.hash_piece, 0u);
  EXPECT_EQ(cold.lead_in, 0u);
  EXPECT_TRUE(LeadInCuts(cold, cold.spans[0]).empty());
  // More cold threads than threads: capped (a copier has `threads` lanes); 0: `threads`.
  o.cold_threads = 16;
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, true).lanes, 3u);  // and at most one per span
  o.cold_span_bytes = 0;  // 0: span_bytes (here 0 too: chunk by chunk)
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, true).lanes, 8u);
  o.cold_threads = 0;
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, true).lanes, 8u);
}

TEST(PlanLoad, StagingIsLanesTimesSlotsTimesTheLargestSlot) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  LoadOptions o = Warm(3 * kCs);
  o.slots_per_thread = 3;
  const LoadPlan p = PlanLoad(h, kData, t.list, o, false);
  EXPECT_EQ(p.slots, 3);
  EXPECT_EQ(p.slot_bytes, 3 * kCs);
  EXPECT_EQ(p.staging_bytes, uint64_t{p.lanes} * 3 * 3 * kCs);
  o.slots_per_thread = 0;  // at least one
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, false).slots, 1);
  // The first span (a and b, 20580 bytes) rounds up to 4096s.
  o.span_bytes = 20580;
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, false).slot_bytes, 20480u + 4096);
}

TEST(PlanLoad, HashPiecesOnlyWarmWithChecksums) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  LoadOptions o = Warm(kMiB);
  o.hash_piece_bytes = 4096;
  EXPECT_EQ(PlanLoad(h, kData, t.list, o, false).hash_piece, 4096u);
  o.verify_checksums = false;
  const LoadPlan unverified = PlanLoad(h, kData, t.list, o, false);
  EXPECT_EQ(unverified.hash_piece, 0u);
  EXPECT_FALSE(unverified.verify_checksums);
  EXPECT_EQ(unverified.read_step, kLeadInReadBytes);
}

TEST(LeadInCuts, PartsDoubleFromTheFirstAtPieceBoundaries) {
  // One tensor of 64 KiB in one span [4096, 69632), read in pieces of 1 KiB: parts of 1, 2,
  // 4, 8, 16 and 32 KiB, then the rest (1 KiB) with the span's last copy.
  const RankFileHeader h = Header({{"w", 64 << 10, 0}});
  Targets t = MakeTargets(h, {true});
  LoadOptions o = Warm(kMiB);
  o.hash_piece_bytes = 1024;
  o.lead_in_bytes = 1024;
  const LoadPlan p = PlanLoad(h, kData, t.list, o, false);
  ASSERT_EQ(p.spans.size(), 1u);
  const uint64_t b = p.spans[0].begin;
  EXPECT_EQ(LeadInCuts(p, p.spans[0]),
            (std::vector<uint64_t>{b + 1024, b + 3072, b + 7168, b + 15360, b + 31744, b + 64512}));
}

TEST(LeadInCuts, PiecesRestartAtEachChunk) {
  // Pieces of 1000 bytes within 8 KiB chunks (the last piece of a chunk 192 bytes): a part
  // ends at the first piece end at least `part` past the last cut.
  const RankFileHeader h = Header({{"w", 4 * kCs, 0}});
  Targets t = MakeTargets(h, {true});
  LoadOptions o = Warm(kMiB);
  o.hash_piece_bytes = 1000;
  o.lead_in_bytes = 1000;
  const LoadPlan p = PlanLoad(h, kData, t.list, o, false);
  const uint64_t b = p.spans[0].begin;
  // 1000; +2000 -> 3000; +4000 -> 7000; +8000 -> 15000: chunk 1's pieces end at 8192 + 1000k,
  // so 15192; +16000 -> 31192: chunk 3's at 24576 + 1000k: 31576 (span end 32768).
  EXPECT_EQ(LeadInCuts(p, p.spans[0]),
            (std::vector<uint64_t>{b + 1000, b + 3000, b + 7000, b + 15192, b + 31576}));
}

TEST(LeadInCuts, DefaultOptionsOnMiBChunks) {
  // The defaults (1 MiB lead-in, 256 KiB pieces, 4 MiB spans) on 2 MiB chunks: the first span
  // goes out in parts of 1 MiB, 2 MiB, then the rest (1 MiB).
  const RankFileHeader h = Header({{"w", 5 * kMiB + 492, 0}, {"v", 3 * kMiB, 5 * kMiB + 4096}}, 2 * kMiB);
  Targets t = MakeTargets(h, {true, true});
  LoadOptions o;
  o.threads = 2;
  const LoadPlan p = PlanLoad(h, kData, t.list, o, false);
  EXPECT_EQ(p.lead_in, kMiB);
  EXPECT_EQ(p.read_step, 256u << 10);
  EXPECT_EQ(p.largest_span, 4 * kMiB);
  const uint64_t b = p.spans[0].begin;
  EXPECT_EQ(LeadInCuts(p, p.spans[0]), (std::vector<uint64_t>{b + kMiB, b + 3 * kMiB}));
  // Without checksums the lead-in reads in pieces of 256 KiB too.
  o.verify_checksums = false;
  const LoadPlan q = PlanLoad(h, kData, t.list, o, false);
  EXPECT_EQ(LeadInCuts(q, q.spans[0]), (std::vector<uint64_t>{b + kMiB, b + 3 * kMiB}));
  // None for a zstd or host span, or with lead_in_bytes 0.
  o.lead_in_bytes = 0;
  const LoadPlan none = PlanLoad(h, kData, t.list, o, false);
  EXPECT_TRUE(LeadInCuts(none, none.spans[0]).empty());
}

TEST(ForEachCopy, ClipsTheSpansCopiesToARange) {
  const RankFileHeader h = Fixture();
  Targets t = MakeTargets(h, {true, true, true, true});
  const LoadPlan p = PlanLoad(h, kData, t.list, Warm(kMiB), false);
  const LoadSpan& s = p.spans[0];
  struct Copy {
    char* dst;
    uint64_t at, n;
    bool operator==(const Copy&) const = default;
  };
  auto copies = [&](uint64_t from, uint64_t to) {
    std::vector<Copy> out;
    ForEachCopy(p, s, from, to, [&](char* dst, uint64_t at, uint64_t n) { out.push_back({dst, at, n}); });
    return out;
  };
  // The whole span: a, b, d from their offsets in the staging.
  EXPECT_EQ(copies(s.begin, s.end),
            (std::vector<Copy>{{t.dst(0), 0, 20000}, {t.dst(1), 20480, 100}, {t.dst(3), 24576, 40960}}));
  // A lead-in part that ends inside a, then the rest.
  EXPECT_EQ(copies(s.begin, s.begin + 1000), (std::vector<Copy>{{t.dst(0), 0, 1000}}));
  EXPECT_EQ(copies(s.begin + 1000, s.end),
            (std::vector<Copy>{{t.dst(0) + 1000, 1000, 19000}, {t.dst(1), 20480, 100}, {t.dst(3), 24576, 40960}}));
  // A range in the gap between a and b: nothing.
  EXPECT_TRUE(copies(4096 + 20000, 4096 + 20480).empty());
}

TEST(ResolveTargets, RejectsWhatLoadRankFileRejects) {
  const RankFileHeader h = Fixture();
  char buf[100];
  auto resolve = [&](std::vector<LoadTarget> targets, bool copier = true) {
    return [=] { ResolveTargets(h, targets, copier, "/x/rank.reshard"); };
  };
  EXPECT_TRUE(ThrowsError(resolve({{"zz", buf, 1, false}}), ErrorCode::kMismatch,
                          {"/x/rank.reshard", "has no tensor \"zz\""}));
  EXPECT_TRUE(ThrowsError(resolve({{"b", buf, 100, false}, {"b", buf, 100, false}}),
                          ErrorCode::kInvalidArgument, {"\"b\" is a load target twice"}));
  EXPECT_TRUE(ThrowsError(resolve({{"b", buf, 99, false}}), ErrorCode::kMismatch,
                          {"tensor \"b\" holds 100 bytes, the destination has 99"}));
  EXPECT_TRUE(ThrowsError(resolve({{"b", nullptr, 100, false}}), ErrorCode::kInvalidArgument,
                          {"\"b\": null destination"}));
  EXPECT_TRUE(ThrowsError(resolve({{"b", buf, 100, true}}, false), ErrorCode::kInvalidArgument,
                          {"no device copier was given"}));
  // An empty tensor may have no destination.
  const LoadJobs ok = ResolveTargets(h, std::vector<LoadTarget>{{"c", nullptr, 0, true}}, true, "");
  EXPECT_FALSE(ok.any_device);
  EXPECT_TRUE(ok.all_device);
}

TEST(ChooseIo, PageCacheAndTargetsPickTheReadMode) {
  const RankFileHeader h = Fixture();
  Targets dev = MakeTargets(h, {true, true, true, true});
  Targets mixed = MakeTargets(h, {true, false, true, true});
  Targets host = MakeTargets(h, {false, false, false, false});
  const LoadJobs d = ResolveTargets(h, dev.list, true, "");
  const LoadJobs m = ResolveTargets(h, mixed.list, true, "");
  const LoadJobs o = ResolveTargets(h, host.list, true, "");
  auto is = [](IoChoice c, bool direct, bool readahead) {
    return c.direct == direct && c.readahead == readahead;
  };
  // kAuto: warm when at least half the file is in the page cache; else O_DIRECT for an
  // all-device load, read-ahead for the others.
  EXPECT_TRUE(is(ChooseIo(IoMode::kAuto, 0.5, d), false, false));
  EXPECT_TRUE(is(ChooseIo(IoMode::kAuto, 0.49, d), true, false));
  EXPECT_TRUE(is(ChooseIo(IoMode::kAuto, 0.0, m), false, true));
  EXPECT_TRUE(is(ChooseIo(IoMode::kAuto, 0.0, o), false, true));
  EXPECT_TRUE(ChooseIo(IoMode::kAuto, 0.0, o).cold());
  EXPECT_FALSE(ChooseIo(IoMode::kAuto, 1.0, o).cold());
  // The others whatever the page cache holds; kDirect only with device targets.
  EXPECT_TRUE(is(ChooseIo(IoMode::kBuffered, 0.0, d), false, false));
  EXPECT_TRUE(is(ChooseIo(IoMode::kReadahead, 1.0, d), false, true));
  EXPECT_TRUE(is(ChooseIo(IoMode::kDirect, 1.0, m), true, false));
  EXPECT_TRUE(is(ChooseIo(IoMode::kDirect, 1.0, o), false, false));
}

}  // namespace
}  // namespace reshard
