// FSDP1 flat layouts: the wrap/flatten planner against hand-computed layouts (fsdp-layouts
// R14–R19, including the R17 worked example), convert → rank file bytes against a flat
// parameter assembled by the test, verify, and refusals. Real FSDP1 is the reference in
// tests/python/test_fsdp1.py; here the arithmetic is pinned down without torch.
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/model_manifest.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/export.h"
#include "reshard/ops/verify.h"
#include "reshard/plan/fsdp1.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::ojson;
using test::TempDir;
using test::TensorSpec;
using test::ThrowsError;

ojson Module(const std::string& name, const std::string& cls,
             std::vector<std::pair<std::string, int>> params) {
  ojson ps = ojson::array();
  for (const auto& [local, i] : params) ps.push_back(ojson::array({local, i}));
  return {{"name", name}, {"class", cls}, {"params", ps}};
}

ojson Param(std::vector<std::string> names, std::vector<uint64_t> shape) {
  return {{"names", names}, {"shape", shape}};
}

ojson Manifest(ojson modules, ojson params, std::vector<std::string> no_split = {}) {
  return {{"format", "reshard.model"}, {"format_version", 1}, {"model_class", "Toy"},
          {"base_model_prefix", ""},   {"no_split_modules", no_split}, {"modules", modules},
          {"params", params},          {"buffers", ojson::array()}};
}

// One unit (the root) with parameters of 21, 12, 4 and 24 elements: R17's example.
struct R17 {
  TempDir dir;
  std::vector<TensorSpec> tensors = {
      test::MakeTensor("p0", "F32", {3, 7}, 1), test::MakeTensor("p1", "F32", {12}, 2),
      test::MakeTensor("p2", "F32", {4}, 3), test::MakeTensor("p3", "F32", {4, 6}, 4)};
  fs::path src = dir / "src";
  fs::path manifest = dir / "model.json";

  R17() {
    // Registration order p0, p1, p2, p3; the checkpoint's key order is another one.
    test::WriteShardedCheckpoint(src, {{tensors[3], tensors[1]}, {tensors[0], tensors[2]}});
    ojson m = Manifest(ojson::array({Module("", "Toy", {{"p0", 0}, {"p1", 1}, {"p2", 2}, {"p3", 3}})}),
                       ojson::array({Param({"p0"}, {3, 7}), Param({"p1"}, {12}),
                                     Param({"p2"}, {4}), Param({"p3"}, {4, 6})}));
    test::WriteBytes(manifest, m.dump());
  }

  // The unsharded flat parameter by R17, assembled by the test: 42.0f padding between params
  // at the given offsets, then to `numel`.
  std::string Flat(const std::vector<uint64_t>& offsets, uint64_t numel) const {
    std::string flat;
    const float pad = 42.0f;
    for (size_t i = 0; i < tensors.size(); ++i) {
      while (flat.size() < offsets[i] * 4) flat.append(reinterpret_cast<const char*>(&pad), 4);
      flat += tensors[i].data;
    }
    while (flat.size() < numel * 4) flat.append(reinterpret_cast<const char*>(&pad), 4);
    return flat;
  }
};

std::vector<uint64_t> Offsets(const FlatInfo& f) {
  std::vector<uint64_t> v;
  for (const auto& p : f.params) v.push_back(p.offset);
  return v;
}

