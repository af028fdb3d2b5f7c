// ParseWeightMap: the index file parser (model.safetensors.index.json,
// pytorch_model.bin.index.json) on bytes, as OpenCheckpoint and the fuzz target use it.
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "reshard/base/error.h"
#include "reshard/format/checkpoint.h"
#include "reshard/io/checkpoint.h"
#include "core/test_util.h"

namespace reshard {
namespace {

using test::ThrowsError;

TEST(ParseWeightMap, ReadsTheMapAndIgnoresOtherMembers) {
  const auto m = ParseWeightMap(
      R"({"metadata": {"total_size": 123, "x": [1, 2]},
          "weight_map": {"b": "model-00002-of-00002.safetensors",
                         "a": "model-00001-of-00002.safetensors",
                         "\u00e9": "model-00001-of-00002.safetensors"}})",
      "ix.json");
  const std::map<std::string, std::string> expected = {
      {"a", "model-00001-of-00002.safetensors"},
      {"b", "model-00002-of-00002.safetensors"},
      {"\xc3\xa9", "model-00001-of-00002.safetensors"}};
  EXPECT_EQ(m, expected);
}

TEST(ParseWeightMap, RefusesMalformedIndexes) {
  const auto bad = [](const char* text, std::initializer_list<std::string_view> needles) {
    return ThrowsError([&] { ParseWeightMap(text, "dir/ix.json"); }, ErrorCode::kDataLoss,
                       needles);
  };
  EXPECT_TRUE(bad("", {"dir/ix.json", "index is not valid JSON"}));
  EXPECT_TRUE(bad("[]", {"dir/ix.json", "index: found array", "an object"}));
  EXPECT_TRUE(bad(R"({"metadata": {}})", {"index.weight_map", "found nothing"}));
  EXPECT_TRUE(bad(R"({"weight_map": []})", {"weight_map: found array", "an object"}));
  EXPECT_TRUE(bad(R"({"weight_map": {}})", {"weight_map: found an empty map"}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": null}})", {"weight_map[\"w\"]: found null"}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": "../a.safetensors"}})",
                  {"weight_map[\"w\"]", "\"../a.safetensors\"",
                   "a file name in the checkpoint directory"}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": ""}})", {"weight_map[\"w\"]", "found \"\""}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": ".."}})", {"weight_map[\"w\"]", "found \"..\""}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": "a", "w": "b"}})", {"duplicate key \"w\""}));
  EXPECT_TRUE(bad(R"({"weight_map": {"w": "a"}, "weight_map": {"v": "b"}})",
                  {"duplicate key \"weight_map\""}));
}

}  // namespace
}  // namespace reshard
