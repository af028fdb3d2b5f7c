#include <algorithm>
#include <nlohmann/json.hpp>
// safetensors headers (R29) and checkpoint directories (R30): a valid file parses to the
// values the test wrote; each deliberately broken file is rejected with its own error that
// names the file and the field.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/safetensors.h"
#include "reshard/io/checkpoint.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::ojson;
using test::TempDir;
using test::TensorSpec;
using test::ThrowsError;

// Two tensors: "a" F32 [2, 3] (24 bytes) then "b" BF16 [4] (8 bytes).
std::vector<TensorSpec> TwoTensors() {
  return {test::MakeTensor("a", "F32", {2, 3}, 1), test::MakeTensor("b", "BF16", {4}, 2)};
}

class SafetensorsTest : public ::testing::Test {
 protected:
  // Writes `bytes` to a file and parses it, expecting kDataLoss naming the file and `needles`.
  ::testing::AssertionResult Rejects(const std::string& bytes,
                                     std::initializer_list<std::string_view> needles) {
    const std::string path = (dir_ / "broken.safetensors").string();
    test::WriteBytes(path, bytes);
    auto r = ThrowsError([&] { ReadSafetensorsHeader(path); }, ErrorCode::kDataLoss, needles);
    if (!r) return r;
    return ThrowsError([&] { ReadSafetensorsHeader(path); }, ErrorCode::kDataLoss, {path});
  }
  // A file made of `header_text` and `data` with the right length field.
  ::testing::AssertionResult RejectsHeader(const std::string& header_text, const std::string& data,
                                           std::initializer_list<std::string_view> needles) {
    return Rejects(test::AssembleSafetensors(header_text, data), needles);
  }
  ::testing::AssertionResult RejectsMutation(const std::function<void(ojson&)>& mutate,
                                             std::initializer_list<std::string_view> needles,
                                             const std::string& extra_data = "") {
    std::string bytes = test::SafetensorsBytes(TwoTensors(), mutate);
    return Rejects(bytes + extra_data, needles);
  }
  TempDir dir_;
};