TEST(Fsdp1Plan, R17WorkedExample) {
  R17 t;
  Checkpoint ckpt = OpenCheckpoint(t.src);
  ModelManifest m = ReadModelManifest(t.manifest);
  LayoutSpec spec;
  spec.kind = LayoutKind::kFsdp1;
  spec.world_size = 4;

  Fsdp1Plan plain = PlanFsdp1(ckpt, m, spec);  // no use_orig_params: no padding inside
  ASSERT_EQ(plain.units.size(), 1u);
  EXPECT_EQ(Offsets(*plain.units[0]), (std::vector<uint64_t>{0, 21, 33, 37}));
  EXPECT_EQ(plain.units[0]->numel, 61u);
  EXPECT_EQ(plain.units[0]->aligned_numel, 0u);

  spec.use_orig_params = true;  // fp32: A = 4 → (21, 3, 12, 4, 24) = 64, 16 per rank
  Fsdp1Plan orig = PlanFsdp1(ckpt, m, spec);
  EXPECT_EQ(Offsets(*orig.units[0]), (std::vector<uint64_t>{0, 24, 36, 40}));
  EXPECT_EQ(orig.units[0]->numel, 64u);
  EXPECT_EQ(orig.units[0]->aligned_numel, 4u);

  spec.param_dtype = "bf16";  // A = 8 → (21, 3, 12, 4, 4, 4, 24) = 72, 18 per rank
  Fsdp1Plan bf16 = PlanFsdp1(ckpt, m, spec);
  EXPECT_EQ(Offsets(*bf16.units[0]), (std::vector<uint64_t>{0, 24, 40, 48}));
  EXPECT_EQ(bf16.units[0]->numel, 72u);
  EXPECT_EQ(bf16.units[0]->aligned_numel, 8u);

  spec.world_size = 5;  // world-size padding after the last parameter: 72 → 75
  EXPECT_EQ(PlanFsdp1(ckpt, m, spec).units[0]->numel, 75u);
}

TEST(Fsdp1Convert, RankBytesAreTheFlatParameterChunks) {
  for (bool orig : {false, true}) {
    for (uint32_t ws : {1u, 3u, 4u, 8u}) {
      R17 t;
      ConvertOptions o;
      o.source = t.src;
      o.out = t.dir / "out";
      o.model_manifest = t.manifest;
      o.layout.kind = LayoutKind::kFsdp1;
      o.layout.world_size = ws;
      o.layout.use_orig_params = orig;
      o.layout.param_dtype = orig ? "bf16" : "";
      o.chunk_size = 4096;
      ConvertResult r = Convert(o);
      ASSERT_TRUE(r.layout_complete);
      EXPECT_EQ(r.layout_key, std::string("fsdp1-ws") + std::to_string(ws) + "-nowrap" +
                                  (orig ? "-orig-pbf16" : ""));
      std::vector<uint64_t> offsets = orig ? std::vector<uint64_t>{0, 24, 40, 48}
                                           : std::vector<uint64_t>{0, 21, 33, 37};
      uint64_t numel = orig ? 72 : 61;
      if (orig) numel = (numel + ws - 1) / ws * ws;
      const std::string flat = t.Flat(offsets, numel);
      const uint64_t c = (numel + ws - 1) / ws;
      for (uint32_t rank = 0; rank < ws; ++rank) {
        auto f = test::RawRankFile::Read(r.layout_dir / RankFileName(rank, ws));
        std::string want = flat.substr(std::min<uint64_t>(flat.size(), rank * c * 4), c * 4);
        want.resize(c * 4, '\0');  // past the flat parameter: zeros (F.pad)
        EXPECT_TRUE(test::SameBytes(test::RawTensorBytes(f, "_flat_param"), want))
            << "orig " << orig << " ws " << ws << " rank " << rank;
        EXPECT_EQ(f.header["tensors"][0]["local_shape"], ojson::array({c}));
      }
      VerifyOptions vo;
      vo.path = o.out;
      vo.source = t.src;
      VerifyReport v = Verify(vo);
      EXPECT_TRUE(v.problems.empty()) << v.problems.front().message;
      EXPECT_GT(v.source_bytes_compared, 0u);
    }
  }
}

