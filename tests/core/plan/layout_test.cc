// The FSDP2 chunk rule and the rank plan, checked against a brute-force model (test_util's
// BruteRows hands rows out one rank at a time) and against hand-computed values.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/layout.h"
#include "reshard/io/checkpoint.h"
#include "reshard/plan/rank_plan.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::BruteRows;
using test::ThrowsError;

std::vector<uint64_t> Sizes(uint64_t n, uint64_t w) {
  std::vector<uint64_t> s;
  for (uint64_t r = 0; r < w; ++r) s.push_back(ChunkRows(n, w, r).size());
  return s;
}

TEST(ChunkRows, SixRowsOnFourRanksGivesTwoTwoTwoZero) {
  EXPECT_EQ(Sizes(6, 4), (std::vector<uint64_t>{2, 2, 2, 0}));
  EXPECT_EQ(ChunkRows(6, 4, 3), (RowRange{6, 6}));
}

TEST(ChunkRows, HundredThirtyOneRowsOnThreeRanks) {
  EXPECT_EQ(Sizes(131, 3), (std::vector<uint64_t>{44, 44, 43}));
  EXPECT_EQ(ChunkRows(131, 3, 0), (RowRange{0, 44}));
  EXPECT_EQ(ChunkRows(131, 3, 1), (RowRange{44, 88}));
  EXPECT_EQ(ChunkRows(131, 3, 2), (RowRange{88, 131}));
}

TEST(ChunkRows, NotDivisibleUsesCeilNotFloor) {
  // n / W would give 2 rows each and lose 2; ceil gives 3,3,3,1.
  EXPECT_EQ(Sizes(10, 4), (std::vector<uint64_t>{3, 3, 3, 1}));
  EXPECT_EQ(Sizes(7, 2), (std::vector<uint64_t>{4, 3}));
}

TEST(ChunkRows, FewerRowsThanRanks) {
  EXPECT_EQ(Sizes(3, 8), (std::vector<uint64_t>{1, 1, 1, 0, 0, 0, 0, 0}));
  // Empty ranks sit at the end of the tensor, not at 0.
  EXPECT_EQ(ChunkRows(3, 8, 5), (RowRange{3, 3}));
  // 5 rows on 4 ranks: c = 2 gives 2,2,1,0 (not 2,1,1,1).
  EXPECT_EQ(Sizes(5, 4), (std::vector<uint64_t>{2, 2, 1, 0}));
}

TEST(ChunkRows, ZeroRows) {
  for (uint64_t w : {1u, 2u, 7u}) {
    for (uint64_t r = 0; r < w; ++r) EXPECT_EQ(ChunkRows(0, w, r), (RowRange{0, 0}));
  }
}

TEST(ChunkRows, WorldSizeOneOwnsEverything) {
  for (uint64_t n : {0u, 1u, 6u, 131u, 100000u}) EXPECT_EQ(ChunkRows(n, 1, 0), (RowRange{0, n}));
}

TEST(ChunkRows, MatchesBruteForceForAllSmallCases) {
  for (uint64_t n = 0; n <= 70; ++n) {
    for (uint64_t w = 1; w <= 12; ++w) {
      uint64_t covered = 0;
      for (uint64_t r = 0; r < w; ++r) {
        auto [s, e] = BruteRows(n, w, r);
        ASSERT_EQ(ChunkRows(n, w, r), (RowRange{s, e})) << "n=" << n << " W=" << w << " r=" << r;
        covered += e - s;
      }
      ASSERT_EQ(covered, n);
    }
  }
}

TEST(ChunkRows, HugeRowCountsDoNotOverflow) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  // c = 2^63; (r+1)·c is 2^64 for the last rank, which must clamp to n, not wrap to 0.
  EXPECT_EQ(ChunkRows(kMax, 2, 0), (RowRange{0, uint64_t{1} << 63}));
  EXPECT_EQ(ChunkRows(kMax, 2, 1), (RowRange{uint64_t{1} << 63, kMax}));
  // 2^64 − 1 = 3 · 0x5555555555555555: exact thirds.
  EXPECT_EQ(ChunkRows(kMax, 3, 2), (RowRange{2 * 0x5555555555555555ull, kMax}));
  // 2^63 + 1 rows on 4 ranks: c = 2^61 + 1; rank 3 holds what is left.
  const uint64_t n = (uint64_t{1} << 63) + 1, c = (uint64_t{1} << 61) + 1;
  EXPECT_EQ(ChunkRows(n, 4, 3), (RowRange{3 * c, n}));
  EXPECT_EQ(ChunkRows(kMax, 1u << 24, (1u << 24) - 1).end, kMax);
}