TEST_F(SafetensorsTest, ValidFileParses) {
  std::vector<TensorSpec> ts = {
      test::MakeTensor("w", "F32", {2, 3}, 1),  // 24 B
      test::MakeTensor("s", "BF16", {}, 2),     // 0-dim, 2 B
      test::MakeTensor("e", "I64", {0, 7}, 3),  // empty
      test::MakeTensor("u", "U8", {5}, 4),      // 5 B
  };
  ojson h = test::SafetensorsHeader(ts, std::map<std::string, std::string>{{"format", "pt"}});
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';
  const std::string bytes = test::AssembleSafetensors(text, test::SafetensorsData(ts));
  const std::string path = (dir_ / "model.safetensors").string();
  test::WriteBytes(path, bytes);

  const SafetensorsFile f = ReadSafetensorsHeader(path);
  const uint64_t n = text.size();
  EXPECT_EQ(f.path, path);
  EXPECT_EQ(f.file_size, bytes.size());
  EXPECT_EQ(f.header_size, n);
  EXPECT_EQ(f.header_xxh3, test::RefXxh3(std::string_view(bytes).substr(0, 8 + n)));
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(f.tensors.size(), 4u);
  // Sorted by offset; the empty tensor at offset 26 sorts before "u" at 26.
  EXPECT_EQ(f.tensors[0].name, "w");
  EXPECT_EQ(f.tensors[0].dtype, DType::kF32);
  EXPECT_EQ(f.tensors[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(f.tensors[0].offset, 8 + n);
  EXPECT_EQ(f.tensors[0].nbytes, 24u);
  EXPECT_EQ(f.tensors[1].name, "s");
  EXPECT_TRUE(f.tensors[1].shape.empty());
  EXPECT_EQ(f.tensors[1].offset, 8 + n + 24);
  EXPECT_EQ(f.tensors[1].nbytes, 2u);
  EXPECT_EQ(f.tensors[2].name, "e");
  EXPECT_EQ(f.tensors[2].shape, (std::vector<uint64_t>{0, 7}));
  EXPECT_EQ(f.tensors[2].offset, 8 + n + 26);
  EXPECT_EQ(f.tensors[2].nbytes, 0u);
  EXPECT_EQ(f.tensors[3].name, "u");
  EXPECT_EQ(f.tensors[3].offset, 8 + n + 26);
  EXPECT_EQ(f.tensors[3].nbytes, 5u);
  // The absolute offsets really point at the bytes written.
  EXPECT_EQ(bytes.substr(f.tensors[3].offset, 5), ts[3].data);
  EXPECT_EQ(bytes.substr(f.tensors[0].offset, 24), ts[0].data);
}

TEST_F(SafetensorsTest, EveryDtypeNameParsesWithItsSize) {
  const std::vector<std::pair<std::string, DType>> names = {
      {"BOOL", DType::kBool}, {"U8", DType::kU8},     {"I8", DType::kI8},
      {"I16", DType::kI16},   {"U16", DType::kU16},   {"F16", DType::kF16},
      {"BF16", DType::kBF16}, {"I32", DType::kI32},   {"U32", DType::kU32},
      {"F32", DType::kF32},   {"F64", DType::kF64},   {"I64", DType::kI64},
      {"U64", DType::kU64},   {"C64", DType::kC64},   {"F8_E4M3", DType::kF8_E4M3},
      {"F8_E5M2", DType::kF8_E5M2}, {"F8_E8M0", DType::kF8_E8M0},
      {"F6_E2M3", DType::kF6_E2M3}, {"F6_E3M2", DType::kF6_E3M2}, {"F4", DType::kF4}};
  std::vector<TensorSpec> ts;
  for (size_t i = 0; i < names.size(); ++i) {
    ts.push_back(test::MakeTensor("t" + std::to_string(i), names[i].first, {4, 2}, i));
  }
  const std::string path = (dir_ / "all.safetensors").string();
  test::WriteBytes(path, test::SafetensorsBytes(ts));
  const SafetensorsFile f = ReadSafetensorsHeader(path);
  ASSERT_EQ(f.tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i].first);
    EXPECT_EQ(f.tensors[i].name, "t" + std::to_string(i));
    EXPECT_EQ(f.tensors[i].dtype, names[i].second);
    EXPECT_EQ(f.tensors[i].nbytes, 8 * test::DtypeBits(names[i].first) / 8);
  }
}

TEST_F(SafetensorsTest, EmptyHeaderObjectIsAValidFile) {
  const std::string path = (dir_ / "empty.safetensors").string();
  test::WriteBytes(path, test::AssembleSafetensors("{}      ", ""));
  const SafetensorsFile f = ReadSafetensorsHeader(path);
  EXPECT_TRUE(f.tensors.empty());
  EXPECT_EQ(f.header_size, 8u);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  const std::string path = (dir_ / "absent.safetensors").string();
  EXPECT_TRUE(ThrowsError([&] { ReadSafetensorsHeader(path); }, ErrorCode::kNotFound, {path}));
}

TEST_F(SafetensorsTest, FileShorterThanEightBytes) {
  EXPECT_TRUE(Rejects(std::string("\x10\0\0\0\0", 5), {"header length", "a file of 5 bytes"}));
  EXPECT_TRUE(Rejects("", {"header length", "a file of 0 bytes"}));
}

TEST_F(SafetensorsTest, HeaderLengthOver100MB) {
  EXPECT_TRUE(Rejects(test::AssembleSafetensors("{}", "", 100000001), {"header length", "100000001", "at most 100000000"}));
  // A length near 2^64 must not wrap around when added to 8.
  EXPECT_TRUE(Rejects(test::AssembleSafetensors("{}", "", std::numeric_limits<uint64_t>::max()),
                      {"header length", "18446744073709551615"}));
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string full = test::SafetensorsBytes(TwoTensors());
  EXPECT_TRUE(Rejects(full.substr(0, 30), {"header length", "truncated"}));
  EXPECT_TRUE(Rejects(test::AssembleSafetensors("{}", "", 3), {"header length", "truncated"}));
}

