// ParseStrictJson (src/format/json_util.h, internal to the layers): one SAX pass that builds
// the document and refuses duplicate keys, and keeps an array of hex16 strings under a named
// key as one binary value (the rank file header's chunk_xxh3). Every document must come out
// exactly as nlohmann's own parse gives it, but for that one kind of array.
#include "format/json_util.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/test_util.h"

namespace reshard::internal {
namespace {

using nlohmann::json;
using test::ThrowsError;

const std::vector<std::string> kDocuments = {
    "0",
    "\"text\"",
    "null",
    "[]",
    "{}",
    "[1, -2, 3.5, 1e300, 18446744073709551615, -9223372036854775808, true, false, null]",
    R"({"a": {"b": [1, {"c": [[], {}, [[[]]]]}], "d": "\u00e9\ud83d\ude00"}, "e": []})",
    R"([{"x": 1}, {"x": 2, "y": [{"z": {}}]}, [{"w": [1, 2]}]])",
    R"({"chunk_xxh3": 5, "list": [["0000000000000001"]], "more": {"chunk_xxh3": {"a": 1}}})",
    R"({"tensors": [{"chunk_xxh3": ["0123456789abcdef", "0123456789ABCDEF"]}]})",
    R"({"chunk_xxh3": ["0123456789abcdef", 7]})",
    R"({"chunk_xxh3": [null, "0123456789abcdef"]})",
    R"({"chunk_xxh3": ["0123456789abcdef", ["0123456789abcdef"], "fedcba9876543210"]})",
    R"({"chunk_xxh3": ["0123456789abcdef", {"k": "0123456789abcdef"}]})",
    R"({"chunk_xxh3": ["0123456789abcde", "0123456789abcdef0"]})",
};

TEST(ParseStrictJson, GivesWhatNlohmannParseGives) {
  for (const std::string& text : kDocuments) {
    EXPECT_EQ(ParseStrictJson(text, "f.json", "document"), json::parse(text)) << text;
    EXPECT_EQ(ParseStrictJson(text, "f.json", "document", "other_key"), json::parse(text)) << text;
  }
}

TEST(ParseStrictJson, AnArrayWithAnythingButHex16StaysAsItIsElementForElement) {
  // Every document above whose chunk_xxh3 arrays are not all hex16: parsed with the key
  // named, the same document (the values already read turn back into their strings).
  for (size_t i = 8; i < kDocuments.size(); ++i) {
    EXPECT_EQ(ParseStrictJson(kDocuments[i], "f.json", "document", "chunk_xxh3"), json::parse(kDocuments[i]))
        << kDocuments[i];
  }
}

TEST(ParseStrictJson, AnArrayOfHex16UnderTheKeyIsKeptWhole) {
  const std::string text =
      R"({"tensors": [{"name": "w", "chunk_xxh3": ["0000000000000001", "ffffffffffffffff", "0123456789abcdef"]},)"
      R"( {"name": "e", "chunk_xxh3": []}], "chunk_xxh3": ["00000000000000ff"]})";
  const json j = ParseStrictJson(text, "f.json", "header", "chunk_xxh3");
  const json& w = j["tensors"][0]["chunk_xxh3"];
  ASSERT_TRUE(w.is_binary());
  EXPECT_EQ(HexArrayValues(w), (std::vector<uint64_t>{1, ~0ull, 0x0123456789abcdefull}));
  ASSERT_TRUE(j["tensors"][1]["chunk_xxh3"].is_binary());
  EXPECT_EQ(HexArrayValues(j["tensors"][1]["chunk_xxh3"]), std::vector<uint64_t>{});
  EXPECT_EQ(HexArrayValues(j["chunk_xxh3"]), std::vector<uint64_t>{0xff});
  // Everything else as parsed.
  EXPECT_EQ(j["tensors"][0]["name"], "w");
  EXPECT_EQ(j["tensors"][1]["name"], "e");
  // Not a binary value: no values.
  EXPECT_FALSE(HexArrayValues(j["tensors"][0]["name"]).has_value());
  EXPECT_FALSE(HexArrayValues(json::parse(text)["chunk_xxh3"]).has_value());
}

TEST(ParseStrictJson, RefusesADuplicateKeyAtAnyDepth) {
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {R"({"a": 1, "a": 2})", "a"},
           {R"({"x": {"b": [], "c": 0, "b": {}}})", "b"},
           {R"([0, {"c": 0, "d": [{"e": 1, "e": 1}]}])", "e"},
           {R"({"chunk_xxh3": ["0000000000000001"], "chunk_xxh3": []})", "chunk_xxh3"},
       }) {
    EXPECT_TRUE(ThrowsError([&] { ParseStrictJson(text, "dir/f.json", "manifest", "chunk_xxh3"); },
                            ErrorCode::kDataLoss, {"dir/f.json: manifest: duplicate key \"" + key + "\""}))
        << text;
  }
  // The same key in two objects is not a duplicate.
  EXPECT_NO_THROW(ParseStrictJson(R"([{"a": 1}, {"a": 2}, {"o": {"a": 3}}])", "f.json", "x"));
}

TEST(ParseStrictJson, RefusesInvalidJsonNamingTheFile) {
  for (const std::string text : {"{", "[1,]", "{\"a\" 1}", "[1] 2", "", "{\"chunk_xxh3\": [\"0000000000000001\""}) {
    EXPECT_TRUE(ThrowsError([&] { ParseStrictJson(text, "dir/f.json", "header", "chunk_xxh3"); },
                            ErrorCode::kDataLoss, {"dir/f.json: header is not valid JSON ("}))
        << text;
  }
}

}  // namespace
}  // namespace reshard::internal