// ---- PlanRank ----------------------------------------------------------------------------

// A checkpoint in memory: tensors are given in source order and sorted by name, as
// OpenCheckpoint does, so that "name order" and "source order" differ.
struct SourceSpec {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  size_t file;
  uint64_t offset;
  uint64_t bits;
};

Checkpoint MakeCheckpoint(const std::vector<SourceSpec>& specs) {
  Checkpoint ckpt;
  ckpt.files.resize(2);
  for (const auto& s : specs) {
    uint64_t numel = 1;
    for (uint64_t d : s.shape) numel *= d;
    ckpt.tensors.push_back({s.name, s.dtype, s.shape, s.file, s.offset, numel * s.bits / 8});
  }
  std::sort(ckpt.tensors.begin(), ckpt.tensors.end(),
            [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  return ckpt;
}

const std::vector<SourceSpec> kSpecs = {
    // name            dtype        shape        file offset   bits
    {"z.first", DType::kBF16, {131, 20}, 0, 100, 16},  // 5240 B: the next offset is 8192
    {"a.scalar", DType::kF32, {}, 0, 5340, 32},        // 0-dim
    {"m.six", DType::kF32, {6, 5}, 0, 5344, 32},       // 2,2,2,0 on 4 ranks
    {"b.empty", DType::kF16, {0, 3}, 0, 5464, 16},     // no rows at all
    {"y.second_file", DType::kI64, {9}, 1, 8, 64},     // file 1 comes after file 0
    {"c.later_in_file1", DType::kU8, {4097}, 1, 80, 8},
    {"x.earlier_in_file1", DType::kI8, {3, 3}, 1, 40, 8},
};

// The brute-force plan: walk tensors in (file, offset) order; rows by BruteRows; offsets
// rounded up to 4096 by a loop.
struct Expected {
  std::string name;
  bool sharded;
  uint64_t start, end;
  std::vector<uint64_t> local_shape;
  uint64_t nbytes, source_offset, offset;
};

std::vector<Expected> BrutePlan(std::vector<SourceSpec> specs, uint64_t w, uint64_t r,
                                uint64_t* data_size) {
  std::sort(specs.begin(), specs.end(), [](const SourceSpec& a, const SourceSpec& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });
  std::vector<Expected> out;
  uint64_t cursor = 0;
  for (const auto& s : specs) {
    Expected e{s.name, !s.shape.empty(), 0, 0, s.shape, 0, s.offset, cursor};
    uint64_t row_bits = s.bits;
    for (size_t d = 1; d < s.shape.size(); ++d) row_bits *= s.shape[d];
    if (s.shape.empty()) {
      e.nbytes = s.bits / 8;
    } else {
      auto [a, b] = BruteRows(s.shape[0], w, r);
      e.start = a;
      e.end = b;
      e.local_shape[0] = b - a;
      e.nbytes = (b - a) * row_bits / 8;
      e.source_offset = s.offset + a * row_bits / 8;
    }
    out.push_back(e);
    cursor += e.nbytes;
    while (cursor % 4096 != 0) ++cursor;
  }
  *data_size = cursor;
  return out;
}

TEST(PlanRank, MatchesBrutePlanForManyWorldSizes) {
  const Checkpoint ckpt = MakeCheckpoint(kSpecs);
  for (uint32_t w : {1u, 2u, 3u, 4u, 5u, 8u, 13u}) {
    for (uint32_t r = 0; r < w; ++r) {
      uint64_t data_size = 0;
      const auto expected = BrutePlan(kSpecs, w, r, &data_size);
      const RankPlan plan = PlanRank(ckpt, LayoutSpec{LayoutKind::kFsdp2, w, "keep"}, r);
      SCOPED_TRACE("W=" + std::to_string(w) + " r=" + std::to_string(r));
      EXPECT_EQ(plan.rank, r);
      EXPECT_EQ(plan.data_size, data_size);
      ASSERT_EQ(plan.tensors.size(), expected.size());
      for (size_t i = 0; i < expected.size(); ++i) {
        const PlannedTensor& p = plan.tensors[i];
        const Expected& e = expected[i];
        SCOPED_TRACE(e.name);
        EXPECT_EQ(p.name, e.name);
        EXPECT_EQ(ckpt.tensors[p.source_index].name, e.name);
        EXPECT_EQ(p.sharded, e.sharded);
        if (e.sharded) EXPECT_EQ(p.rows, (RowRange{e.start, e.end}));
        EXPECT_EQ(p.local_shape, e.local_shape);
        EXPECT_EQ(p.global_shape, ckpt.tensors[p.source_index].shape);
        EXPECT_EQ(p.nbytes, e.nbytes);
        EXPECT_EQ(p.source_offset, e.source_offset);
        EXPECT_EQ(p.offset, e.offset);
        EXPECT_EQ(p.offset % 4096, 0u);
      }
    }
  }
}

TEST(PlanRank, FileOrderIsSourceOrderNotNameOrder) {
  const RankPlan plan = PlanRank(MakeCheckpoint(kSpecs), LayoutSpec{}, 0);
  std::vector<std::string> names;
  for (const auto& t : plan.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"z.first", "a.scalar", "m.six", "b.empty",
                                             "y.second_file", "x.earlier_in_file1",
                                             "c.later_in_file1"}));
}

