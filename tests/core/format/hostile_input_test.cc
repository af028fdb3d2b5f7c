// Hostile inputs of issue 25: JSON nested deeper than any reader accepts (refused before a
// recursive parse), aux file names that are paths, NUL and control characters in names,
// many-tensor headers (parsed in linear time), special files instead of regular ones, and
// writes through planted links.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "core/torch_archive.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/format/model_manifest.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/format/safetensors.h"
#include "reshard/format/torch_pickle.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/file_io.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::ThrowsError;

std::string Nested(size_t depth, std::string_view inner = "1") {
  return std::string(depth, '[') + std::string(inner) + std::string(depth, ']');
}

// ---- nesting depth ----------------------------------------------------------------------

TEST(JsonDepth, EveryReaderRefusesDeepNestingBeforeParsing) {
  // 200,000 levels (400 KB) crashed the readers (recursive dump in an error message).
  const std::string deep = Nested(200000);
  const std::vector<std::string_view> needles = {"nested more than 64 levels",
                                                 "at most 64 levels of nesting"};
  const std::string st = test::AssembleSafetensors("{\"w\":" + deep + "}", "");
  EXPECT_TRUE(ThrowsError([&] { ParseSafetensorsHeader(st, st.size(), "deep.safetensors"); },
                          ErrorCode::kDataLoss,
                          {"deep.safetensors", "safetensors header", needles[0], needles[1]}));
  EXPECT_TRUE(ThrowsError([&] { ParseWeightMap("{\"weight_map\":" + deep + "}", "i.json"); },
                          ErrorCode::kDataLoss, {"i.json", "index", needles[0], needles[1]}));
  EXPECT_TRUE(ThrowsError([&] { ParseManifest(deep, "reshard.json"); }, ErrorCode::kDataLoss,
                          {"reshard.json", "manifest", needles[0], needles[1]}));
  EXPECT_TRUE(ThrowsError([&] { ParseModelManifest("{\"x\":" + deep + "}", "m.json"); },
                          ErrorCode::kDataLoss, {"m.json", "model manifest", needles[0]}));
  EXPECT_TRUE(ThrowsError([&] { ParseHeader(deep, 0, "rank.reshard"); }, ErrorCode::kDataLoss,
                          {"rank.reshard", "header", needles[0]}));
  // Objects count as arrays do, and the error says where the 65th level opens.
  std::string objects;
  for (int i = 0; i < 65; ++i) objects += "{\"a\":";
  objects += "1" + std::string(65, '}');
  EXPECT_TRUE(ThrowsError([&] { ParseManifest(objects, "reshard.json"); }, ErrorCode::kDataLoss,
                          {"level 65 opens at byte 320"}));
}

TEST(JsonDepth, SixtyFourLevelsAndBracketsInStringsAreAccepted) {
  // The weight_map object is level 1; 63 more levels inside another member make 64.
  const std::string ok = "{\"metadata\":" + Nested(63) + ",\"weight_map\":{\"w\":\"a.st\"}}";
  EXPECT_EQ(ParseWeightMap(ok, "i.json").at("w"), "a.st");
  const std::string too_deep = "{\"metadata\":" + Nested(64) + ",\"weight_map\":{\"w\":\"a.st\"}}";
  EXPECT_TRUE(ThrowsError([&] { ParseWeightMap(too_deep, "i.json"); }, ErrorCode::kDataLoss,
                          {"level 65"}));
  // Brackets inside strings (escaped quotes too) are not nesting.
  const std::string in_strings = "{\"metadata\":\"" + std::string(1000, '[') + "\\\"" +
                                 std::string(1000, '{') + "\",\"weight_map\":{\"w\":\"a.st\"}}";
  EXPECT_EQ(ParseWeightMap(in_strings, "i.json").at("w"), "a.st");
}

// ---- many tensors: linear parsing -----------------------------------------------------

