// transformers' conversions as the plan layer executes them (reshard/plan/conversion.h): the
// conversion section of a model manifest parsed and checked, the runs of checkpoint elements
// that ExprSegments gives compared with an element-by-element index calculation on every
// range of several trees (Mixtral's stack-then-cat, a chunk, nested slices), and ModelView's
// refusals naming the key.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/format/model_manifest.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/conversion.h"

namespace reshard {
namespace {

using test::ThrowsError;

std::string Manifest(const std::string& targets) {
  return R"({"format": "reshard.model", "format_version": 2, "model_class": "M",
    "base_model_prefix": "model", "no_split_modules": [], "modules": [{"name": "", "class": "M",
    "params": []}], "params": [], "buffers": [],
    "conversion": {"transformers": "5.17.0", "refused": [], "targets": )" + targets + "}}";
}

std::string Key(const std::string& k, const std::string& shape) {
  return R"({"op": "key", "key": ")" + k + R"(", "dtype": "BF16", "shape": )" + shape + "}";
}

// (key, element) of element `e` of `x`, computed from the multi-index.
std::pair<std::string, uint64_t> Naive(const ConversionExpr& x, std::vector<uint64_t> idx) {
  using Op = ConversionExpr::Op;
  if (x.op == Op::kKey) {
    uint64_t flat = 0;
    for (size_t d = 0; d < idx.size(); ++d) flat = flat * x.shape[d] + idx[d];
    return {x.key, flat};
  }
  if (x.op == Op::kStack) {
    const uint64_t k = idx[x.dim];
    idx.erase(idx.begin() + x.dim);
    return Naive(x.of[k], idx);
  }
  if (x.op == Op::kCat) {
    size_t i = 0;
    while (idx[x.dim] >= x.of[i].shape[x.dim]) idx[x.dim] -= x.of[i].shape[x.dim], ++i;
    return Naive(x.of[i], idx);
  }
  idx[x.dim] += x.start;
  return Naive(x.of[0], idx);
}

std::vector<uint64_t> Unravel(uint64_t e, const std::vector<uint64_t>& shape) {
  std::vector<uint64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) idx[d] = e % shape[d], e /= shape[d];
  return idx;
}

void ExpectSameAsNaive(const ConversionExpr& x) {
  uint64_t numel = 1;
  for (uint64_t d : x.shape) numel *= d;
  for (uint64_t begin = 0; begin <= numel; ++begin) {
    for (uint64_t count = 0; begin + count <= numel; count += 1 + count / 3) {
      std::vector<EntrySegment> segs;
      ExprSegments(x, begin, count, 100, segs);
      uint64_t covered = 0;
      for (const auto& s : segs) {
        ASSERT_EQ(s.element, 100 + covered) << "segments tile the range in order";
        for (uint64_t i = 0; i < s.count; ++i) {
          const auto want = Naive(x, Unravel(begin + covered + i, x.shape));
          ASSERT_EQ(s.source, want.first) << "element " << begin + covered + i;
          ASSERT_EQ(s.source_element + i, want.second) << "element " << begin + covered + i;
        }
        covered += s.count;
      }
      ASSERT_EQ(covered, count);
    }
  }
}

TEST(Conversion, MixtralGateUpIsStackThenCatAndMatchesIndexMath) {
  // gate_up_proj [E=3, 2I=4, H=5] = cat(dim 1) of stack(dim 0) of w1 [2, 5] and of w3 [2, 5].
  std::string w1 = "[" + Key("e0.w1", "[2, 5]") + "," + Key("e1.w1", "[2, 5]") + "," + Key("e2.w1", "[2, 5]") + "]";
  std::string w3 = "[" + Key("e0.w3", "[2, 5]") + "," + Key("e1.w3", "[2, 5]") + "," + Key("e2.w3", "[2, 5]") + "]";
  const ModelManifest m = ParseModelManifest(
      Manifest(R"([{"name": "gate_up", "shape": [3, 4, 5], "expr": {"op": "cat", "dim": 1, "of": [
        {"op": "stack", "dim": 0, "of": )" + w1 + R"(}, {"op": "stack", "dim": 0, "of": )" + w3 + "}]}}]"),
      "m.json");
  ASSERT_TRUE(m.conversion.has_value());
  const ConversionTarget* t = m.conversion->Find("gate_up");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->expr.shape, (std::vector<uint64_t>{3, 4, 5}));
  ExpectSameAsNaive(t->expr);
  // Expert 1's rows: two whole runs, w1 then w3 (what a rank owning row 1 reads).
  std::vector<EntrySegment> segs;
  ExprSegments(t->expr, 20, 20, 0, segs);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].source, "e1.w1");
  EXPECT_EQ(segs[0].count, 10u);
  EXPECT_EQ(segs[1].source, "e1.w3");
  EXPECT_EQ(segs[1].source_element, 0u);
}