TEST_F(SafetensorsTest, HeaderLengthBelowTwo) {
  EXPECT_TRUE(Rejects(test::AssembleSafetensors("", "xyz"), {"header length", "found 0"}));
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  EXPECT_TRUE(RejectsHeader("{\"a\": {\"dtype\": \"F32\",", "", {"safetensors header is not valid JSON"}));
  EXPECT_TRUE(RejectsHeader("{} trailing", "", {"not valid JSON"}));
  // Invalid UTF-8 in a key.
  EXPECT_TRUE(RejectsHeader("{\"\xff\": 1}", "", {"not valid JSON"}));
}

TEST_F(SafetensorsTest, HeaderNotAnObject) {
  EXPECT_TRUE(RejectsHeader("[1, 2]", "", {": header: found array", "a JSON object"}));
  EXPECT_TRUE(RejectsHeader("\"text\"", "", {"header: found string"}));
}

TEST_F(SafetensorsTest, DuplicateKey) {
  const std::string e = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  EXPECT_TRUE(RejectsHeader("{\"a\":" + e + ",\"a\":" + e + "}", "x", {"duplicate key \"a\""}));
  // Also inside a tensor entry.
  EXPECT_TRUE(RejectsHeader(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                            "x", {"duplicate key \"dtype\""}));
}

TEST_F(SafetensorsTest, UnknownDtype) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["dtype"] = "F17"; },
                              {"tensor \"a\".dtype", "found \"F17\""}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["dtype"] = "f32"; },
                              {"tensor \"a\".dtype", "found \"f32\""}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["dtype"] = 32; },
                              {"tensor \"a\".dtype", "a string"}));
}

TEST_F(SafetensorsTest, ShapeWithBadDims) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = {-2, -3}; },
                              {"tensor \"a\".shape[0]", "a non-negative integer"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = {2, 3.0}; },
                              {"tensor \"a\".shape[1]", "a non-negative integer"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = {"2", 3}; },
                              {"tensor \"a\".shape[0]", "found string"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = 6; },
                              {"tensor \"a\".shape", "an array"}));
}

TEST_F(SafetensorsTest, ShapeElementCountOverflows) {
  EXPECT_TRUE(RejectsMutation(
      [](ojson& h) { h["a"]["shape"] = {uint64_t{1} << 32, uint64_t{1} << 32, 2}; },
      {"tensor \"a\".shape", "overflow"}));
  // numel fits in u64 but numel × 4 bytes does not.
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = {uint64_t{1} << 62}; },
                              {"tensor \"a\".shape", "without overflow"}));
}

TEST_F(SafetensorsTest, DataOffsetsWrongArity) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["data_offsets"] = {0}; },
                              {"tensor \"a\".data_offsets", "[begin, end]"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["data_offsets"] = {0, 12, 24}; },
                              {"tensor \"a\".data_offsets", "[begin, end]"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["data_offsets"] = {0, -24}; },
                              {"tensor \"a\".data_offsets[1]", "non-negative"}));
}

TEST_F(SafetensorsTest, DataOffsetsEndBeforeBegin) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["data_offsets"] = {24, 0}; },
                              {"tensor \"a\".data_offsets", "[24, 0]", "begin <= end"}));
}

TEST_F(SafetensorsTest, DataOffsetsSizeNotNumelTimesItemsize) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["shape"] = {2, 2}; },
                              {"tensor \"a\".data_offsets", "found 24 bytes", "16 bytes (4 elements of F32)"}));
}

TEST_F(SafetensorsTest, DataOffsetsPastEndOfFile) {
  // "b" claims [24, 32) correctly sized, but the file holds only 28 data bytes.
  std::string bytes = test::SafetensorsBytes(TwoTensors());
  EXPECT_TRUE(Rejects(bytes.substr(0, bytes.size() - 4),
                      {"tensor \"b\".data_offsets", "end 32 past the data (28 bytes)"}));
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  // "b" moved to [16, 24): inside "a"; the data is still 32 bytes so the overlap is the
  // first thing wrong.
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["b"]["data_offsets"] = {16, 24}; },
                              {"tensor \"b\".data_offsets", "overlapping \"a\""}));
}