TEST(Fsdp1Plan, NestedUnitsPostOrderAndTiedParameters) {
  TempDir dir;
  std::vector<TensorSpec> ts = {
      test::MakeTensor("emb.weight", "BF16", {5, 4}, 1), test::MakeTensor("blocks.0.w", "BF16", {4, 4}, 2),
      test::MakeTensor("blocks.0.inner.v", "BF16", {3}, 3), test::MakeTensor("blocks.1.w", "BF16", {4, 4}, 4),
      test::MakeTensor("norm.weight", "BF16", {4}, 5)};
  test::WriteShardedCheckpoint(dir / "src", {ts});
  ojson modules = ojson::array({
      Module("", "Top", {}), Module("emb", "Emb", {{"weight", 0}}), Module("blocks", "ModuleList", {}),
      Module("blocks.0", "Block", {{"w", 1}}), Module("blocks.0.inner", "Leaf", {{"v", 2}}),
      Module("blocks.1", "Block", {{"w", 3}}), Module("norm", "Norm", {{"weight", 4}}),
      Module("head", "Head", {{"weight", 0}})});  // tied to emb.weight
  ojson params = ojson::array({Param({"emb.weight", "head.weight"}, {5, 4}), Param({"blocks.0.w"}, {4, 4}),
                               Param({"blocks.0.inner.v"}, {3}), Param({"blocks.1.w"}, {4, 4}),
                               Param({"norm.weight"}, {4})});
  ModelManifest m = ParseModelManifest(Manifest(modules, params, {"Block"}).dump(), "model.json");
  Checkpoint ckpt = OpenCheckpoint(dir / "src");
  LayoutSpec spec;
  spec.kind = LayoutKind::kFsdp1;
  spec.world_size = 8;
  spec.wrap = {"Block", "Leaf"};
  Fsdp1Plan plan = PlanFsdp1(ckpt, m, spec);
  ASSERT_EQ(plan.units.size(), 4u);
  EXPECT_EQ(plan.units[0]->unit, "blocks.0.inner");  // children before parents
  EXPECT_EQ(plan.units[1]->unit, "blocks.0");
  EXPECT_EQ(plan.units[2]->unit, "blocks.1");
  EXPECT_EQ(plan.units[3]->unit, "");
  EXPECT_EQ(plan.units[0]->params[0].fqn, "v");
  ASSERT_EQ(plan.units[1]->params.size(), 1u);  // inner's v belongs to the nested unit
  EXPECT_EQ(plan.units[1]->params[0].fqn, "w");
  ASSERT_EQ(plan.units[3]->params.size(), 2u);
  EXPECT_EQ(plan.units[3]->params[0].fqn, "emb.weight");
  EXPECT_EQ(plan.units[3]->params[1].fqn, "norm.weight");
  EXPECT_EQ(plan.units[3]->shared, std::vector<std::string>{"head.weight"});

  // A 3-element unit over 8 ranks: ranks 3-7 hold one zero element each (empty shards).
  ConvertOptions o;
  o.source = dir / "src";
  o.out = dir / "out";
  test::WriteBytes(dir / "model.json", Manifest(modules, params, {"Block"}).dump());
  o.model_manifest = dir / "model.json";
  o.layout = spec;
  ConvertResult r = Convert(o);
  EXPECT_EQ(r.layout_key, "fsdp1-ws8-Block.Leaf");
  for (uint32_t rank = 0; rank < 8; ++rank) {
    auto f = test::RawRankFile::Read(r.layout_dir / RankFileName(rank, 8));
    const std::string got = test::RawTensorBytes(f, "blocks.0.inner._flat_param");
    std::string want = rank < 3 ? ts[2].data.substr(rank * 2, 2) : std::string(2, '\0');
    EXPECT_TRUE(test::SameBytes(got, want)) << "rank " << rank;
  }
  VerifyOptions vo;
  vo.path = o.out;
  vo.source = o.source;
  EXPECT_TRUE(Verify(vo).problems.empty());

  // Default wrap classes: the manifest's no_split_modules.
  o.layout.wrap.clear();
  EXPECT_EQ(Convert(o).layout_key, "fsdp1-ws8-Block");
  // ... less those the model does not build (a multimodal family's vision block in its
  // text-only class), as FSDP1 wraps no module of them; an explicit --wrap of one is refused.
  test::WriteBytes(dir / "model.json", Manifest(modules, params, {"Block", "VisionBlock"}).dump());
  fs::remove_all(o.out);
  EXPECT_EQ(Convert(o).layout_key, "fsdp1-ws8-Block");
  o.layout.wrap = {"Block", "VisionBlock"};
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument, {"--wrap VisionBlock"}));
}