// Fused experts fully_shard'ed on tensor dim 1 (torchtitan's Shard(1) when efsdp x ep >
// experts) over EP's Shard(0): the rank's entry is a DTensor box of gate_up (kStrided
// segments), which ExpandConversion turns into runs of the experts' own w1 / w3, element for
// element what the index calculation of the box and the conversion gives.
TEST(Conversion, ExpandsDTensorBoxesOfAssembledTensors) {
  std::string w1 = "[" + Key("e0.w1", "[2, 5]") + "," + Key("e1.w1", "[2, 5]") + "," + Key("e2.w1", "[2, 5]") +
                   "," + Key("e3.w1", "[2, 5]") + "]";
  std::string w3 = "[" + Key("e0.w3", "[2, 5]") + "," + Key("e1.w3", "[2, 5]") + "," + Key("e2.w3", "[2, 5]") +
                   "," + Key("e3.w3", "[2, 5]") + "]";
  const ModelManifest m = ParseModelManifest(
      Manifest(R"([{"name": "gate_up", "shape": [4, 4, 5], "expr": {"op": "cat", "dim": 1, "of": [
        {"op": "stack", "dim": 0, "of": )" + w1 + R"(}, {"op": "stack", "dim": 0, "of": )" + w3 + "}]}}]"),
      "m.json");
  const ConversionTarget* t = m.conversion->Find("gate_up");
  ASSERT_NE(t, nullptr);
  const std::vector<uint64_t> shape = {4, 4, 5};
  // [S(1) over efsdp=2, S(0) over ep=2] (fully_shard's mesh dim 0), and a box cut on dims 1 and 2.
  const std::vector<std::pair<std::vector<Placement>, std::vector<uint32_t>>> cases = {
      {{Placement::Shard(1), Placement::Shard(0)}, {2, 2}},
      {{Placement::Shard(2), Placement::Shard(1)}, {2, 2}},
  };
  for (const auto& [placements, mesh_shape] : cases) {
    for (uint32_t rank = 0; rank < 4; ++rank) {
      TensorEntry e;
      e.name = "gate_up";
      e.dtype = DType::kBF16;
      e.global_shape = shape;
      DTensorSharding s;
      s.mesh_shape = mesh_shape;
      s.placements = placements;
      s.fsdp_mesh_dim = 0;
      const std::vector<uint32_t> coord = {rank / 2, rank % 2};
      e.local_shape = DTensorLocalShape(shape, s, mesh_shape, coord, "t");
      e.dtensor = s;
      e.sharded = false;
      uint64_t numel = 1;
      for (uint64_t d : e.local_shape) numel *= d;
      e.nbytes = numel * 2;
      EntryMap map = MapEntry(e, LayoutKind::kDTensor, 4, rank, "t");
      bool strided = false;
      for (const EntrySegment& g : map.segments) strided |= g.kind == EntrySegment::Kind::kStrided;
      EXPECT_TRUE(strided) << "a box, not rows";
      std::vector<std::pair<std::string, uint64_t>> want;  // by the box's own segments, then Naive
      for (const EntrySegment& g : map.segments) {
        for (uint64_t i = 0; i < g.count; ++i) want.push_back(Naive(t->expr, Unravel(g.SourceElementAt(i), shape)));
      }
      ExpandConversion(map, *m.conversion);
      std::vector<std::pair<std::string, uint64_t>> got;
      uint64_t at = 0;
      for (const EntrySegment& g : map.segments) {
        ASSERT_EQ(g.kind, EntrySegment::Kind::kSource);
        ASSERT_EQ(g.element, at);
        for (uint64_t i = 0; i < g.count; ++i) got.emplace_back(g.source, g.source_element + i);
        at += g.count;
      }
      EXPECT_EQ(at, numel);
      EXPECT_EQ(got, want) << "rank " << rank << " " << placements[0].ToString();
    }
  }
}