TEST_F(SafetensorsTest, HoleBetweenTensors) {
  EXPECT_TRUE(RejectsMutation(
      [](ojson& h) { h["b"]["data_offsets"] = {28, 36}; },
      {"tensor \"b\".data_offsets", "hole after \"a\" at 24"}, std::string(4, 'x')));
  // A hole before the first tensor.
  EXPECT_TRUE(RejectsMutation(
      [](ojson& h) {
        h["a"]["data_offsets"] = {4, 28};
        h["b"]["data_offsets"] = {28, 36};
      },
      {"tensor \"a\".data_offsets", "hole after the header"}, std::string(4, 'x')));
}

TEST_F(SafetensorsTest, TrailingBytesNotCovered) {
  EXPECT_TRUE(RejectsMutation([](ojson&) {}, {"data size", "36 bytes after the header", "cover 32"},
                              std::string(4, 'x')));
}

TEST_F(SafetensorsTest, MetadataNotAnObject) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["__metadata__"] = "pt"; },
                              {"__metadata__", "an object"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["__metadata__"] = {{"format", "pt"}, {"n", 1}}; },
                              {"__metadata__.n", "a string"}));
}

TEST_F(SafetensorsTest, UnknownKeyInTensorEntry) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"]["offsets"] = {0, 24}; },
                              {"tensor \"a\"", "unknown key \"offsets\""}));
}

TEST_F(SafetensorsTest, TensorEntryNotAnObjectOrIncomplete) {
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"] = 24; }, {"tensor \"a\"", "an object"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["a"].erase("dtype"); },
                              {"tensor \"a\".dtype", "found nothing"}));
  EXPECT_TRUE(RejectsMutation([](ojson& h) { h["b"].erase("data_offsets"); },
                              {"tensor \"b\".data_offsets", "found nothing"}));
}

TEST_F(SafetensorsTest, ZeroDimAndEmptyTensorsAreLegalAnywhere) {
  // An empty tensor at the very end and one at the very start, a 0-dim in between.
  std::vector<TensorSpec> ts = {test::MakeTensor("e0", "F32", {0}, 1),
                                test::MakeTensor("s", "F64", {}, 2),
                                test::MakeTensor("e1", "BF16", {3, 0, 2}, 3)};
  const std::string path = (dir_ / "x.safetensors").string();
  test::WriteBytes(path, test::SafetensorsBytes(ts));
  const SafetensorsFile f = ReadSafetensorsHeader(path);
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors[0].name, "e0");
  EXPECT_EQ(f.tensors[1].name, "s");
  EXPECT_EQ(f.tensors[1].nbytes, 8u);
  EXPECT_EQ(f.tensors[2].name, "e1");
  EXPECT_EQ(f.tensors[2].nbytes, 0u);
  EXPECT_EQ(f.tensors[2].offset, f.file_size);
}

// ---- checkpoints (R30) -------------------------------------------------------------------

