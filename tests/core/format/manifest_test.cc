// The output manifest (formats/manifest.md): round trip, every malformed variant rejected
// with its own error, and ScanLayout's checks of the rank files present.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/manifest.h"
#include "reshard/ops/convert.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::ojson;
using test::TempDir;
using test::ThrowsError;

Manifest SampleManifest() {
  Manifest m;
  m.writer = "reshard test";
  m.source = SourceFingerprint::FromFiles(
      {{"b.safetensors", 20, 0x2222, 0x4444}, {"a.safetensors", 10, 0x1111, 0x3333}});
  m.aux_files = {"config.json"};
  ManifestLayout l;
  l.key = "fsdp2-ws2";
  l.world_size = 2;
  l.dir = "fsdp2-ws2";
  l.ranks = {{0, RankFileName(0, 2), 100, 0xabc}, {1, RankFileName(1, 2), 90, 0xdef}};
  l.complete = true;
  m.layouts[l.key] = l;
  ManifestLayout p = l;
  p.key = p.dir = "fsdp2-ws3";
  p.world_size = 3;
  p.ranks = {{2, RankFileName(2, 3), 80, 0x123}};
  p.complete = false;
  m.layouts[p.key] = p;
  return m;
}

TEST(Manifest, RoundTripsAndFollowsTheSpec) {
  const Manifest m = SampleManifest();
  const std::string text = SerializeManifest(m);
  const ojson j = ojson::parse(text);
  EXPECT_EQ(j["format"], "reshard.manifest");
  EXPECT_EQ(j["format_version"], 1);
  EXPECT_EQ(j["source"]["files"][0]["name"], "a.safetensors");  // sorted by name
  EXPECT_EQ(j["source"]["files"][0]["header_xxh3"], "0000000000001111");
  // The fingerprint by the spec's recipe.
  EXPECT_EQ(j["source"]["files"][0]["sample_xxh3"], "0000000000003333");
  const std::string canonical = std::string("a.safetensors") + '\0' + "10" + '\0' +
                                "0000000000001111" + '\0' + "0000000000003333\n" +
                                "b.safetensors" + '\0' + "20" + '\0' + "0000000000002222" +
                                '\0' + "0000000000004444\n";
  EXPECT_EQ(j["source"]["fingerprint"], test::RefHex16(test::RefXxh3(canonical)));
  EXPECT_EQ(j["layouts"]["fsdp2-ws3"]["ranks"][0]["file"], "rank-00002-of-00003.reshard");
  EXPECT_EQ(j["layouts"]["fsdp2-ws3"]["complete"], false);

  const Manifest back = ParseManifest(text, "m.json");
  EXPECT_EQ(back.writer, "reshard test");
  EXPECT_TRUE(back.source == m.source);
  EXPECT_EQ(back.aux_files, m.aux_files);
  ASSERT_EQ(back.layouts.size(), 2u);
  const ManifestLayout& l = back.layouts.at("fsdp2-ws2");
  EXPECT_EQ(l.key, "fsdp2-ws2");
  EXPECT_EQ(l.world_size, 2u);
  EXPECT_TRUE(l.complete);
  ASSERT_EQ(l.ranks.size(), 2u);
  EXPECT_EQ(l.ranks[1].file, "rank-00001-of-00002.reshard");
  EXPECT_EQ(l.ranks[1].size, 90u);
  EXPECT_EQ(l.ranks[1].header_xxh3, 0xdefu);
  EXPECT_FALSE(back.layouts.at("fsdp2-ws3").complete);
}

TEST(Manifest, ReadManifestOfAnEmptyDirectoryIsNullopt) {
  TempDir d;
  EXPECT_FALSE(ReadManifest(d.path()).has_value());
  WriteManifest(d.path(), SampleManifest());
  ASSERT_TRUE(ReadManifest(d.path()).has_value());
  EXPECT_EQ(ReadManifest(d.path())->layouts.size(), 2u);
  // Written atomically: no temporary left beside it.
  EXPECT_EQ(test::ListFiles(d.path()), (std::vector<std::string>{"reshard.json"}));
}

struct ManifestCase {
  const char* name;
  std::function<void(ojson&)> mutate;
  std::vector<std::string> needles;
};
void PrintTo(const ManifestCase& c, std::ostream* os) { *os << c.name; }

