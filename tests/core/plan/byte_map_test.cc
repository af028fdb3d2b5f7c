// The byte map of rank-file entries (reshard/plan/byte_map.h): segments of FSDP2 shards, whole
// entries and FSDP1 flat shards, filled from sources in memory (with dtype conversion,
// padding) and compared with hand-computed bytes.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/fsdp1.h"

namespace reshard {
namespace {

using test::ThrowsError;

// Source tensors laid out one after the other in one in-memory "file".
struct Sources {
  std::vector<char> file;
  std::map<std::string, SourceTensor> tensors;

  template <typename T>
  void Add(const std::string& name, std::vector<uint64_t> shape, DType dtype, const std::vector<T>& v) {
    SourceTensor t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.offset = file.size();
    t.nbytes = v.size() * sizeof(T);
    file.insert(file.end(), reinterpret_cast<const char*>(v.data()),
                reinterpret_cast<const char*>(v.data()) + t.nbytes);
    tensors[name] = t;
  }
  SourceLookup Lookup() const {
    return [this](std::string_view n) -> const SourceTensor* {
      auto it = tensors.find(std::string(n));
      return it == tensors.end() ? nullptr : &it->second;
    };
  }
  SourceRead Read() const {
    return [this](size_t, uint64_t at, size_t n, void* dst) {
      ASSERT_LE(at + n, file.size());
      std::memcpy(dst, file.data() + at, n);
    };
  }
};

TensorEntry Shard(const std::string& name, DType dtype, std::vector<uint64_t> global, RowRange rows) {
  TensorEntry e;
  e.name = name;
  e.dtype = dtype;
  e.global_shape = global;
  e.sharded = true;
  e.rows = rows;
  e.local_shape = global;
  e.local_shape[0] = rows.size();
  uint64_t numel = 1;
  for (uint64_t d : e.local_shape) numel *= d;
  e.nbytes = numel * Info(dtype).bits / 8;
  return e;
}

std::vector<char> Fill(const EntryMap& m, const Sources& s, uint64_t begin, uint64_t length) {
  std::vector<char> out(length, '\x7f');
  std::vector<char> scratch;
  FillEntry(m, s.Lookup(), s.Read(), begin, length, out.data(), scratch);
  return out;
}

TEST(ByteMap, Fsdp2ShardIsTheRowsOfItsSource) {
  Sources s;
  std::vector<float> v(7 * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  s.Add("w", {7, 3}, DType::kF32, v);
  const TensorEntry e = Shard("w", DType::kF32, {7, 3}, {3, 6});  // rank 1 of 2: rows 3..5
  const EntryMap m = MapEntry(e, LayoutKind::kFsdp2, 2, 1, "f");
  ASSERT_EQ(m.segments.size(), 1u);
  EXPECT_EQ(m.segments[0].source, "w");
  EXPECT_EQ(m.segments[0].source_element, 9u);
  EXPECT_EQ(m.segments[0].count, 9u);
  EXPECT_EQ(CheckSources(m, s.Lookup()), "");
  const std::vector<char> got = Fill(m, s, 4, 20);  // elements 1..5 of the shard
  std::vector<char> want(20);
  std::memcpy(want.data(), v.data() + 10, 20);
  EXPECT_EQ(got, want);
  const auto [file, at] = FirstSourceByte(m, s.Lookup(), 8);
  EXPECT_EQ(file, 0u);
  EXPECT_EQ(at, (9u + 2u) * 4u);
  EXPECT_EQ(DescribeEntryByte(m, 8), "element 11 of source tensor w");
}

TEST(ByteMap, ConvertingShardGivesTensorToBits) {
  Sources s;
  std::vector<float> v = {1.0f, 3.14159f, -0.0f, 1e-40f, 65504.0f, 7.0f};
  s.Add("w", {3, 2}, DType::kF32, v);
  const TensorEntry e = Shard("w", DType::kBF16, {3, 2}, {2, 3});
  const EntryMap m = MapEntry(e, LayoutKind::kFsdp2, 2, 1, "f");
  const std::vector<char> got = Fill(m, s, 0, 4);
  std::vector<char> want(4);
  ConvertElements(DType::kF32, DType::kBF16, v.data() + 4, want.data(), 2);
  EXPECT_EQ(got, want);
}

TEST(ByteMap, EmptyShardAndWholeEntry) {
  const TensorEntry empty = Shard("w", DType::kF16, {6, 4}, {6, 6});  // 6 rows, rank 3 of 4
  EXPECT_TRUE(MapEntry(empty, LayoutKind::kFsdp2, 4, 3, "f").segments.empty());
  TensorEntry whole;
  whole.name = "s";
  whole.dtype = DType::kF32;
  whole.nbytes = 4;  // 0-dim
  const EntryMap m = MapEntry(whole, LayoutKind::kFsdp2, 4, 3, "f");
  ASSERT_EQ(m.segments.size(), 1u);
  EXPECT_EQ(m.segments[0].source_element, 0u);
  EXPECT_EQ(m.segments[0].count, 1u);
}

TEST(ByteMap, RowsOutsideTheTensorAreCorrupt) {
  TensorEntry e = Shard("w", DType::kF32, {4, 2}, {2, 4});
  e.rows = {3, 5};
  EXPECT_TRUE(ThrowsError([&] { MapEntry(e, LayoutKind::kFsdp2, 2, 1, "f.reshard"); },
                          ErrorCode::kDataLoss, {"f.reshard: tensor \"w\": rows [3, 5)"}));
  TensorEntry n = Shard("w", DType::kF32, {4, 2}, {2, 4});
  n.nbytes = 12;
  EXPECT_TRUE(ThrowsError([&] { MapEntry(n, LayoutKind::kFsdp2, 2, 1, "f"); }, ErrorCode::kDataLoss,
                          {"12 bytes for 4 elements of F32"}));
}

// FSDP1: parameters a [5] (f32) and b [2, 3] (bf16 in the source) at flat offsets 0 and 8
// (alignment padding 5..7), numel 14, over 3 ranks: c = ceil(14 / 3) = 5.
TEST(ByteMap, FlatShardHoldsParametersPaddingAndZeros) {
  Sources s;
  s.Add("a", {5}, DType::kF32, std::vector<float>{1, 2, 3, 4, 5});
  s.Add("b", {2, 3}, DType::kBF16, std::vector<uint16_t>{0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0});
  auto flat = std::make_shared<FlatInfo>();
  flat->unit = "";
  flat->numel = 14;
  flat->params = {{"a", "a", {5}, 5, 0}, {"b", "b", {2, 3}, 6, 8}};
  TensorEntry e;
  e.name = "_flat_param";
  e.dtype = DType::kF32;
  e.global_shape = {14};
  e.sharded = true;
  e.local_shape = {5};  // ceil(14 / 3)
  e.nbytes = 20;
  e.flat = flat;
  e.rows = ChunkRows(14, 3, 1);
  const EntryMap m1 = MapEntry(e, LayoutKind::kFsdp1, 3, 1, "f");
  // Rank 1: flat [5, 10): padding 5..7, b 0..1.
  ASSERT_EQ(m1.segments.size(), 2u);
  EXPECT_EQ(m1.segments[0].kind, EntrySegment::Kind::kPadding);
  EXPECT_EQ(m1.segments[0].count, 3u);
  EXPECT_EQ(m1.segments[1].source, "b");
  EXPECT_EQ(m1.segments[1].source_element, 0u);
  EXPECT_EQ(m1.segments[1].count, 2u);
  EXPECT_EQ(CheckSources(m1, s.Lookup()), "");  // bf16 source, f32 flat: converted
  const std::vector<char> got = Fill(m1, s, 0, 20);
  std::vector<float> want = {42, 42, 42, 1, 2};
  EXPECT_EQ(std::memcmp(got.data(), want.data(), 20), 0);
  EXPECT_EQ(DescribeEntryByte(m1, 4), "padding (42)");
  EXPECT_EQ(DescribeEntryByte(m1, 16), "element 1 of source tensor b");
  // Rank 2: flat [10, 15): b 2..5 then one zero past numel.
  const EntryMap m2 = MapEntry(e, LayoutKind::kFsdp1, 3, 2, "f");
  const std::vector<char> got2 = Fill(m2, s, 0, 20);
  std::vector<float> want2 = {3, 4, 5, 6, 0};
  EXPECT_EQ(std::memcmp(got2.data(), want2.data(), 20), 0);
  EXPECT_EQ(DescribeEntryByte(m2, 16), "zero padding past the flat parameter");
}

TEST(ByteMap, SourceProblemsAreNamed) {
  Sources s;
  s.Add("w", {4}, DType::kI32, std::vector<int32_t>{1, 2, 3, 4});
  TensorEntry e = Shard("w", DType::kF32, {4}, {0, 4});
  EXPECT_EQ(CheckSources(MapEntry(e, LayoutKind::kFsdp2, 1, 0, "f"), s.Lookup()),
            "source tensor w is I32, the entry F32");
  TensorEntry other = Shard("x", DType::kF32, {4}, {0, 4});
  EXPECT_EQ(CheckSources(MapEntry(other, LayoutKind::kFsdp2, 1, 0, "f"), s.Lookup()),
            "source tensor x is not in the source");
  TensorEntry shape = Shard("w", DType::kI32, {2, 2}, {0, 2});
  EXPECT_EQ(CheckSources(MapEntry(shape, LayoutKind::kFsdp2, 1, 0, "f"), s.Lookup()),
            "source tensor w has another shape");
}

}  // namespace
}  // namespace reshard