TEST(Conversion, ChunksSlicesAndStacksOnInnerDimsMatchIndexMath) {
  const ModelManifest m = ParseModelManifest(
      Manifest(R"([{"name": "a", "shape": [3, 2, 4], "expr": {"op": "stack", "dim": 1, "of": [)" +
               Key("x", "[3, 4]") + "," + Key("y", "[3, 4]") + R"(]}},
        {"name": "b", "shape": [2, 3], "expr": {"op": "slice", "dim": 1, "start": 1, "stop": 4, "of": [
          {"op": "cat", "dim": 0, "of": [)" + Key("p", "[1, 5]") + "," + Key("q", "[1, 5]") + R"(]}]}},
        {"name": "c", "shape": [0, 4], "expr": {"op": "slice", "dim": 0, "start": 2, "stop": 2, "of": [)" +
               Key("x", "[3, 4]") + "]}}]"),
      "m.json");
  for (const auto& t : m.conversion->targets) ExpectSameAsNaive(t.expr);
}

// export --hub-names: the layout's tensors under the model's names, inverted into the
// checkpoint's keys. Each target's bytes are laid out over two ranks in FSDP2 rows; every
// element holds the id of the (key, element) it came from (by the index calculation), so
// reassembling each key from its pieces must give exactly its own ids. "qkv" feeds two
// targets (a chunk), "norm" is kept as it is.
TEST(Conversion, HubNameLocationsInvertTheConversion) {
  std::string w1 = "[" + Key("e0.w1", "[2, 5]") + "," + Key("e1.w1", "[2, 5]") + "," + Key("e2.w1", "[2, 5]") + "]";
  std::string w3 = "[" + Key("e0.w3", "[2, 5]") + "," + Key("e1.w3", "[2, 5]") + "," + Key("e2.w3", "[2, 5]") + "]";
  const ModelManifest m = ParseModelManifest(
      Manifest(R"([{"name": "gate_up", "shape": [3, 4, 5], "expr": {"op": "cat", "dim": 1, "of": [
        {"op": "stack", "dim": 0, "of": )" + w1 + R"(}, {"op": "stack", "dim": 0, "of": )" + w3 + R"(}]}},
        {"name": "q", "shape": [2, 5], "expr": {"op": "slice", "dim": 0, "start": 0, "stop": 2, "of": [)" +
               Key("qkv", "[6, 5]") + R"(]}},
        {"name": "kv", "shape": [4, 5], "expr": {"op": "slice", "dim": 0, "start": 2, "stop": 6, "of": [)" +
               Key("qkv", "[6, 5]") + "]}}]"),
      "m.json");
  const Conversion& c = *m.conversion;
  std::map<std::string, uint16_t> key_id;
  auto id = [&](const std::string& k, uint64_t e) {
    auto it = key_id.emplace(k, static_cast<uint16_t>(key_id.size())).first;
    return static_cast<uint16_t>(it->second * 100 + e);
  };
  // Rank entries: (rank, entry) -> element values; a target's rows split as torch.chunk.
  std::map<std::pair<uint32_t, size_t>, std::vector<uint16_t>> entries;
  std::vector<TensorLocation> layout;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> tensors = {
      {"norm", {5}}, {"gate_up", {3, 4, 5}}, {"q", {2, 5}}, {"kv", {4, 5}}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, shape] = tensors[i];
    uint64_t numel = 1;
    for (uint64_t d : shape) numel *= d;
    const uint64_t row = numel / shape[0], rows0 = (shape[0] + 1) / 2;
    TensorLocation loc{name, DType::kBF16, shape, numel * 2, {}};
    std::vector<uint16_t> values(numel);
    const ConversionTarget* t = c.Find(name);
    for (uint64_t e = 0; e < numel; ++e) {
      if (t) {
        auto [k, ke] = Naive(t->expr, Unravel(e, shape));
        values[e] = id(k, ke);
      } else {
        values[e] = id(name, e);
      }
    }
    entries[{0, i}].assign(values.begin(), values.begin() + rows0 * row);
    entries[{1, i}].assign(values.begin() + rows0 * row, values.end());
    loc.pieces.push_back({0, i, 0, 0, rows0 * row * 2});
    if (rows0 < shape[0]) loc.pieces.push_back({1, i, 0, rows0 * row * 2, (shape[0] - rows0) * row * 2});
    layout.push_back(loc);
  }
  const std::vector<TensorLocation> hub = HubNameLocations(layout, c, "m.json");
  std::vector<std::string> names;
  for (const auto& l : hub) names.push_back(l.name);
  EXPECT_EQ(names, (std::vector<std::string>{"norm", "e0.w1", "e1.w1", "e2.w1", "e0.w3", "e1.w3", "e2.w3", "qkv"}));
  for (const TensorLocation& l : hub) {
    uint64_t numel = 1;
    for (uint64_t d : l.shape) numel *= d;
    ASSERT_EQ(l.nbytes, numel * 2) << l.name;
    std::vector<uint16_t> got(numel, 0xffff);
    uint64_t at = 0;
    for (const TensorPiece& p : l.pieces) {
      ASSERT_EQ(p.dst_offset, at) << l.name << ": pieces tile the key in order";
      ASSERT_EQ(p.src_offset % 2, 0u);
      const auto& src = entries.at({p.rank, p.entry});
      ASSERT_LE(p.src_offset + p.length, src.size() * 2) << l.name;
      for (uint64_t b = 0; b < p.length / 2; ++b) got[p.dst_offset / 2 + b] = src[p.src_offset / 2 + b];
      at += p.length;
    }
    ASSERT_EQ(at, l.nbytes) << l.name;
    for (uint64_t e = 0; e < numel; ++e) ASSERT_EQ(got[e], id(l.name, e)) << l.name << " element " << e;
  }

  // A key the layout does not hold completely is refused, naming it.
  std::vector<TensorLocation> partial = {layout[0], layout[1], layout[2]};  // no "kv"
  EXPECT_TRUE(ThrowsError([&] { HubNameLocations(partial, c, "m.json"); }, ErrorCode::kMismatch,
                          {"qkv", "m.json"}));
}

TEST(Conversion, ParserRefusesShapesThatDoNotFit) {
  EXPECT_TRUE(ThrowsError(
      [] {
        ParseModelManifest(Manifest(R"([{"name": "a", "shape": [2, 4], "expr": {"op": "stack", "dim": 0,
          "of": [)" + Key("x", "[4]") + "," + Key("y", "[5]") + "]}}]"),
                           "m.json");
      },
      ErrorCode::kDataLoss, {"m.json", "conversion.targets[0].expr.of[1]", "shape [5]"}));
  EXPECT_TRUE(ThrowsError(
      [] {
        ParseModelManifest(Manifest(R"([{"name": "a", "shape": [9], "expr": )" + Key("x", "[4]") + "}]"),
                           "m.json");
      },
      ErrorCode::kDataLoss, {"conversion.targets[0].shape", "found [9]", "[4]"}));
  EXPECT_TRUE(ThrowsError(
      [] {
        ParseModelManifest(Manifest(R"([{"name": "a", "shape": [4], "expr": {"op": "transpose", "dim": 0,
          "of": [)" + Key("x", "[4]") + "]}}]"),
                           "m.json");
      },
      ErrorCode::kDataLoss, {"expr.op", "\"transpose\"", "one of key, stack, cat, slice"}));
}

