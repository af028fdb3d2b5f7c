// reshard::RemoveLayouts on manifests made here: which refusals leave everything as it was,
// and what a removal leaves.
#include "reshard/ops/remove.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/format/manifest.h"
#include "reshard/io/manifest.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::ThrowsError;

// An OUT whose manifest lists `keys` (FSDP2 layouts of world size 1, each with a directory
// holding one file), the layouts of `parts` saved as the parts of one expert-parallel save,
// `derived` made from `from`.
void MakeOut(const fs::path& out, const std::vector<std::string>& keys, const std::vector<std::string>& parts = {},
             const std::string& derived = "", const std::string& from = "") {
  fs::create_directories(out);
  Manifest m;
  m.writer = "test";
  m.source = SourceFingerprint::FromFiles({});
  for (const std::string& k : keys) {
    ManifestLayout l;
    l.key = l.dir = k;
    l.kind = LayoutKind::kFsdp2;
    l.world_size = 1;
    l.complete = true;
    l.ranks.push_back({0, "rank-00000-of-00001.reshard", 4096, 1});
    for (const std::string& p : parts) {
      if (p == k) l.parts = parts;
    }
    if (k == derived) l.from = from;
    m.layouts[k] = l;
    fs::create_directories(out / k);
    test::WriteBytes(out / k / "rank-00000-of-00001.reshard", std::string(4096, '\0'));
  }
  WriteManifest(out, m);
}

TEST(RemoveLayouts, RemovesAndUnlinks) {
  TempDir t;
  const fs::path out = t / "out";
  MakeOut(out, {"fsdp2-ws1", "fsdp2-ws2", "fsdp2-ws3"}, {}, "fsdp2-ws2", "fsdp2-ws1");
  const RemoveResult r = RemoveLayouts(out, {"fsdp2-ws1"});
  EXPECT_EQ(r.removed, (std::vector<std::string>{"fsdp2-ws1"}));
  EXPECT_EQ(r.unlinked, (std::vector<std::string>{"fsdp2-ws2"}));
  EXPECT_EQ(r.remaining, (std::vector<std::string>{"fsdp2-ws2", "fsdp2-ws3"}));
  EXPECT_FALSE(fs::exists(out / "fsdp2-ws1"));
  EXPECT_TRUE(fs::exists(out / "fsdp2-ws2" / "rank-00000-of-00001.reshard"));
  const Manifest m = *ReadManifest(out);
  ASSERT_EQ(m.layouts.size(), 2u);
  EXPECT_TRUE(m.layouts.at("fsdp2-ws2").from.empty());
}

TEST(RemoveLayouts, RefusalsChangeNothing) {
  TempDir t;
  const fs::path out = t / "out";
  MakeOut(out, {"fsdp2-ws1", "fsdp2-ws2", "fsdp2-ws3"}, {"fsdp2-ws1", "fsdp2-ws2"});
  const std::string before = test::ReadBytes(out / "reshard.json");
  // One part of an expert-parallel save without the other: the command that removes both.
  EXPECT_TRUE(ThrowsError([&] { RemoveLayouts(out, {"fsdp2-ws1"}); }, ErrorCode::kMismatch,
                          {"one part of an expert-parallel save", "reshard remove " + out.string() + " fsdp2-ws1 fsdp2-ws2"}));
  EXPECT_TRUE(ThrowsError([&] { RemoveLayouts(out, {"fsdp2-ws1", "fsdp2-ws2", "fsdp2-ws3"}); },
                          ErrorCode::kMismatch, {"removing every layout"}));
  EXPECT_TRUE(ThrowsError([&] { RemoveLayouts(out, {"fsdp2-ws7"}); }, ErrorCode::kNotFound,
                          {"lists no layout fsdp2-ws7", "fsdp2-ws1, fsdp2-ws2, fsdp2-ws3"}));
  EXPECT_TRUE(ThrowsError([&] { RemoveLayouts(out, {}); }, ErrorCode::kInvalidArgument, {"name the layouts"}));
  EXPECT_TRUE(ThrowsError([&] { RemoveLayouts(t / "nowhere", {"fsdp2-ws1"}); }, ErrorCode::kNotFound, {"nowhere"}));
  EXPECT_EQ(test::ReadBytes(out / "reshard.json"), before);
  for (const char* k : {"fsdp2-ws1", "fsdp2-ws2", "fsdp2-ws3"}) EXPECT_TRUE(fs::exists(out / k)) << k;
  // Both parts at once: removed.
  const RemoveResult r = RemoveLayouts(out, {"fsdp2-ws2", "fsdp2-ws1"});
  EXPECT_EQ(r.removed, (std::vector<std::string>{"fsdp2-ws1", "fsdp2-ws2"}));
  EXPECT_EQ(r.remaining, (std::vector<std::string>{"fsdp2-ws3"}));
}

}  // namespace
}  // namespace reshard