// A tied parameter whose names sit in two units (BERT: the decoder in the root, the word
// embeddings in their own unit). Without use_orig_params, FSDP1 over a meta-device model
// materialised unit by unit gives the root's module a parameter of its own, so the root takes a
// copy read from the same key; with use_orig_params it skips the flattened original. Observed
// with torch 2.11 (FlatParameter._fqns of BertLMHeadModel with BertEmbeddings units).
TEST(Fsdp1Plan, TiedParameterAcrossUnits) {
  TempDir dir;
  std::vector<TensorSpec> ts = {test::MakeTensor("emb.weight", "BF16", {5, 4}, 1),
                                test::MakeTensor("norm.weight", "BF16", {4}, 2)};
  test::WriteShardedCheckpoint(dir / "src", {ts});
  ojson modules = ojson::array({Module("", "Top", {}), Module("emb", "Emb", {{"weight", 0}}),
                                Module("norm", "Norm", {{"weight", 1}}),
                                Module("head", "Head", {{"weight", 0}})});  // tied to emb.weight
  ojson params = ojson::array({Param({"emb.weight", "head.weight"}, {5, 4}), Param({"norm.weight"}, {4})});
  ModelManifest m = ParseModelManifest(Manifest(modules, params, {"Emb"}).dump(), "model.json");
  Checkpoint ckpt = OpenCheckpoint(dir / "src");
  LayoutSpec spec;
  spec.kind = LayoutKind::kFsdp1;
  spec.world_size = 2;
  spec.wrap = {"Emb"};
  Fsdp1Plan plan = PlanFsdp1(ckpt, m, spec);
  ASSERT_EQ(plan.units.size(), 2u);
  EXPECT_EQ(plan.units[0]->unit, "emb");
  ASSERT_EQ(plan.units[0]->params.size(), 1u);
  ASSERT_EQ(plan.units[1]->params.size(), 2u);
  EXPECT_EQ(plan.units[1]->params[0].fqn, "norm.weight");
  EXPECT_EQ(plan.units[1]->params[1].fqn, "head.weight");
  EXPECT_EQ(plan.units[1]->params[1].key, "emb.weight");
  EXPECT_EQ(plan.units[1]->params[1].offset, 4u);
  EXPECT_EQ(plan.units[1]->numel, 24u);
  EXPECT_TRUE(plan.units[1]->shared.empty());

  spec.use_orig_params = true;
  Fsdp1Plan orig = PlanFsdp1(ckpt, m, spec);
  ASSERT_EQ(orig.units.size(), 2u);
  ASSERT_EQ(orig.units[1]->params.size(), 1u);
  EXPECT_EQ(orig.units[1]->params[0].fqn, "norm.weight");

  // The copy's bytes in the root's flat parameter are the key's.
  ConvertOptions o;
  o.source = dir / "src";
  o.out = dir / "out";
  test::WriteBytes(dir / "model.json", Manifest(modules, params, {"Emb"}).dump());
  o.model_manifest = dir / "model.json";
  o.layout = spec;
  o.layout.use_orig_params = false;
  ConvertResult r = Convert(o);
  std::string flat;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto f = test::RawRankFile::Read(r.layout_dir / RankFileName(rank, 2));
    flat += test::RawTensorBytes(f, "_flat_param");
  }
  EXPECT_TRUE(test::SameBytes(flat, ts[1].data + ts[0].data));
  VerifyOptions vo;
  vo.path = o.out;
  vo.source = o.source;
  EXPECT_TRUE(Verify(vo).problems.empty());
}