TEST(Conversion, ModelViewNamesAMissingOrChangedKey) {
  const ModelManifest m = ParseModelManifest(
      Manifest(R"([{"name": "lm_head.weight", "shape": [2, 3], "expr": )" + Key("embed_out.weight", "[2, 3]") + "}]"),
      "OUT/reshard-model.json");
  Checkpoint ckpt;
  ckpt.dir = "SRC";
  SourceTensor other{"model.norm.weight", DType::kBF16, {3}, 0, 0, 6};
  ckpt.tensors = {other};
  EXPECT_TRUE(ThrowsError([&] { ModelView(ckpt, *m.conversion, "OUT/reshard-model.json"); },
                          ErrorCode::kMismatch,
                          {"SRC: no tensor \"embed_out.weight\"", "lm_head.weight", "model_manifest"}));
  ckpt.tensors = {SourceTensor{"embed_out.weight", DType::kBF16, {3, 2}, 0, 0, 12}, other};
  EXPECT_TRUE(ThrowsError([&] { ModelView(ckpt, *m.conversion, "OUT/reshard-model.json"); },
                          ErrorCode::kMismatch, {"\"embed_out.weight\" is BF16 [3, 2]", "expects BF16 [2, 3]"}));
  ckpt.tensors = {SourceTensor{"embed_out.weight", DType::kBF16, {2, 3}, 0, 64, 12}, other};
  const Checkpoint view = ModelView(ckpt, *m.conversion, "OUT/reshard-model.json");
  ASSERT_EQ(view.tensors.size(), 2u);
  EXPECT_EQ(view.tensors[0].name, "lm_head.weight");
  EXPECT_EQ(view.tensors[0].offset, 64u);
  EXPECT_EQ(view.tensors[1].name, "model.norm.weight");
}