class BrokenManifest : public ::testing::TestWithParam<ManifestCase> {};

TEST_P(BrokenManifest, RejectedWithItsOwnError) {
  ojson j = ojson::parse(SerializeManifest(SampleManifest()));
  GetParam().mutate(j);
  std::string message;
  ASSERT_TRUE(ThrowsError([&] { ParseManifest(j.dump(), "/out/reshard.json"); },
                          ErrorCode::kDataLoss, {"/out/reshard.json"}, &message));
  for (const auto& n : GetParam().needles) {
    EXPECT_NE(message.find(n), std::string::npos) << n << "\n" << message;
  }
}

ojson& Ws2(ojson& j) { return j["layouts"]["fsdp2-ws2"]; }

const ManifestCase kManifestCases[] = {
    {"NotAnObject", [](ojson& j) { j = ojson::array(); }, {"manifest: found array", "an object"}},
    {"WrongFormat", [](ojson& j) { j["format"] = "reshard.rank"; }, {"format: found \"reshard.rank\""}},
    {"FutureVersion", [](ojson& j) { j["format_version"] = 2; }, {"format_version: found 2"}},
    {"FingerprintMismatch", [](ojson& j) { j["source"]["fingerprint"] = "0123456789abcdef"; },
     {"source.fingerprint: found 0123456789abcdef"}},
    {"AuxFileNotString", [](ojson& j) { j["aux_files"][0] = 1; }, {"aux_files[0]", "a string"}},
    {"UnknownKind", [](ojson& j) { Ws2(j)["kind"] = "fsdp3"; },
     {"layouts[\"fsdp2-ws2\"].kind: found \"fsdp3\""}},
    {"ZeroWorldSize", [](ojson& j) { Ws2(j)["world_size"] = 0; },
     {"layouts[\"fsdp2-ws2\"].world_size: found 0"}},
    {"DirNotKey", [](ojson& j) { Ws2(j)["dir"] = "elsewhere"; },
     {"layouts[\"fsdp2-ws2\"].dir: found \"elsewhere\""}},
    {"KeyOutsideOut",
     [](ojson& j) {
       ojson l = Ws2(j);
       l["dir"] = "../../etc";
       j["layouts"]["../../etc"] = l;
     },
     {"layouts[\"../../etc\"]", "a directory name"}},
    {"RankOutsideWorld", [](ojson& j) { Ws2(j)["ranks"][1]["rank"] = 2; },
     {"layouts[\"fsdp2-ws2\"].ranks[1]", "rank 2 file rank-00001-of-00002.reshard"}},
    {"RankPast32Bits",
     [](ojson& j) {
       Ws2(j)["ranks"][1]["rank"] = (uint64_t{1} << 32) + 1;  // would narrow to 1
     },
     {"layouts[\"fsdp2-ws2\"].ranks[1]", "rank 4294967297"}},
    {"FileNotCanonical", [](ojson& j) { Ws2(j)["ranks"][1]["file"] = "rank-1-of-2.reshard"; },
     {"layouts[\"fsdp2-ws2\"].ranks[1]", "canonical file name"}},
    {"RanksNotSorted",
     [](ojson& j) {
       ojson r0 = Ws2(j)["ranks"][0];
       Ws2(j)["ranks"][0] = Ws2(j)["ranks"][1];
       Ws2(j)["ranks"][1] = r0;
     },
     {"layouts[\"fsdp2-ws2\"].ranks[1].rank: found 0", "each listed once"}},
    {"RankListedTwice", [](ojson& j) { Ws2(j)["ranks"][1] = Ws2(j)["ranks"][0]; },
     {"layouts[\"fsdp2-ws2\"].ranks[1].rank: found 0"}},
    {"CompleteButMissingRanks", [](ojson& j) { j["layouts"]["fsdp2-ws3"]["complete"] = true; },
     {"layouts[\"fsdp2-ws3\"].complete: found true", "1 of 3 ranks listed"}},
    {"IncompleteButAllRanks", [](ojson& j) { Ws2(j)["complete"] = false; },
     {"layouts[\"fsdp2-ws2\"].complete: found false"}},
    {"CompleteNotBool", [](ojson& j) { Ws2(j)["complete"] = "yes"; },
     {"layouts[\"fsdp2-ws2\"].complete", "true or false"}},
    {"HeaderXxh3NotHex", [](ojson& j) { Ws2(j)["ranks"][0]["header_xxh3"] = "abc"; },
     {"layouts[\"fsdp2-ws2\"].ranks[0].header_xxh3"}},
    {"PartsWithoutItself", [](ojson& j) { Ws2(j)["parts"] = {"fsdp2-ws3", "fsdp2-ws4"}; },
     {"layouts[\"fsdp2-ws2\"].parts: found [fsdp2-ws3, fsdp2-ws4]", "\"fsdp2-ws2\" among them"}},
    {"PartsAlone", [](ojson& j) { Ws2(j)["parts"] = {"fsdp2-ws2"}; },
     {"layouts[\"fsdp2-ws2\"].parts: found [fsdp2-ws2]", "two or more"}},
    {"PartsNotSorted", [](ojson& j) { Ws2(j)["parts"] = {"fsdp2-ws3", "fsdp2-ws2"}; },
     {"layouts[\"fsdp2-ws2\"].parts", "sorted, each once"}},
    {"PartsTwice", [](ojson& j) { Ws2(j)["parts"] = {"fsdp2-ws2", "fsdp2-ws2"}; },
     {"layouts[\"fsdp2-ws2\"].parts", "sorted, each once"}},
    {"PartsOutsideOut", [](ojson& j) { Ws2(j)["parts"] = {"../x", "fsdp2-ws2"}; },
     {"layouts[\"fsdp2-ws2\"].parts: found [../x, fsdp2-ws2]"}},
    {"PartsNotStrings", [](ojson& j) { Ws2(j)["parts"] = {1, 2}; }, {"layouts[\"fsdp2-ws2\"].parts[0]"}},
    {"PartsDisagree",
     [](ojson& j) {
       Ws2(j)["parts"] = {"fsdp2-ws2", "fsdp2-ws3"};
       j["layouts"]["fsdp2-ws3"]["parts"] = {"fsdp2-ws3", "fsdp2-ws5"};
     },
     {".parts", "the layouts of one save list the same parts"}},
};