class CheckpointTest : public ::testing::Test {
 protected:
  fs::path Src() const { return dir_ / "src"; }
  fs::path Index() const { return Src() / "model.safetensors.index.json"; }
  void WriteIndex(const ojson& weight_map) {
    test::WriteBytes(Index(), ojson{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump());
  }
  TempDir dir_;
};

TEST_F(CheckpointTest, ShardedCheckpointOpensWithIndependentFingerprint) {
  auto files = test::AwkwardCheckpointFiles(1);
  const auto tensors = test::WriteShardedCheckpoint(Src(), files);
  test::WriteBytes(Src() / "config.json", "{}");
  test::WriteBytes(Src() / "tokenizer.json", "{}");
  const Checkpoint ckpt = OpenCheckpoint(Src());
  EXPECT_EQ(ckpt.index_file, "model.safetensors.index.json");
  EXPECT_EQ(ckpt.aux_files, (std::vector<std::string>{"config.json", "tokenizer.json"}));
  ASSERT_EQ(ckpt.files.size(), 3u);
  ASSERT_EQ(ckpt.tensors.size(), tensors.size());
  // Sorted by name, each at the bytes the test wrote.
  size_t i = 0;
  for (const auto& [name, spec] : tensors) {
    const SourceTensor& t = ckpt.tensors[i++];
    ASSERT_EQ(t.name, name);
    EXPECT_EQ(ckpt.Find(name), &t);
    EXPECT_EQ(Name(t.dtype), spec.dtype);
    EXPECT_EQ(t.shape, spec.shape);
    EXPECT_EQ(t.nbytes, spec.data.size());
    const std::string file = test::ReadBytes(ckpt.files[t.file_index].path);
    EXPECT_EQ(file.substr(t.offset, t.nbytes), spec.data) << name;
  }
  EXPECT_EQ(ckpt.Find("no.such.tensor"), nullptr);
  // Fingerprint by the spec: name \0 size \0 hex16(xxh3(8 + N bytes)) \0 hex16(xxh3(sample))
  // \n per file, sorted; the sample is the first and last min(4096, nbytes) bytes of each
  // tensor in data-offset order.
  std::string canonical;
  for (const char* name : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors"}) {
    const std::string bytes = test::ReadBytes(Src() / name);
    const uint64_t n = test::Le64(bytes, 0);
    const auto header = nlohmann::json::parse(bytes.substr(8, n));
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    for (const auto& [k, v] : header.items()) {
      if (k != "__metadata__") spans.emplace_back(v["data_offsets"][0], v["data_offsets"][1]);
    }
    std::sort(spans.begin(), spans.end());
    std::string sample;
    for (const auto& [b, e] : spans) {
      const uint64_t k = std::min<uint64_t>(4096, e - b);
      sample += bytes.substr(8 + n + b, k) + bytes.substr(8 + n + e - k, k);
    }
    canonical += std::string(name) + '\0' + std::to_string(bytes.size()) + '\0' +
                 test::RefHex16(test::RefXxh3(std::string_view(bytes).substr(0, 8 + n))) + '\0' +
                 test::RefHex16(test::RefXxh3(sample)) + "\n";
  }
  EXPECT_EQ(ckpt.fingerprint.fingerprint, test::RefXxh3(canonical));
  ASSERT_EQ(ckpt.fingerprint.files.size(), 3u);
  EXPECT_EQ(ckpt.fingerprint.files[1].name, "model-00002-of-00003.safetensors");
}

TEST_F(CheckpointTest, SingleFileAndDirectoryWithOneFile) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "weights.safetensors", test::SafetensorsBytes(TwoTensors()));
  const Checkpoint by_dir = OpenCheckpoint(Src());
  const Checkpoint by_file = OpenCheckpoint(Src() / "weights.safetensors");
  EXPECT_EQ(by_dir.tensors.size(), 2u);
  EXPECT_EQ(by_file.tensors.size(), 2u);
  EXPECT_TRUE(by_dir.fingerprint == by_file.fingerprint);
  EXPECT_EQ(by_dir.index_file, "");
}

TEST_F(CheckpointTest, IndexPointingAtMissingFile) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "a.safetensors", test::SafetensorsBytes(TwoTensors()));
  WriteIndex({{"a", "a.safetensors"}, {"b", "a.safetensors"}, {"c", "gone.safetensors"}});
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kNotFound,
                          {Index().string(), "weight_map[\"c\"]", "gone.safetensors", "does not exist"}));
}

TEST_F(CheckpointTest, IndexKeyMissingFromItsFile) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "a.safetensors", test::SafetensorsBytes(TwoTensors()));
  WriteIndex({{"a", "a.safetensors"}, {"b", "a.safetensors"}, {"ghost", "a.safetensors"}});
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {Index().string(), "weight_map[\"ghost\"]", "has no tensor \"ghost\""}));
}

TEST_F(CheckpointTest, IndexWithEmptyWeightMap) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "a.safetensors", test::SafetensorsBytes(TwoTensors()));
  WriteIndex(ojson::object());
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {Index().string(), "weight_map", "an empty map"}));
}