std::string Fp8Target(const std::string& name, uint64_t rows, uint64_t cols, uint64_t bm, uint64_t bn,
                      const std::string& scale_shape) {
  return R"({"name": ")" + name + R"(", "shape": [)" + std::to_string(rows) + ", " + std::to_string(cols) +
         R"(], "expr": {"op": "dequant_fp8", "block": [)" + std::to_string(bm) + ", " + std::to_string(bn) +
         R"(], "dtype": "BF16", "of": [{"op": "key", "key": ")" + name + R"(", "dtype": "F8_E4M3", "shape": [)" +
         std::to_string(rows) + ", " + std::to_string(cols) + R"(]}, {"op": "key", "key": ")" + name +
         R"(_scale_inv", "dtype": "F32", "shape": )" + scale_shape + "}]}}";
}

TEST(Conversion, F8E4M3DecodesEveryByteExactly) {
  for (int b = 0; b < 256; ++b) {
    const uint32_t bits = F8E4M3BitsToF32(static_cast<uint8_t>(b));
    float got;
    std::memcpy(&got, &bits, 4);
    const int e = (b >> 3) & 15, m = b & 7;
    const double sign = (b & 0x80) ? -1.0 : 1.0;
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(got)) << b;
      EXPECT_EQ(bits, ((b & 0x80) ? 0xFFF00000u : 0x7FF00000u)) << b;  // torch's NaN
      continue;
    }
    const double want = sign * (e ? std::ldexp(8 + m, e - 10) : std::ldexp(m, -9));
    EXPECT_EQ(static_cast<double>(got), want) << b;
  }
}