TEST(Manifest, PartsRoundTripAndMayNameALayoutNotListedYet) {
  Manifest m = SampleManifest();
  m.layouts.at("fsdp2-ws2").parts = {"fsdp2-ws2", "fsdp2-ws3"};
  m.layouts.at("fsdp2-ws3").parts = {"fsdp2-ws2", "fsdp2-ws3"};
  Manifest back = ParseManifest(SerializeManifest(m), "m.json");
  EXPECT_EQ(back.layouts.at("fsdp2-ws2").parts, (std::vector<std::string>{"fsdp2-ws2", "fsdp2-ws3"}));
  EXPECT_EQ(back.layouts.at("fsdp2-ws3").parts, back.layouts.at("fsdp2-ws2").parts);
  // A part listed without parts of its own disagrees.
  m.layouts.at("fsdp2-ws3").parts.clear();
  EXPECT_TRUE(ThrowsError([&] { ParseManifest(SerializeManifest(m), "m.json"); }, ErrorCode::kDataLoss,
                          {"layouts[\"fsdp2-ws3\"].parts: found none"}));
  // The other part not listed (a save adds its layouts one after the other): accepted.
  m.layouts.at("fsdp2-ws2").parts = {"dtensor-ep2-saved.0123456789abcdef", "fsdp2-ws2"};
  m.layouts.erase("fsdp2-ws3");
  back = ParseManifest(SerializeManifest(m), "m.json");
  EXPECT_EQ(back.layouts.at("fsdp2-ws2").parts.size(), 2u);
  // Without parts, no key is written (manifests of whole layouts are unchanged).
  EXPECT_FALSE(ojson::parse(SerializeManifest(SampleManifest()))["layouts"]["fsdp2-ws2"].contains("parts"));
}