TEST(ManyTensors, FortyThousandTensorHeaderParses) {
  // 40,000 tensors took 9-12 s (quadratic); no timing is asserted here (bench/ measures it).
  constexpr int kTensors = 40000;
  std::string h = "{";
  for (int i = 0; i < kTensors; ++i) {
    if (i) h += ",";
    h += "\"model.layers." + std::to_string(i) + ".weight\":{\"dtype\":\"U8\",\"shape\":[1],"
         "\"data_offsets\":[" + std::to_string(i) + "," + std::to_string(i + 1) + "]}";
  }
  h += "}";
  const std::string bytes = test::AssembleSafetensors(h, std::string(kTensors, 'x'));
  const SafetensorsFile f = ParseSafetensorsHeader(bytes, bytes.size(), "many.safetensors");
  ASSERT_EQ(f.tensors.size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(f.tensors.back().nbytes, 1u);
  // Still strict: a duplicate among them is found.
  const std::string dup = h.substr(0, h.size() - 1) +
                          ",\"model.layers.7.weight\":{\"dtype\":\"U8\",\"shape\":[0],"
                          "\"data_offsets\":[0,0]}}";
  const std::string dup_bytes = test::AssembleSafetensors(dup, std::string(kTensors, 'x'));
  EXPECT_TRUE(ThrowsError(
      [&] { ParseSafetensorsHeader(dup_bytes, dup_bytes.size(), "many.safetensors"); },
      ErrorCode::kDataLoss, {"duplicate key \"model.layers.7.weight\""}));
}

// ---- names --------------------------------------------------------------------------

Manifest ManifestWithAux(std::vector<std::string> aux) {
  Manifest m;
  m.writer = "reshard test";
  m.source = SourceFingerprint::FromFiles({{"a.safetensors", 10, 0x1111, 0x3333}});
  m.aux_files = std::move(aux);
  return m;
}

TEST(AuxFiles, NamesThatArePathsAreRefused) {
  for (const std::string& bad : std::vector<std::string>{"../../escape", "/etc/passwd", "sub/config.json", "..", ".", "", "a\\b",
        std::string("config.json\0x", 13), "tok\x1b[2J.json", "a\nb", "reshard.json",
        ".reshard.lock", ".reshard.convert"}) {
    SCOPED_TRACE(Printable(bad));
    const std::string text = SerializeManifest(ManifestWithAux({"config.json", bad}));
    EXPECT_TRUE(ThrowsError([&] { ParseManifest(text, "out/reshard.json"); },
                            ErrorCode::kDataLoss,
                            {"out/reshard.json", "aux_files[1]", "found \"",
                             "expected a plain file name"}));
  }
  // Control characters are shown escaped, never raw.
  std::string message;
  const std::string text = SerializeManifest(ManifestWithAux({"x\x1b[31m"}));
  ASSERT_TRUE(ThrowsError([&] { ParseManifest(text, "reshard.json"); }, ErrorCode::kDataLoss,
                          {"\"x\\x1b[31m\""}, &message));
  EXPECT_EQ(message.find('\x1b'), std::string::npos);
  // Plain names, dots and non-ASCII included, are fine.
  const Manifest ok = ParseManifest(
      SerializeManifest(ManifestWithAux({"config.json", "tokenizer.model", ".hidden",
                                         "reshard-model.json", "t\xc3\xa9.json", "..x"})),
      "reshard.json");
  EXPECT_EQ(ok.aux_files.size(), 6u);
}

TEST(WeightMap, NulInsideANameIsRefused) {
  EXPECT_TRUE(ThrowsError(
      [&] {
        ParseWeightMap(R"({"weight_map": {"w": "model.safetensors\u0000.txt"}})", "i.json");
      },
      ErrorCode::kDataLoss,
      {"i.json", "weight_map[\"w\"]", "\"model.safetensors\\x00.txt\"", "a file name"}));
  EXPECT_TRUE(ThrowsError(
      [&] { ParseWeightMap(R"({"weight_map": {"w\u0000x": "model.safetensors"}})", "i.json"); },
      ErrorCode::kDataLoss, {"i.json", "weight_map", "\"w\\x00x\" (a NUL inside)"}));
  EXPECT_TRUE(ThrowsError(
      [&] { ParseWeightMap(R"({"weight_map": {"w": "a\u001b[2J.safetensors"}})", "i.json"); },
      ErrorCode::kDataLoss, {"\"a\\x1b[2J.safetensors\""}));
}

TEST(TensorNames, ControlCharactersAreEscapedInErrors) {
  const std::string h = "{\"evil\\u001b]0;owned\\u0007\":{\"dtype\":\"F128\",\"shape\":[1],"
                        "\"data_offsets\":[0,1]}}";
  const std::string bytes = test::AssembleSafetensors(h, "x");
  std::string message;
  ASSERT_TRUE(ThrowsError([&] { ParseSafetensorsHeader(bytes, bytes.size(), "e.safetensors"); },
                          ErrorCode::kDataLoss,
                          {"tensor \"evil\\x1b]0;owned\\x07\".dtype", "\"F128\""}, &message));
  EXPECT_EQ(message.find('\x1b'), std::string::npos);
  EXPECT_EQ(message.find('\x07'), std::string::npos);
}

// ---- special files and planted links --------------------------------------------------

TEST(SpecialFiles, FifoIsRefusedNotWaitedOn) {
  TempDir dir;
  const fs::path fifo = dir / "model.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  // Without a writer, opening it for reading used to block forever.
  EXPECT_TRUE(ThrowsError([&] { File::OpenRead(fifo); }, ErrorCode::kInvalidArgument,
                          {fifo.string(), "found a FIFO (named pipe)", "expected a regular file"}));
  EXPECT_TRUE(ThrowsError([&] { ReadSafetensorsHeader(fifo.string()); },
                          ErrorCode::kInvalidArgument, {"FIFO"}));
  EXPECT_TRUE(ThrowsError([&] { OpenCheckpoint(dir.path()); }, ErrorCode::kInvalidArgument,
                          {"FIFO"}));
  // Through a symbolic link too; a link to a regular file (the Hugging Face cache) opens.
  fs::create_symlink(fifo, dir / "link.safetensors");
  EXPECT_TRUE(ThrowsError([&] { File::OpenRead(dir / "link.safetensors"); },
                          ErrorCode::kInvalidArgument, {"FIFO"}));
  test::WriteBytes(dir / "blob", "hello");
  fs::create_symlink(dir / "blob", dir / "cached");
  EXPECT_EQ(ReadWholeFile(dir / "cached", 100), "hello");
  EXPECT_TRUE(ThrowsError([&] { File::OpenRead("/dev/null"); }, ErrorCode::kInvalidArgument,
                          {"a character device"}));
}

TEST(PlantedLinks, CreateNeverWritesThroughALink) {
  TempDir dir;
  test::WriteBytes(dir / "victim", "precious");
  fs::create_symlink(dir / "victim", dir / "out.tmp");
  {
    File f = File::Create(dir / "out.tmp");
    f.PWriteExact("new", 3, 0);
  }
  EXPECT_EQ(test::ReadBytes(dir / "victim"), "precious");
  EXPECT_FALSE(fs::is_symlink(dir / "out.tmp"));
  EXPECT_EQ(test::ReadBytes(dir / "out.tmp"), "new");
  // A hard link is not written through either.
  fs::create_hard_link(dir / "victim", dir / "hard");
  WriteFileAtomic(dir / "hard", "replaced");
  EXPECT_EQ(test::ReadBytes(dir / "victim"), "precious");
  EXPECT_EQ(test::ReadBytes(dir / "hard"), "replaced");
  // A symbolic link as the lock file is refused, not followed.
  fs::create_symlink(dir / "victim", dir / ".reshard.lock");
  EXPECT_TRUE(ThrowsError([&] { DirectoryLock lock(dir / ".reshard.lock"); },
                          ErrorCode::kInvalidArgument, {".reshard.lock", "symbolic link"}));
  // Temporaries of WriteFileAtomic have unpredictable names: nothing is left, and two writes
  // do not collide on one name.
  WriteFileAtomic(dir / "a.json", "1");
  WriteFileAtomic(dir / "a.json", "2");
  EXPECT_EQ(test::ReadBytes(dir / "a.json"), "2");
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  }
}

TEST(Permissions, CopiesAreNeverMorePermissiveThanTheSource) {
  TempDir dir;
  const mode_t old_mask = ::umask(0);
  for (const auto& [mode, expected] : std::vector<std::pair<unsigned, unsigned>>{
           {0600, 0600}, {0644, 0644}, {0666, 0644}, {0640, 0640}, {0400, 0400}}) {
    const fs::path src = dir / ("src" + std::to_string(mode));
    test::WriteBytes(src, "secret");
    ::chmod(src.c_str(), mode);
    fs::create_symlink(src, dir / ("link" + std::to_string(mode)));
    EXPECT_EQ(CopyMode(dir / ("link" + std::to_string(mode))), expected) << std::oct << mode;
    const fs::path copy = dir / ("copy" + std::to_string(mode));
    WriteFileAtomic(copy, "secret", CopyMode(src));
    struct stat st;
    ASSERT_EQ(::stat(copy.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, expected) << std::oct << mode;
  }
  ::umask(old_mask);
}

// ---- memory bounds of the pickle reader (item 7) ------------------------------------------

// A state dict of one tensor, as torch.save writes it, without its STOP.
std::string OneTensorPickleBody() {
  test::PickledTensor t;
  t.name = "w";
  t.storage_type = "FloatStorage";
  t.key = "0";
  t.storage_numel = 6;
  t.shape = {2, 3};
  std::string p = test::StateDictPickle({t});
  EXPECT_EQ(p.back(), '.');
  p.pop_back();
  return p;
}

TEST(PickleMemory, MemoFloodIsRefusedAtItsFirstExtraEntry) {
  const std::string body = OneTensorPickleBody();
  ASSERT_NO_THROW(ParseTorchPickle(body + ".", "ok.pkl"));
  // MEMOIZE repeated on the state dict: each a memo entry (~64 bytes) for one byte of file;
  // 50 MB of them took 2.8 GB, 250 MB ended in a bare std::bad_alloc.
  for (const size_t n : {size_t{1000}, size_t{50} << 20}) {
    std::string flood = body;
    flood.append(n, static_cast<char>(0x94));
    flood += '.';
    EXPECT_TRUE(ThrowsError([&] { ParseTorchPickle(flood, "flood.pkl"); }, ErrorCode::kUnsupported,
                            {"flood.pkl", "at byte", "memo entry", "objects built",
                             "at most one memo entry per object", "memo flood"}))
        << n;
  }
  // LONG_BINPUT under ever new keys: the same rule.
  std::string puts = body;
  for (uint32_t k = 0; k < 1000; ++k) {
    puts += 'r';
    for (int b = 0; b < 4; ++b) puts += static_cast<char>(((k + 1000) >> (8 * b)) & 0xFF);
  }
  puts += '.';
  EXPECT_TRUE(ThrowsError([&] { ParseTorchPickle(puts, "puts.pkl"); }, ErrorCode::kUnsupported,
                          {"puts.pkl", "memo flood"}));
  // Overwriting one key is not a flood.
  std::string same = body;
  for (int k = 0; k < 1000; ++k) same += "q\x01";
  same += '.';
  EXPECT_NO_THROW(ParseTorchPickle(same, "same.pkl"));
}

TEST(PickleMemory, ObjectFloodStopsAtTheMemoryLimit) {
  // 8 M empty tuples (one byte each): ~1.3 GiB of objects as the reader holds them.
  std::string flood = "\x80\x02";
  flood.append(8u << 20, ')');
  flood += '.';
  EXPECT_TRUE(ThrowsError([&] { ParseTorchPickle(flood, "objects.pkl"); },
                          ErrorCode::kUnsupported,
                          {"objects.pkl", "at byte", "needs more than 1024 MiB of memory",
                           "objects", "kTorchPickleMaxMemory"}));
}

// ---- concurrent conversions of different sources (item 4) ---------------------------------

TEST(SharedClaim, OneOwnerSharesItAnotherIsRefusedUntilItIsReleased) {
  TempDir dir;
  const fs::path file = dir / ".reshard.convert";
  std::string owner, by;
  std::optional<SharedClaim> a = SharedClaim::Take(file, "aaaa", "convert A, pid 1", &owner, &by);
  ASSERT_TRUE(a);
  // The same owner shares it (flock is per open file: a second open in this process is
  // another holder, as another process would be).
  std::optional<SharedClaim> a2 = SharedClaim::Take(file, "aaaa", "convert A', pid 2", &owner, &by);
  ASSERT_TRUE(a2);
  EXPECT_FALSE(SharedClaim::Take(file, "bbbb", "convert B", &owner, &by));
  EXPECT_EQ(owner, "aaaa");
  EXPECT_EQ(by, "convert A, pid 1");
  a.reset();
  EXPECT_FALSE(SharedClaim::Take(file, "bbbb", "convert B", &owner, &by));  // A' still holds it
  a2.reset();
  // Released (or its holders died): the next owner takes it over and is named in it.
  std::optional<SharedClaim> b = SharedClaim::Take(file, "bbbb", "convert B, pid 3", &owner, &by);
  ASSERT_TRUE(b);
  EXPECT_FALSE(SharedClaim::Take(file, "aaaa", "convert A", &owner, &by));
  EXPECT_EQ(owner, "bbbb");
  EXPECT_EQ(by, "convert B, pid 3");
  b.reset();
  // A planted link is refused, not followed.
  fs::remove(file);
  fs::create_symlink(dir / "elsewhere", file);
  EXPECT_TRUE(ThrowsError([&] { SharedClaim::Take(file, "aaaa", "A", &owner, &by); },
                          ErrorCode::kInvalidArgument, {file.string(), "symbolic link"}));
  EXPECT_FALSE(fs::exists(dir / "elsewhere"));
}

}  // namespace
}  // namespace reshard