// A [200, 70] FP8 weight in 128 x 64 blocks (scale [2, 2]): every element range (rows cut
// inside a block, as FSDP cuts them) filled by FillEntry equals float32(w) * scale rounded
// to bf16, and reads only the weight's elements and the scale rows those rows use.
TEST(Conversion, DequantFp8FillsAnyRangeAsFloat32ProductRoundedOnce) {
  const uint64_t rows = 200, cols = 70;
  const ModelManifest m = ParseModelManifest(Manifest("[" + Fp8Target("w", rows, cols, 128, 64, "[2, 2]") + "]"),
                                             "m.json");
  std::vector<uint8_t> w(rows * cols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  const float scales[4] = {0.0123f, 3.5e-5f, 7.25f, 1.0f / 3.0f};
  std::vector<char> file(w.size() + 16);
  std::memcpy(file.data(), w.data(), w.size());
  std::memcpy(file.data() + w.size(), scales, 16);
  Checkpoint ckpt;
  ckpt.dir = "SRC";
  ckpt.tensors = {SourceTensor{"w", DType::kF8_E4M3, {rows, cols}, 0, 0, w.size()},
                  SourceTensor{"w_scale_inv", DType::kF32, {2, 2}, 0, w.size(), 16}};
  const Checkpoint view = ModelView(ckpt, *m.conversion, "m.json");
  ASSERT_EQ(view.tensors.size(), 1u);
  EXPECT_EQ(view.tensors[0].dtype, DType::kBF16);
  const SourceLookup find = [&](std::string_view n) { return ckpt.Find(n); };
  uint64_t scale_bytes_read = 0;
  const SourceRead read = [&](size_t, uint64_t at, size_t n, void* dst) {
    ASSERT_LE(at + n, file.size());
    if (at >= w.size()) scale_bytes_read += n;
    std::memcpy(dst, file.data() + at, n);
  };
  for (const auto& [r0, r1] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 200}, {67, 134}, {100, 130}, {130, 200}}) {
    EntryMap map;
    map.name = "w";
    map.dtype = DType::kBF16;
    map.numel = (r1 - r0) * cols;
    map.nbytes = map.numel * 2;
    EntrySegment whole;  // FSDP2's rows [r0, r1) of the model tensor "w"
    whole.count = map.numel;
    whole.source = "w";
    whole.source_shape = {rows, cols};
    whole.source_element = r0 * cols;
    map.segments.push_back(whole);
    ExpandConversion(map, *m.conversion);
    ASSERT_EQ(map.segments.size(), 1u);
    ASSERT_EQ(map.segments[0].kind, EntrySegment::Kind::kDequantFp8);
    ASSERT_EQ(CheckSources(map, find), "");
    // Bytes [10, nbytes - 6): a range starting and ending inside rows.
    const uint64_t begin = 10, length = map.nbytes - 16;
    std::vector<char> out(length), scratch;
    scale_bytes_read = 0;
    FillEntry(map, find, read, begin, length, out.data(), scratch);
    const bool one_block_row = r0 / 128 == (r1 - 1) / 128;
    EXPECT_EQ(scale_bytes_read, one_block_row ? 8u : 16u) << r0;
    for (uint64_t k = 0; k < length / 2; ++k) {
      const uint64_t g = r0 * cols + begin / 2 + k, i = g / cols, j = g % cols;
      const uint32_t qb = F8E4M3BitsToF32(w[g]);
      float q;
      std::memcpy(&q, &qb, 4);
      const float prod = q * scales[(i / 128) * 2 + j / 64];
      uint32_t pb;
      std::memcpy(&pb, &prod, 4);
      uint16_t got;
      std::memcpy(&got, out.data() + 2 * k, 2);
      ASSERT_EQ(got, F32BitsToBF16(pb)) << "row " << i << " col " << j;
    }
  }
}

TEST(Conversion, DequantFp8RefusesAScaleGridThatIsNotTheWeightsBlocks) {
  EXPECT_TRUE(ThrowsError(
      [] { ParseModelManifest(Manifest("[" + Fp8Target("w", 200, 70, 128, 64, "[1, 2]") + "]"), "m.json"); },
      ErrorCode::kDataLoss, {"m.json", "expr.of[1].shape", "found [1, 2]", "[2, 2] (the weight's blocks)"}));
}

std::string Mxfp4Target(const std::string& name, uint64_t e, uint64_t n, uint64_t g, const std::string& scale_shape) {
  return R"({"name": ")" + name + R"(", "shape": [)" + std::to_string(e) + ", " + std::to_string(g * 32) + ", " +
         std::to_string(n) + R"(], "expr": {"op": "dequant_mxfp4", "dtype": "BF16", "of": [{"op": "key", "key": ")" +
         name + R"(_blocks", "dtype": "U8", "shape": [)" + std::to_string(e) + ", " + std::to_string(n) + ", " +
         std::to_string(g) + R"(, 16]}, {"op": "key", "key": ")" + name + R"(_scales", "dtype": "U8", "shape": )" +
         scale_shape + "}]}}";
}