TEST(PlanRank, OffsetsAre4096AlignedWithHandComputedValues) {
  const RankPlan plan = PlanRank(MakeCheckpoint(kSpecs), LayoutSpec{}, 0);
  // W = 1: 5240, 4, 120, 0, 72, 9, 4097 bytes.
  std::vector<uint64_t> offsets, nbytes;
  for (const auto& t : plan.tensors) {
    offsets.push_back(t.offset);
    nbytes.push_back(t.nbytes);
  }
  EXPECT_EQ(nbytes, (std::vector<uint64_t>{5240, 4, 120, 0, 72, 9, 4097}));
  // b.empty (0 bytes) shares its aligned offset with the next tensor.
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 8192, 12288, 16384, 16384, 20480, 24576}));
  EXPECT_EQ(plan.data_size, 24576u + 8192u);
}

TEST(PlanRank, ZeroDimTensorsAreStoredWholeOnEveryRank) {
  const Checkpoint ckpt = MakeCheckpoint(kSpecs);
  for (uint32_t r = 0; r < 5; ++r) {
    const RankPlan plan = PlanRank(ckpt, LayoutSpec{LayoutKind::kFsdp2, 5, "keep"}, r);
    const PlannedTensor& t = plan.tensors[1];
    ASSERT_EQ(t.name, "a.scalar");
    EXPECT_FALSE(t.sharded);
    EXPECT_TRUE(t.local_shape.empty());
    EXPECT_TRUE(t.global_shape.empty());
    EXPECT_EQ(t.nbytes, 4u);
    EXPECT_EQ(t.source_offset, 5340u);
  }
}

TEST(PlanRank, EmptyShardKeepsAnAlignedOffsetAndZeroBytes) {
  const RankPlan plan = PlanRank(MakeCheckpoint(kSpecs), LayoutSpec{LayoutKind::kFsdp2, 4, "keep"}, 3);
  const PlannedTensor& six = plan.tensors[2];
  ASSERT_EQ(six.name, "m.six");
  EXPECT_TRUE(six.sharded);
  EXPECT_EQ(six.rows, (RowRange{6, 6}));
  EXPECT_EQ(six.local_shape, (std::vector<uint64_t>{0, 5}));
  EXPECT_EQ(six.nbytes, 0u);
  EXPECT_EQ(six.offset % 4096, 0u);
  EXPECT_EQ(six.source_offset, 5344u + 6 * 20);
  // The tensor after an empty one starts at the same offset: zero bytes take no space.
  EXPECT_EQ(plan.tensors[3].offset, six.offset);
  // z.first rank 3 of 4 = rows [99, 131) = 32 rows × 40 B = 1280 B.
  EXPECT_EQ(plan.tensors[0].nbytes, 1280u);
  EXPECT_EQ(plan.tensors[0].source_offset, 100u + 99 * 40);
}