// A parameter the model never saves (transformers' _keys_to_ignore_on_save, Marian's
// sinusoidal positions: `unsaved` in the model manifest) and the checkpoint lacks: its place in
// the flat parameter holds zeros (reshard.load writes the model's values there), verify
// accepts it, export leaves it out; a unit of only such parameters is refused by name.
TEST(Fsdp1Convert, UnsavedParameterIsZerosVerifiesAndIsNotExported) {
  R17 t;
  ojson unsaved = Param({"pos"}, {5});
  unsaved["unsaved"] = true;
  // Registration order p0, p1, pos, p2, p3: pos at flat 33, p2 at 38, p3 at 42; 66 elements.
  test::WriteBytes(t.manifest,
                   Manifest(ojson::array({Module("", "Toy", {{"p0", 0}, {"p1", 1}, {"pos", 4},
                                                             {"p2", 2}, {"p3", 3}})}),
                            ojson::array({Param({"p0"}, {3, 7}), Param({"p1"}, {12}), Param({"p2"}, {4}),
                                          Param({"p3"}, {4, 6}), unsaved}))
                       .dump());
  const uint32_t ws = 3;
  ConvertOptions o;
  o.source = t.src;
  o.out = t.dir / "out";
  o.model_manifest = t.manifest;
  o.layout.kind = LayoutKind::kFsdp1;
  o.layout.world_size = ws;
  o.chunk_size = 4096;
  ConvertResult r = Convert(o);
  ASSERT_TRUE(r.layout_complete);
  std::string flat;
  for (int i : {0, 1}) flat += t.tensors[i].data;
  flat.append(5 * 4, '\0');
  for (int i : {2, 3}) flat += t.tensors[i].data;
  ASSERT_EQ(flat.size(), 66u * 4);
  const uint64_t c = 22;
  for (uint32_t rank = 0; rank < ws; ++rank) {
    auto f = test::RawRankFile::Read(r.layout_dir / RankFileName(rank, ws));
    EXPECT_TRUE(test::SameBytes(test::RawTensorBytes(f, "_flat_param"), flat.substr(rank * c * 4, c * 4)))
        << "rank " << rank;
    const ojson& params = f.header["tensors"][0]["flat"]["params"];
    ASSERT_EQ(params.size(), 5u);
    EXPECT_EQ(params[2]["fqn"], "pos");
    EXPECT_EQ(params[2]["key"], "");
    EXPECT_EQ(params[2]["offset"], 33);
  }
  VerifyOptions vo;
  vo.path = o.out;
  vo.source = t.src;
  VerifyReport v = Verify(vo);
  EXPECT_TRUE(v.problems.empty()) << v.problems.front().message;

  ExportOptions eo;
  eo.out = o.out;
  eo.hf_dir = t.dir / "hf";
  ExportResult x = Export(eo);
  EXPECT_EQ(x.tensors, 4u);  // p0..p3, not pos
  Checkpoint back = OpenCheckpoint(eo.hf_dir);
  EXPECT_EQ(back.Find("pos"), nullptr);
  ASSERT_NE(back.Find("p2"), nullptr);

  // Without the flag it is a parameter the checkpoint should have had.
  ModelManifest m = ReadModelManifest(t.manifest);
  m.params[4].unsaved = false;
  Checkpoint ckpt = OpenCheckpoint(t.src);
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(ckpt, m, o.layout); }, ErrorCode::kMismatch,
                          {"pos", "not in the checkpoint"}));
  // A unit holding nothing but such a parameter has no dtype to take.
  ojson emb = Param({"emb.weight"}, {5});
  emb["unsaved"] = true;
  ModelManifest lone = ParseModelManifest(
      Manifest(ojson::array({Module("", "Toy", {{"p0", 0}, {"p1", 1}, {"p2", 2}, {"p3", 3}}),
                             Module("emb", "Positions", {{"weight", 4}})}),
               ojson::array({Param({"p0"}, {3, 7}), Param({"p1"}, {12}), Param({"p2"}, {4}),
                             Param({"p3"}, {4, 6}), emb}))
          .dump(),
      "m.json");
  LayoutSpec spec = o.layout;
  spec.wrap = {"Positions"};
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(ckpt, lone, spec); }, ErrorCode::kUnsupported,
                          {"unit \"emb\"", "computes at load", "emb.weight"}));
}

TEST(Fsdp1Plan, Refusals) {
  R17 t;
  Checkpoint ckpt = OpenCheckpoint(t.src);
  ModelManifest m = ReadModelManifest(t.manifest);
  LayoutSpec spec;
  spec.kind = LayoutKind::kFsdp1;
  spec.world_size = 2;
  spec.wrap = {"LlamaDecoderLayer"};
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(ckpt, m, spec); }, ErrorCode::kInvalidArgument,
                          {"--wrap LlamaDecoderLayer", "no module of that class", "Toy"}));
  spec.wrap.clear();
  ModelManifest other = m;
  other.params[1].shape = {13};
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(ckpt, other, spec); }, ErrorCode::kMismatch,
                          {"p1", "[12]", "[13]"}));
  other = m;
  other.params[2].names = {"missing.weight"};
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(ckpt, other, spec); }, ErrorCode::kMismatch,
                          {"missing.weight", "not in the checkpoint"}));

  // Mixed dtypes in one unit: FSDP1 needs one dtype; --dtype unifies them.
  TempDir dir;
  test::WriteShardedCheckpoint(dir / "src", {{test::MakeTensor("a", "F32", {4}, 1),
                                              test::MakeTensor("b", "BF16", {4}, 2)}});
  ModelManifest mixed = ParseModelManifest(
      Manifest(ojson::array({Module("", "Toy", {{"a", 0}, {"b", 1}})}),
               ojson::array({Param({"a"}, {4}), Param({"b"}, {4})})).dump(), "m.json");
  Checkpoint mc = OpenCheckpoint(dir / "src");
  EXPECT_TRUE(ThrowsError([&] { PlanFsdp1(mc, mixed, spec); }, ErrorCode::kUnsupported,
                          {"mixes dtypes", "--dtype"}));
  spec.dtype = "bf16";
  EXPECT_EQ(PlanFsdp1(mc, mixed, spec).units.size(), 1u);

  // Without a model manifest, convert says how to make one.
  ConvertOptions o;
  o.source = dir / "src";
  o.out = dir / "out";
  o.layout.kind = LayoutKind::kFsdp1;
  o.layout.world_size = 2;
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kNotFound,
                          {"python -m reshard.model_manifest", "reshard-model.json"}));
}