TEST_F(CheckpointTest, IndexNotJsonOrWithoutWeightMap) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "a.safetensors", test::SafetensorsBytes(TwoTensors()));
  test::WriteBytes(Index(), "{\"weight_map\": {\"a\": ");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {Index().string(), "index is not valid JSON"}));
  test::WriteBytes(Index(), "{\"metadata\": {}}");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {Index().string(), "index.weight_map", "found nothing"}));
  test::WriteBytes(Index(), "{\"weight_map\": {\"a\": \"../a.safetensors\"}}");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {"weight_map[\"a\"]", "a file name in the checkpoint directory"}));
  test::WriteBytes(Index(), "{\"weight_map\": {\"a\": 3}}");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {"weight_map[\"a\"]", "a string"}));
}

TEST_F(CheckpointTest, KeyPresentInTwoFilesIsTakenFromTheIndexOnly) {
  // R30: trust only weight_map. "a" is in both files with different bytes; the index puts it
  // in the second one, so the first one's copy must not be used.
  fs::create_directories(Src());
  TensorSpec a1 = test::MakeTensor("a", "F32", {2, 3}, 10);
  TensorSpec a2 = test::MakeTensor("a", "F32", {2, 3}, 20);
  TensorSpec b = test::MakeTensor("b", "BF16", {4}, 30);
  test::WriteBytes(Src() / "one.safetensors", test::SafetensorsBytes({a1, b}));
  test::WriteBytes(Src() / "two.safetensors", test::SafetensorsBytes({a2}));
  WriteIndex({{"a", "two.safetensors"}, {"b", "one.safetensors"}});
  const Checkpoint ckpt = OpenCheckpoint(Src());
  ASSERT_EQ(ckpt.tensors.size(), 2u);
  const SourceTensor* a = ckpt.Find("a");
  ASSERT_NE(a, nullptr);
  const std::string file = test::ReadBytes(ckpt.files[a->file_index].path);
  EXPECT_EQ(fs::path(ckpt.files[a->file_index].path).filename(), "two.safetensors");
  EXPECT_EQ(file.substr(a->offset, a->nbytes), a2.data);
}

TEST_F(CheckpointTest, BrokenShardIsNamed) {
  auto files = test::AwkwardCheckpointFiles(2);
  test::WriteShardedCheckpoint(Src(), files);
  const fs::path victim = Src() / "model-00002-of-00003.safetensors";
  std::string bytes = test::ReadBytes(victim);
  test::WriteBytes(victim, bytes.substr(0, bytes.size() - 1));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {victim.string(), "past the data"}));
}

TEST_F(CheckpointTest, DirectoryWithoutCheckpointIsNotFound) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "config.json", "{}");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kNotFound,
                          {Src().string(), "not a Hugging Face checkpoint"}));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(dir_ / "nothing"); }, ErrorCode::kNotFound,
                          {"nothing", "no such file"}));
}

// pytorch_model.bin is read (torch_zip_test.cc); a broken one is corrupt input, and a file
// of another kind is refused by its extension.
TEST_F(CheckpointTest, BrokenPytorchBinIsDataLoss) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "pytorch_model.bin", "PK\3\4");
  const std::string bin = (Src() / "pytorch_model.bin").string();
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {bin, "ZIP archive", "a file of 4 bytes"}));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src() / "pytorch_model.bin"); },
                          ErrorCode::kDataLoss, {bin}));
  test::WriteBytes(Src() / "weights.npz", "PK\3\4");
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src() / "weights.npz"); },
                          ErrorCode::kUnsupported, {"neither a .safetensors file"}));
}

TEST_F(CheckpointTest, SeveralFilesWithoutIndexAreAmbiguous) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "x.safetensors", test::SafetensorsBytes(TwoTensors()));
  test::WriteBytes(Src() / "y.safetensors", test::SafetensorsBytes(TwoTensors()));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {"2 .safetensors files", "model.safetensors.index.json"}));
}

TEST_F(CheckpointTest, CheckpointWithoutTensors) {
  fs::create_directories(Src());
  test::WriteBytes(Src() / "model.safetensors", test::AssembleSafetensors("{}", ""));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(Src()); }, ErrorCode::kDataLoss,
                          {"holds no tensors"}));
}

}  // namespace
}  // namespace reshard