// gpt-oss experts [E=3, N=5 rows, G=2 blocks of 32]: every byte range FillEntry fills (ranges
// inside an expert, across experts, FSDP2's rows of dim 0) equals an index-math decoding of the
// transposed [E, 64, 5] result (FP4 code × 2^(scale − 127) in float32, one rounding to bf16),
// every scale byte 0-255 included; stored as F32 the same values widened exactly.
TEST(Conversion, DequantMxfp4FillsAnyRangeAsTransformersDecodes) {
  const uint64_t E = 3, N = 5, G = 2, K = G * 32;
  const ModelManifest m = ParseModelManifest(Manifest("[" + Mxfp4Target("x", E, N, G, "[3, 5, 2]") + "]"), "m.json");
  std::vector<uint8_t> blocks(E * N * G * 16), scales(E * N * G);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<uint8_t>((i * 91 + 7) % 256);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<uint8_t>(i * 255 / (scales.size() - 1));
  std::vector<char> file(blocks.size() + scales.size());
  std::memcpy(file.data(), blocks.data(), blocks.size());
  std::memcpy(file.data() + blocks.size(), scales.data(), scales.size());
  Checkpoint ckpt;
  ckpt.dir = "SRC";
  ckpt.tensors = {SourceTensor{"x_blocks", DType::kU8, {E, N, G, 16}, 0, 0, blocks.size()},
                  SourceTensor{"x_scales", DType::kU8, {E, N, G}, 0, blocks.size(), scales.size()}};
  const Checkpoint view = ModelView(ckpt, *m.conversion, "m.json");
  ASSERT_EQ(view.tensors.size(), 1u);
  EXPECT_EQ(view.tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(view.tensors[0].shape, (std::vector<uint64_t>{E, K, N}));
  const SourceLookup find = [&](std::string_view n) { return ckpt.Find(n); };
  const SourceRead read = [&](size_t, uint64_t at, size_t n, void* dst) {
    ASSERT_LE(at + n, file.size());
    std::memcpy(dst, file.data() + at, n);
  };
  const float fp4[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  auto want = [&](uint64_t o) {  // element o of [E, K, N]
    const uint64_t e = o / (K * N), k = (o / N) % K, r = o % N;
    const uint64_t b = (e * N + r) * G + k / 32, j = k % 32;
    const uint8_t byte = blocks[b * 16 + j / 2];
    const float v = fp4[(j & 1) ? byte >> 4 : byte & 15] * std::ldexp(1.0f, scales[b] - 127);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return F32BitsToBF16(bits);
  };
  for (const DType stored : {DType::kBF16, DType::kF32}) {
    const uint64_t item = stored == DType::kBF16 ? 2 : 4;
    for (const auto& [r0, r1] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 3}, {1, 2}, {2, 3}, {0, 1}}) {
      EntryMap map;
      map.name = "x";
      map.dtype = stored;
      map.numel = (r1 - r0) * K * N;
      map.nbytes = map.numel * item;
      EntrySegment rows;  // FSDP2's experts [r0, r1)
      rows.count = map.numel;
      rows.source = "x";
      rows.source_shape = {E, K, N};
      rows.source_element = r0 * K * N;
      map.segments.push_back(rows);
      ExpandConversion(map, *m.conversion);
      ASSERT_EQ(map.segments.size(), 1u);
      ASSERT_EQ(map.segments[0].kind, EntrySegment::Kind::kDequantMxfp4);
      ASSERT_EQ(CheckSources(map, find), "");
      for (const auto& [begin, end] : std::vector<std::pair<uint64_t, uint64_t>>{
               {0, map.numel}, {7, 301}, {K * N - 3, K * N + 11}, {map.numel - 1, map.numel}}) {
        if (end > map.numel || begin >= end) continue;
        std::vector<char> out((end - begin) * item), scratch;
        FillEntry(map, find, read, begin * item, out.size(), out.data(), scratch);
        for (uint64_t i = 0; i < end - begin; ++i) {
          const uint16_t w = want(r0 * K * N + begin + i);
          if (stored == DType::kBF16) {
            uint16_t got;
            std::memcpy(&got, out.data() + 2 * i, 2);
            ASSERT_EQ(got, w) << "element " << r0 * K * N + begin + i;
          } else {
            uint32_t got;
            std::memcpy(&got, out.data() + 4 * i, 4);
            if ((w & 0x7F80) == 0x7F80 && (w & 0x7F)) {
              ASSERT_EQ(got & 0x7F800000u, 0x7F800000u) << "NaN stays NaN";
            } else {
              ASSERT_EQ(got, static_cast<uint32_t>(w) << 16) << "element " << r0 * K * N + begin + i;
            }
          }
        }
      }
    }
  }
  EntryMap f16;
  f16.name = "x";
  f16.dtype = DType::kF16;
  f16.segments.push_back(EntrySegment{});
  f16.segments[0].count = 1, f16.segments[0].source = "x", f16.segments[0].source_shape = {E, K, N};
  ExpandConversion(f16, *m.conversion);
  EXPECT_NE(CheckSources(f16, find).find("round them again"), std::string::npos);
}