INSTANTIATE_TEST_SUITE_P(Manifest, BrokenManifest, ::testing::ValuesIn(kManifestCases),
                         [](const ::testing::TestParamInfo<ManifestCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(Manifest, NotJsonOrDuplicateKey) {
  EXPECT_TRUE(ThrowsError([] { ParseManifest("{\"format\": ", "m.json"); }, ErrorCode::kDataLoss,
                          {"m.json", "manifest is not valid JSON"}));
  EXPECT_TRUE(ThrowsError([] { ParseManifest("{\"format\": 1, \"format\": 2}", "m.json"); },
                          ErrorCode::kDataLoss, {"m.json", "duplicate key \"format\""}));
}

// ---- ScanLayout --------------------------------------------------------------------------

class ScanLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::WriteShardedCheckpoint(dir_ / "src", test::AwkwardCheckpointFiles(4));
    for (uint32_t ws : {2u, 3u}) {
      ConvertOptions o;
      o.source = dir_ / "src";
      o.out = dir_ / "out";
      o.layout.world_size = ws;
      o.threads = 2;
      o.chunk_size = 4096;
      Convert(o);
    }
    source_ = OpenCheckpoint(dir_ / "src").fingerprint;
  }
  fs::path Layout(uint32_t ws) const { return dir_ / "out" / ("fsdp2-ws" + std::to_string(ws)); }
  TempDir dir_;
  SourceFingerprint source_;
};

TEST_F(ScanLayoutTest, ListsTheRankFilesPresentAndIgnoresOtherNames) {
  fs::remove(Layout(3) / RankFileName(1, 3));
  test::WriteBytes(Layout(3) / ".rank-00001-of-00003.reshard.tmp-123", "partial");
  test::WriteBytes(Layout(3) / "rank-00001-of-00004.reshard", "other world size");
  test::WriteBytes(Layout(3) / "notes.txt", "hello");
  const ManifestLayout l = ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 3, "keep"}, source_);
  EXPECT_EQ(l.key, "fsdp2-ws3");
  EXPECT_EQ(l.dir, "fsdp2-ws3");
  EXPECT_FALSE(l.complete);
  ASSERT_EQ(l.ranks.size(), 2u);
  EXPECT_EQ(l.ranks[0].rank, 0u);
  EXPECT_EQ(l.ranks[1].rank, 2u);
  const test::RawRankFile f = test::RawRankFile::Read(Layout(3) / RankFileName(2, 3));
  EXPECT_EQ(l.ranks[1].size, f.bytes.size());
  EXPECT_EQ(l.ranks[1].header_xxh3, f.header_xxh3);
  // A layout directory that does not exist: no ranks.
  const ManifestLayout none = ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 7, "keep"}, source_);
  EXPECT_TRUE(none.ranks.empty());
  EXPECT_FALSE(none.complete);
}

TEST_F(ScanLayoutTest, RankFileOfAnotherLayoutUnderThisNameIsMismatch) {
  fs::copy_file(Layout(3) / RankFileName(1, 3), Layout(2) / RankFileName(1, 2),
                fs::copy_options::overwrite_existing);
  EXPECT_TRUE(ThrowsError(
      [&] { ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, source_); },
      ErrorCode::kMismatch, {"holds layout fsdp2-ws3 rank 1, expected fsdp2-ws2 rank 1"}));
  // Another rank of the same layout under the wrong name.
  fs::copy_file(Layout(2) / RankFileName(0, 2), Layout(2) / RankFileName(1, 2),
                fs::copy_options::overwrite_existing);
  EXPECT_TRUE(ThrowsError(
      [&] { ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, source_); },
      ErrorCode::kMismatch, {"holds layout fsdp2-ws2 rank 0, expected fsdp2-ws2 rank 1"}));
}

TEST_F(ScanLayoutTest, RankFileOfAnotherSourceIsMismatch) {
  SourceFingerprint other = SourceFingerprint::FromFiles({{"x.safetensors", 1, 2}});
  EXPECT_TRUE(ThrowsError(
      [&] { ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, other); },
      ErrorCode::kMismatch, {"was converted from another source"}));
}

TEST_F(ScanLayoutTest, CorruptRankFileIsDataLoss) {
  const fs::path p = Layout(2) / RankFileName(0, 2);
  std::string b = test::ReadBytes(p);
  test::WriteBytes(p, b.substr(0, b.size() - 10));
  EXPECT_TRUE(ThrowsError(
      [&] { ScanLayout(dir_ / "out", LayoutSpec{LayoutKind::kFsdp2, 2, "keep"}, source_); },
      ErrorCode::kDataLoss, {p.string(), "truncated"}));
}

}  // namespace
}  // namespace reshard
