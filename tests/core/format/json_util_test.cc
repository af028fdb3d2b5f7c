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
#include "reshard/base/checksum.h"

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
    // chunk_xxh3 that is not an array of hex16: left as it is.
    R"({"chunk_xxh3": 5, "list": [["0000000000000001"]], "more": {"chunk_xxh3": {"a": 1}}})",
    R"({"tensors": [{"chunk_xxh3": ["0123456789abcdef", "0123456789ABCDEF"]}]})",
    R"({"chunk_xxh3": ["0123456789abcdef", 7]})",
    R"({"chunk_xxh3": ["0123456789abcdef", -7, 2.5, 18446744073709551615]})",
    R"({"chunk_xxh3": [null, "0123456789abcdef"]})",
    R"({"chunk_xxh3": ["0123456789abcdef", ["0123456789abcdef"], "fedcba9876543210"]})",
    R"({"chunk_xxh3": ["0123456789abcdef", {"k": "0123456789abcdef"}]})",
    R"({"chunk_xxh3": ["0123456789abcdef", {"chunk_xxh3": ["0000000000000001"]}, "x"]})",
    R"({"chunk_xxh3": ["0123456789abcde", "0123456789abcdef0"]})",
    R"(["0123456789abcdef", "fedcba9876543210"])",
    R"([{"chunk_xxh3": "0123456789abcdef"}])",
    // Arrays of hex16 under the key, beside and inside everything else.
    R"({"tensors": [{"name": "w", "chunk_xxh3": ["0000000000000001", "ffffffffffffffff"], "n": 18446744073709551615},)"
    R"( {"name": "e", "chunk_xxh3": [], "m": -1}], "chunk_xxh3": ["00000000000000ff"], "after": [1.5, "z"]})",
    R"({"a": [{"chunk_xxh3": ["0123456789abcdef"]}, "x", {"chunk_xxh3": ["0123456789abcdef", 1]}]})",
};

// The document with every binary value (an array ParseStrictJson kept whole) turned back into
// its array of hex16 strings.
json WithArraysBack(const json& j) {
  if (j.is_binary()) {
    json a = json::array();
    const std::vector<uint64_t> values = HexArrayValues(j).value();
    for (const uint64_t v : values) a.push_back(Hex16(v));
    return a;
  }
  if (j.is_object()) {
    json o = json::object();
    for (const auto& [k, v] : j.items()) o[k] = WithArraysBack(v);
    return o;
  }
  if (j.is_array()) {
    json a = json::array();
    for (const json& v : j) a.push_back(WithArraysBack(v));
    return a;
  }
  return j;
}

// Equal as documents and as text: dump() tells an unsigned, an integer and a float apart,
// which json's == does not.
::testing::AssertionResult Same(const json& got, const json& want) {
  if (got == want && got.dump() == want.dump()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got.dump() << "\nwant " << want.dump();
}

bool HasBinary(const json& j) {
  if (j.is_binary()) return true;
  if (j.is_structured()) {
    for (const json& v : j) {
      if (HasBinary(v)) return true;
    }
  }
  return false;
}

TEST(ParseStrictJson, GivesWhatNlohmannParseGives) {
  for (const std::string& text : kDocuments) {
    const json got = ParseStrictJson(text, "f.json", "document");
    EXPECT_TRUE(Same(got, json::parse(text))) << text;
    EXPECT_FALSE(HasBinary(got)) << text;  // no key named: no binary value
  }
}

TEST(ParseStrictJson, WithTheKeyTheSameDocumentButItsHexArraysKeptWhole) {
  size_t kept = 0;
  for (const std::string& text : kDocuments) {
    const json got = ParseStrictJson(text, "f.json", "document", "chunk_xxh3");
    EXPECT_TRUE(Same(WithArraysBack(got), json::parse(text))) << text;
    kept += HasBinary(got);
  }
  // The last two documents, and the one whose fallback array holds an object with one.
  EXPECT_EQ(kept, 3u);
}

TEST(ParseStrictJson, AnArrayOfHex16UnderTheKeyIsOneBinaryValue) {
  const json j = ParseStrictJson(kDocuments[kDocuments.size() - 2], "f.json", "header", "chunk_xxh3");
  ASSERT_TRUE(j["tensors"][0]["chunk_xxh3"].is_binary());
  EXPECT_EQ(HexArrayValues(j["tensors"][0]["chunk_xxh3"]), (std::vector<uint64_t>{1, ~0ull}));
  ASSERT_TRUE(j["tensors"][1]["chunk_xxh3"].is_binary());
  EXPECT_EQ(HexArrayValues(j["tensors"][1]["chunk_xxh3"]), std::vector<uint64_t>{});
  EXPECT_EQ(HexArrayValues(j["chunk_xxh3"]), std::vector<uint64_t>{0xff});
  // Inside an array of objects; the one with a number stays an array.
  const json a = ParseStrictJson(kDocuments.back(), "f.json", "header", "chunk_xxh3");
  EXPECT_EQ(HexArrayValues(a["a"][0]["chunk_xxh3"]), std::vector<uint64_t>{0x0123456789abcdefull});
  EXPECT_TRUE(a["a"][2]["chunk_xxh3"].is_array());
  EXPECT_FALSE(HexArrayValues(a["a"][2]["chunk_xxh3"]).has_value());
  EXPECT_FALSE(HexArrayValues(a["a"][1]).has_value());
}

TEST(ParseStrictJson, ErrorsDescribeAKeptArrayAsTheFileWroteIt) {
  // Describe (every "found ..." of an error) shows the hex strings, not the binary value the
  // parse kept them as: the type the file has and the text it holds.
  const json j = ParseStrictJson(R"({"t": {"name": "w", "chunk_xxh3": ["0123456789abcdef"]}, "u": []})",
                                 "f.json", "header", "chunk_xxh3");
  ASSERT_TRUE(j["t"]["chunk_xxh3"].is_binary());
  EXPECT_EQ(Describe(j["t"]["chunk_xxh3"]), "array [\"0123456789abcdef\"]");
  EXPECT_EQ(Describe(j["t"]), R"(object {"chunk_xxh3":["0123456789abcdef"],"name":"w"})");
  const std::string whole = Describe(j);
  EXPECT_EQ(whole.rfind("object {\"t\":{\"chunk_xxh3\":[\"0123456789abcdef\"]", 0), 0u) << whole;
  EXPECT_EQ(whole.find("bytes"), std::string::npos) << whole;
  // An error naming the field shows it too.
  EXPECT_TRUE(ThrowsError([&] { GetString(j["t"]["chunk_xxh3"], "f.json", "t.chunk_xxh3"); }, ErrorCode::kDataLoss,
                          {"f.json", "t.chunk_xxh3", "array [\"0123456789abcdef\"]", "a string"}));
  EXPECT_EQ(Describe(json::parse("[1, 2]")), "array [1,2]");  // nothing kept: as before
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