TEST(Conversion, DequantMxfp4ParserRefusesShapesThatDoNotFit) {
  EXPECT_TRUE(ThrowsError(
      [] { ParseModelManifest(Manifest("[" + Mxfp4Target("x", 3, 5, 2, "[3, 5]") + "]"), "m.json"); },
      ErrorCode::kDataLoss, {"m.json", "expr.of[1].shape", "found [3, 5]", "[3, 5, 2]"}));
  std::string bad = Mxfp4Target("x", 3, 5, 2, "[3, 5, 2]");
  bad.replace(bad.find(", 16]}"), 6, ", 8]}");
  EXPECT_TRUE(ThrowsError([&] { ParseModelManifest(Manifest("[" + bad + "]"), "m.json"); },
                          ErrorCode::kDataLoss, {"expr.of[0].shape", "[experts, rows, blocks, 16]"}));
}

TEST(Conversion, ModelViewRefusesAnFp8WeightWithoutItsScale) {
  const std::string conv = Manifest("[" + Fp8Target("a.weight", 4, 4, 128, 128, "[1, 1]") + "]");
  std::string keep = conv;
  keep.insert(keep.size() - 2, R"(, "quantization": {"method": "fp8", "policy": "keep", "weight_block_size": [128, 128]})");
  std::string deq = conv;
  deq.insert(deq.size() - 2, R"(, "quantization": {"method": "fp8", "policy": "dequantize", "weight_block_size": [128, 128]})");
  Checkpoint ckpt;
  ckpt.dir = "SRC";
  ckpt.tensors = {SourceTensor{"a.weight", DType::kF8_E4M3, {4, 4}, 0, 0, 16},
                  SourceTensor{"a.weight_scale_inv", DType::kF32, {1, 1}, 0, 16, 4},
                  SourceTensor{"b.weight", DType::kF8_E4M3, {4, 4}, 0, 32, 16}};
  const ModelManifest d = ParseModelManifest(deq, "m.json");
  EXPECT_TRUE(ThrowsError([&] { ModelView(ckpt, *d.conversion, "m.json"); }, ErrorCode::kUnsupported,
                          {"SRC: F8_E4M3 tensor \"b.weight\" is not dequantized", "no scale \"b.weight_scale_inv\"",
                           "never stored without its scale"}));
  ParseModelManifest(keep, "m.json");  // parses; its checkpoint check follows
  ModelManifest k = ParseModelManifest(keep, "m.json");
  k.conversion->targets.clear();
  EXPECT_TRUE(ThrowsError([&] { ModelView(ckpt, *k.conversion, "m.json"); }, ErrorCode::kUnsupported,
                          {"\"b.weight\" has no scale \"b.weight_scale_inv\""}));
  ckpt.tensors.pop_back();
  ckpt.tensors.push_back(SourceTensor{"c.weight_scale_inv", DType::kF32, {1, 1}, 0, 48, 4});
  EXPECT_TRUE(ThrowsError([&] { ModelView(ckpt, *k.conversion, "m.json"); }, ErrorCode::kUnsupported,
                          {"scale \"c.weight_scale_inv\" has no F8_E4M3 weight"}));
}

}  // namespace
}  // namespace reshard