TEST(PlanRank, SubByteRowsAreRefused) {
  // F4 with 3 elements per row: 12 bits, not a whole number of bytes.
  const Checkpoint odd = MakeCheckpoint({{"w", DType::kF4, {4, 3}, 0, 8, 4}});
  EXPECT_TRUE(ThrowsError([&] { PlanRank(odd, LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, 0); },
                          ErrorCode::kUnsupported, {"\"w\"", "F4", "whole number of bytes"}));
  const Checkpoint f6 = MakeCheckpoint({{"v", DType::kF6_E2M3, {3, 3}, 0, 8, 6}});
  EXPECT_TRUE(ThrowsError([&] { PlanRank(f6, LayoutSpec{}, 0); }, ErrorCode::kUnsupported,
                          {"\"v\"", "F6_E2M3"}));
  // Whole-byte rows of sub-byte types are fine: F4 × 2 = 1 byte, F6 × 4 = 3 bytes.
  const Checkpoint ok = MakeCheckpoint(
      {{"p", DType::kF4, {4, 2}, 0, 8, 4}, {"q", DType::kF6_E3M2, {2, 4}, 0, 12, 6}});
  const RankPlan plan = PlanRank(ok, LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, 1);
  EXPECT_EQ(plan.tensors[0].nbytes, 2u);
  EXPECT_EQ(plan.tensors[0].source_offset, 8u + 2);
  EXPECT_EQ(plan.tensors[1].nbytes, 3u);
  EXPECT_EQ(plan.tensors[1].source_offset, 12u + 3);
}

TEST(PlanRank, HugeEmptyTensorSplitsWithoutOverflow) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const Checkpoint ckpt = MakeCheckpoint({{"h", DType::kBF16, {kMax, 0}, 0, 8, 16}});
  const RankPlan p1 = PlanRank(ckpt, LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, 1);
  EXPECT_EQ(p1.tensors[0].rows, (RowRange{uint64_t{1} << 63, kMax}));
  EXPECT_EQ(p1.tensors[0].local_shape, (std::vector<uint64_t>{(uint64_t{1} << 63) - 1, 0}));
  EXPECT_EQ(p1.tensors[0].nbytes, 0u);
  EXPECT_EQ(p1.data_size, 0u);
}

TEST(PlanRank, RankOutsideWorldSizeIsInvalidArgument) {
  const Checkpoint ckpt = MakeCheckpoint(kSpecs);
  EXPECT_TRUE(ThrowsError([&] { PlanRank(ckpt, LayoutSpec{LayoutKind::kFsdp2, 4, "keep"}, 4); },
                          ErrorCode::kInvalidArgument, {"rank 4", "world size 4"}));
  EXPECT_TRUE(ThrowsError([&] { PlanRank(ckpt, LayoutSpec{LayoutKind::kFsdp2, 0, "keep"}, 0); },
                          ErrorCode::kInvalidArgument, {"world size 0"}));
}

TEST(LayoutSpec, KeysAndKindNames) {
  EXPECT_EQ((LayoutSpec{LayoutKind::kFsdp2, 8, "keep"}.Key()), "fsdp2-ws8");
  EXPECT_EQ((LayoutSpec{LayoutKind::kFsdp2, 1, "keep"}.Key()), "fsdp2-ws1");
  EXPECT_EQ((LayoutSpec{LayoutKind::kFsdp2, 8, "bf16"}.Key()), "fsdp2-ws8-bf16");
  EXPECT_EQ(ParseLayoutKind("fsdp2"), LayoutKind::kFsdp2);
  EXPECT_EQ(ParseLayoutKind("fsdp1"), LayoutKind::kFsdp1);
  EXPECT_FALSE(ParseLayoutKind("fsdp3").has_value());
  LayoutSpec f1{LayoutKind::kFsdp1, 8, "fp32", {"LlamaDecoderLayer"}, true, "bf16"};
  EXPECT_EQ(f1.Key(), "fsdp1-ws8-LlamaDecoderLayer-orig-pbf16-fp32");
  LayoutSpec many{LayoutKind::kFsdp1, 2, "keep", {"B", "A", "A"}, false, "bf16"};
  many.Normalize();  // sorted, unique; param_dtype dropped without use_orig_params
  EXPECT_EQ(many.Key(), "fsdp1-ws2-A.B");
  LayoutSpec longer{LayoutKind::kFsdp1, 2, "keep", {std::string(70, 'X')}, false, ""};
  EXPECT_TRUE(longer.Key().starts_with("fsdp1-ws2-w")) << longer.Key();
  EXPECT_EQ(longer.Key().size(), std::string("fsdp1-ws2-w").size() + 8);
  EXPECT_FALSE(ParseLayoutKind("FSDP2").has_value());
}

}  // namespace
}  // namespace reshard