TEST(Fsdp1Manifest, MalformedManifestsNameTheField) {
  auto bad = [](const std::function<void(ojson&)>& edit, std::initializer_list<std::string_view> needles) {
    ojson m = Manifest(ojson::array({Module("", "Toy", {{"p", 0}}), Module("a", "A", {})}),
                       ojson::array({Param({"p"}, {2})}));
    edit(m);
    return ThrowsError([&] { ParseModelManifest(m.dump(), "m.json"); }, ErrorCode::kDataLoss, needles);
  };
  EXPECT_TRUE(bad([](ojson& m) { m["format"] = "other"; }, {"m.json", "format"}));
  EXPECT_TRUE(bad([](ojson& m) { m["modules"][0]["params"][0][1] = 7; }, {"modules[0].params[0][1]", "7"}));
  EXPECT_TRUE(bad([](ojson& m) { m["modules"][1]["name"] = "x.y"; }, {"modules[1].name", "pre-order"}));
  EXPECT_TRUE(bad([](ojson& m) { m["params"][0]["shape"] = ojson::array({-1}); }, {"params[0].shape"}));
  EXPECT_TRUE(bad([](ojson& m) { m["params"][0]["names"] = ojson::array(); }, {"params[0].names"}));
  EXPECT_TRUE(bad([](ojson& m) { m.erase("buffers"); }, {"buffers"}));
}

TEST(Fsdp1RankFile, BrokenFlatHeadersAreRefused) {
  R17 t;
  ConvertOptions o;
  o.source = t.src;
  o.out = t.dir / "out";
  o.model_manifest = t.manifest;
  o.layout.kind = LayoutKind::kFsdp1;
  o.layout.world_size = 2;
  ConvertResult r = Convert(o);
  const fs::path p = r.layout_dir / RankFileName(1, 2);
  const std::string good = test::ReadBytes(p);
  auto broken = [&](const std::function<void(ojson&)>& edit, std::initializer_list<std::string_view> needles) {
    test::WriteBytes(p, good);
    test::EditRankHeader(p, edit);
    return ThrowsError([&] { RankFileReader::Open(p); }, ErrorCode::kDataLoss, needles);
  };
  EXPECT_TRUE(broken([](ojson& h) { h["tensors"][0]["flat"]["params"][1]["offset"] = 3; },
                     {"flat.params[1].offset", "after the previous parameter"}));
  EXPECT_TRUE(broken([](ojson& h) { h["tensors"][0]["flat"]["numel"] = 60; }, {"global_shape", "[60]"}));
  EXPECT_TRUE(broken([](ojson& h) { h["tensors"][0]["shard"]["start"] = 0; }, {"shard"}));
  EXPECT_TRUE(broken([](ojson& h) { h["tensors"][0]["flat"]["unit"] = "x"; }, {"flat.unit"}));
  EXPECT_TRUE(broken([](ojson& h) { h["tensors"][0]["flat"]["aligned_numel"] = 4; }, {"aligned_numel"}));
  EXPECT_TRUE(broken([](ojson& h) { h["layout"]["kind"] = "fsdp2"; }, {"flat"}));
}

}  // namespace
}  // namespace reshard
