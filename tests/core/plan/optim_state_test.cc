// The optimizer-state byte map (reshard/plan/optim_state.h): whole state tensors in memory are
// planned for a layout (PlanOptimizerRank, filled by FillEntry), the planned rank entries are
// described back (DescribeOptimizerTensors) and reassembled: every element must come back, at
// every world size, for FSDP2 state, FSDP1 flat-shard state and FSDP1 use_orig_params state.
// Hand-computed entries pin the layout itself (which elements a rank holds, zero padding).
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/error.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/optim_state.h"

namespace reshard {
namespace {

using test::ThrowsError;

// Whole state tensors laid out in one in-memory "file", as a virtual checkpoint.
struct State {
  std::vector<char> file;
  Checkpoint view;

  void Add(const std::string& name, std::vector<uint64_t> shape, const std::vector<float>& v) {
    SourceTensor t;
    t.name = name;
    t.dtype = DType::kF32;
    t.shape = std::move(shape);
    t.offset = file.size();
    t.nbytes = v.size() * sizeof(float);
    file.insert(file.end(), reinterpret_cast<const char*>(v.data()),
                reinterpret_cast<const char*>(v.data()) + t.nbytes);
    view.tensors.push_back(t);
    std::sort(view.tensors.begin(), view.tensors.end(),
              [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  }
  SourceLookup Lookup() const {
    return [this](std::string_view n) { return view.Find(n); };
  }
  SourceRead Read() const {
    return [this](size_t, uint64_t at, size_t n, void* dst) { std::memcpy(dst, file.data() + at, n); };
  }
  std::vector<float> Values(const std::string& name) const {
    const SourceTensor* t = view.Find(name);
    std::vector<float> v(t->nbytes / 4);
    std::memcpy(v.data(), file.data() + t->offset, t->nbytes);
    return v;
  }
};

// One unit ("u") of two parameters: a [3, 2] at flat offset 0, b [5] at flat offset 7 (one
// element of alignment padding between), 12 elements in all.
std::shared_ptr<FlatInfo> Unit() {
  auto f = std::make_shared<FlatInfo>();
  f->unit = "u";
  f->numel = 12;
  f->params = {{"a", "u.a", {3, 2}, 6, 0}, {"b", "u.b", {5}, 5, 7}};
  return f;
}

RankFileHeader ModelRank(LayoutKind kind, uint32_t world, uint32_t rank, bool orig) {
  RankFileHeader h;
  h.kind = kind;
  h.world_size = world;
  h.rank = rank;
  h.use_orig_params = orig;
  h.layout_key = "test";
  if (kind == LayoutKind::kFsdp1) {
    TensorEntry e;
    e.name = "u._flat_param";
    e.dtype = DType::kF32;
    e.flat = Unit();
    const uint64_t c = (e.flat->numel + world - 1) / world;
    e.global_shape = {e.flat->numel};
    e.sharded = true;
    e.rows = {std::min<uint64_t>(rank * c, e.flat->numel), std::min<uint64_t>((rank + 1) * c, e.flat->numel)};
    e.local_shape = {c};
    e.nbytes = c * 4;
    h.tensors.push_back(e);
  }
  return h;
}

State Original(bool flat_step) {
  State s;
  s.Add("u.a#exp_avg", {3, 2}, {1, 2, 3, 4, 5, 6});
  s.Add("u.b#exp_avg", {5}, {10, 11, 12, 13, 14});
  s.Add(flat_step ? "u._flat_param#step" : "u.a#step", {}, {7});
  if (!flat_step) s.Add("u.b#step", {}, {7});
  return s;
}

struct Planned {
  std::vector<RankFileHeader> headers;
  std::vector<std::vector<std::vector<char>>> bytes;  // [rank][entry]
};

// Every rank of `world` planned over `s` and filled.
Planned PlanAll(const State& s, LayoutKind kind, uint32_t world, bool orig) {
  Planned p;
  LayoutSpec layout;
  layout.kind = kind;
  layout.world_size = world;
  layout.use_orig_params = orig;
  for (uint32_t r = 0; r < world; ++r) {
    const RankFileHeader model = ModelRank(kind, world, r, orig);
    RankFileHeader h = model;
    h.tensors.clear();
    std::vector<std::vector<char>> entries;
    std::vector<char> scratch;
    for (const PlannedState& st : PlanOptimizerRank(s.view, layout, r, model, "rank " + std::to_string(r))) {
      EXPECT_EQ(CheckSources(st.map, s.Lookup()), "") << st.entry.name;
      std::vector<char> buf(st.entry.nbytes, 'x');
      FillEntry(st.map, s.Lookup(), s.Read(), 0, buf.size(), buf.data(), scratch);
      h.tensors.push_back(st.entry);
      entries.push_back(std::move(buf));
    }
    p.headers.push_back(std::move(h));
    p.bytes.push_back(std::move(entries));
  }
  return p;
}

std::vector<float> Floats(const std::vector<char>& b) {
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Plan at every world size, describe back, reassemble: the original state, element for element.
void RoundTrip(LayoutKind kind, bool orig) {
  const State s = Original(kind == LayoutKind::kFsdp1 && !orig);
  for (uint32_t world : {1u, 2u, 3u, 4u, 5u, 12u, 13u}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    const Planned p = PlanAll(s, kind, world, orig);
    std::vector<const RankFileHeader*> headers;
    std::vector<std::string> paths;
    for (const auto& h : p.headers) {
      headers.push_back(&h);
      paths.push_back("rank " + std::to_string(h.rank));
    }
    const RankFileHeader model0 = ModelRank(kind, world, 0, orig);
    const std::vector<TensorLocation> locs = DescribeOptimizerTensors(model0, headers, paths);
    ASSERT_EQ(locs.size(), s.view.tensors.size());
    for (const TensorLocation& l : locs) {
      const SourceTensor* t = s.view.Find(l.name);
      ASSERT_NE(t, nullptr) << l.name;
      EXPECT_EQ(l.shape, t->shape) << l.name;
      std::vector<char> full(l.nbytes, 'y');
      for (const TensorPiece& piece : l.pieces) {
        std::memcpy(full.data() + piece.dst_offset, p.bytes[piece.rank][piece.entry].data() + piece.src_offset,
                    piece.length);
      }
      EXPECT_EQ(Floats(full), s.Values(l.name)) << l.name;
    }
  }
}

TEST(OptimState, Fsdp2RoundTrip) { RoundTrip(LayoutKind::kFsdp2, false); }
TEST(OptimState, Fsdp1FlatShardRoundTrip) { RoundTrip(LayoutKind::kFsdp1, false); }
TEST(OptimState, Fsdp1OrigParamsRoundTrip) { RoundTrip(LayoutKind::kFsdp1, true); }

TEST(OptimState, Fsdp1FlatShardEntries) {
  // World size 3: c = 4. Rank 1 holds flat [4, 8): a's elements 4, 5, padding (zero in
  // state, not FSDP's 42), b's element 0; rank 2 holds [8, 12): b's elements 1-4.
  const State s = Original(true);
  const Planned p = PlanAll(s, LayoutKind::kFsdp1, 3, false);
  ASSERT_EQ(p.headers[1].tensors.size(), 2u);
  const TensorEntry& e = p.headers[1].tensors[0];
  EXPECT_EQ(e.name, "u._flat_param#exp_avg");
  EXPECT_FALSE(e.sharded);
  EXPECT_EQ(e.global_shape, std::vector<uint64_t>{4});
  EXPECT_EQ(e.local_shape, std::vector<uint64_t>{4});
  EXPECT_EQ(Floats(p.bytes[1][0]), (std::vector<float>{5, 6, 0, 10}));
  EXPECT_EQ(Floats(p.bytes[2][0]), (std::vector<float>{11, 12, 13, 14}));
  EXPECT_EQ(p.headers[1].tensors[1].name, "u._flat_param#step");
  EXPECT_EQ(Floats(p.bytes[1][1]), std::vector<float>{7});
}

TEST(OptimState, Fsdp1OrigParamsEntries) {
  // World size 3, use_orig_params: rank 1 holds a's elements 4, 5 and b's element 0, each as
  // its own 1-D state; rank 0 has no state of b (none of its elements).
  const State s = Original(false);
  const Planned p = PlanAll(s, LayoutKind::kFsdp1, 3, true);
  std::map<std::string, std::vector<float>> r1, r0;
  for (size_t i = 0; i < p.headers[1].tensors.size(); ++i) r1[p.headers[1].tensors[i].name] = Floats(p.bytes[1][i]);
  for (size_t i = 0; i < p.headers[0].tensors.size(); ++i) r0[p.headers[0].tensors[i].name] = Floats(p.bytes[0][i]);
  EXPECT_EQ(r1["u.a#exp_avg"], (std::vector<float>{5, 6}));
  EXPECT_EQ(r1["u.b#exp_avg"], (std::vector<float>{10}));
  EXPECT_EQ(r1["u.b#step"], (std::vector<float>{7}));
  EXPECT_EQ(r0.count("u.b#exp_avg"), 0u);
  EXPECT_EQ(r0["u.a#exp_avg"], (std::vector<float>{1, 2, 3, 4}));
}

TEST(OptimState, RefusesStateThatDoesNotFit) {
  const State s = Original(false);
  Planned p = PlanAll(s, LayoutKind::kFsdp1, 2, true);
  // Rank 1's view of a claims one element more than a has in its shard.
  for (TensorEntry& e : p.headers[1].tensors) {
    if (e.name == "u.b#exp_avg") e.nbytes += 4, e.global_shape[0] += 1, e.local_shape[0] += 1;
  }
  std::vector<const RankFileHeader*> headers{&p.headers[0], &p.headers[1]};
  const RankFileHeader model0 = ModelRank(LayoutKind::kFsdp1, 2, 0, true);
  EXPECT_TRUE(ThrowsError([&] { DescribeOptimizerTensors(model0, headers, {"r0", "r1"}); }, ErrorCode::kMismatch,
                          {"r1: tensor \"u.b#exp_avg\": local state of 6 elements, expected 5"}));
  // State of a parameter the model does not have.
  p = PlanAll(s, LayoutKind::kFsdp1, 2, true);
  p.headers[0].tensors[0].name = "u.c#exp_avg";
  headers = {&p.headers[0], &p.headers[1]};
  EXPECT_TRUE(ThrowsError([&] { DescribeOptimizerTensors(model0, headers, {"r0", "r1"}); }, ErrorCode::kMismatch,
                          {"neither a unit's flat parameter nor an original parameter"}));
  // A flat parameter's state missing one of its parameters.
  State partial;
  partial.Add("u.a#exp_avg", {3, 2}, {1, 2, 3, 4, 5, 6});
  LayoutSpec layout;
  layout.kind = LayoutKind::kFsdp1;
  layout.world_size = 2;
  EXPECT_TRUE(ThrowsError(
      [&] { PlanOptimizerRank(partial.view, layout, 0, ModelRank(LayoutKind::kFsdp1, 2, 0, false), "f"); },
      ErrorCode::kMismatch, {"parameter u.b has no optimizer state \"exp_avg\""}));
}

// DTensor layouts (reshard relayout --mesh): state placed exactly as its parameter's entry in
// the model rank file, 0-dim state Replicate everywhere. Mesh dp_shard=2,tp=2: a [5, 3] is
// S(0) over dp_shard and S(1) over tp (distribute_tensor order), b [5] fully_shard'ed over
// dp_shard (fsdp mesh dim 0) and replicated over tp.
MeshSpec Mesh22() {
  MeshSpec m;
  m.names = {"dp_shard", "tp"};
  m.shape = {2, 2};
  return m;
}

RankFileHeader DTensorModelRank(uint32_t rank) {
  RankFileHeader h;
  h.kind = LayoutKind::kDTensor;
  h.mesh = Mesh22();
  h.world_size = 4;
  h.rank = rank;
  h.layout_key = "test";
  auto entry = [&](const std::string& name, std::vector<uint64_t> shape, std::vector<Placement> pl, int fsdp) {
    TensorEntry e;
    e.name = name;
    e.dtype = DType::kF32;
    e.global_shape = shape;
    DTensorSharding d;
    d.placements = std::move(pl);
    d.fsdp_mesh_dim = fsdp;
    d.mesh_shape = h.mesh.shape;
    e.local_shape = DTensorLocalShape(shape, d, h.mesh.shape, h.mesh.Coordinate(rank), name);
    e.dtensor = d;
    h.tensors.push_back(e);
  };
  entry("a", {5, 3}, {Placement::Shard(0), Placement::Shard(1)}, -1);
  entry("b", {5}, {Placement::Shard(0), Placement::Replicate()}, 0);
  return h;
}

TEST(OptimState, DTensorStatePlacedLikeItsParameter) {
  State s;
  std::vector<float> a(15);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  s.Add("a#exp_avg", {5, 3}, a);
  s.Add("b#exp_avg", {5}, {10, 11, 12, 13, 14});
  s.Add("a#step", {}, {7});
  LayoutSpec layout;
  layout.kind = LayoutKind::kDTensor;
  layout.mesh = Mesh22();
  layout.world_size = 4;
  std::vector<RankFileHeader> headers;
  std::vector<std::vector<std::vector<char>>> bytes;
  for (uint32_t r = 0; r < 4; ++r) {
    const RankFileHeader model = DTensorModelRank(r);
    RankFileHeader h = model;
    h.tensors.clear();
    std::vector<std::vector<char>> entries;
    std::vector<char> scratch;
    for (const PlannedState& st : PlanOptimizerRank(s.view, layout, r, model, "rank " + std::to_string(r))) {
      const TensorEntry* m = nullptr;
      for (const TensorEntry& e : model.tensors) {
        if (e.name == st.param) m = &e;
      }
      if (st.entry.global_shape.empty()) {
        EXPECT_EQ(st.kind, "whole");
        EXPECT_EQ(st.entry.dtensor->placements, (std::vector<Placement>{Placement::Replicate(), Placement::Replicate()}));
        EXPECT_EQ(st.entry.dtensor->fsdp_mesh_dim, -1);
      } else {
        ASSERT_NE(m, nullptr) << st.entry.name;
        EXPECT_EQ(st.kind, "sharded");
        EXPECT_EQ(st.entry.dtensor->placements, m->dtensor->placements) << st.entry.name;
        EXPECT_EQ(st.entry.dtensor->fsdp_mesh_dim, m->dtensor->fsdp_mesh_dim) << st.entry.name;
        EXPECT_EQ(st.entry.local_shape, m->local_shape) << st.entry.name;
      }
      EXPECT_EQ(CheckSources(st.map, s.Lookup()), "") << st.entry.name;
      std::vector<char> buf(st.entry.nbytes, 'x');
      FillEntry(st.map, s.Lookup(), s.Read(), 0, buf.size(), buf.data(), scratch);
      h.tensors.push_back(st.entry);
      entries.push_back(std::move(buf));
    }
    headers.push_back(std::move(h));
    bytes.push_back(std::move(entries));
  }
  // Rank 3 = coordinate (1, 1): rows [3, 5) of a, column 2; b's elements [3, 5).
  std::map<std::string, std::vector<float>> r3;
  for (size_t i = 0; i < headers[3].tensors.size(); ++i) r3[headers[3].tensors[i].name] = Floats(bytes[3][i]);
  EXPECT_EQ(r3["a#exp_avg"], (std::vector<float>{11, 14}));
  EXPECT_EQ(r3["b#exp_avg"], (std::vector<float>{13, 14}));
  EXPECT_EQ(r3["a#step"], std::vector<float>{7});
  // Described back (as relayout reads a DTensor source): every element, once.
  std::vector<const RankFileHeader*> hp;
  std::vector<std::string> paths;
  for (const auto& h : headers) hp.push_back(&h), paths.push_back("rank " + std::to_string(h.rank));
  const std::vector<TensorLocation> locs = DescribeOptimizerTensors(DTensorModelRank(0), hp, paths);
  ASSERT_EQ(locs.size(), 3u);
  for (const TensorLocation& l : locs) {
    std::vector<char> full(l.nbytes, 'y');
    for (const TensorPiece& piece : l.pieces) {
      std::memcpy(full.data() + piece.dst_offset, bytes[piece.rank][piece.entry].data() + piece.src_offset,
                  piece.length);
    }
    EXPECT_EQ(Floats(full), s.Values(l.name)) << l.name;
  }
  // State not shaped like its parameter, or of no parameter of the model rank file: refused.
  State odd;
  odd.Add("b#exp_avg", {4}, {1, 2, 3, 4});
  EXPECT_TRUE(ThrowsError([&] { PlanOptimizerRank(odd.view, layout, 0, DTensorModelRank(0), "f"); },
                          ErrorCode::kMismatch, {"f: optimizer state \"b#exp_avg\": shape [4], its parameter's [5]"}));
  State stray;
  stray.Add("c#exp_avg", {5}, {1, 2, 3, 4, 5});
  EXPECT_TRUE(ThrowsError([&] { PlanOptimizerRank(stray.view, layout, 0, DTensorModelRank(0), "f"); },
                          ErrorCode::kMismatch, {"its parameter \"c\" is no tensor of the model rank file"}));
}

}  // namespace
}  // namespace reshard
