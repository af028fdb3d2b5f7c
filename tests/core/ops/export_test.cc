// Export end to end on generated checkpoints: convert → export must give back every source
// tensor byte for byte, in files laid out as safetensors' save_file writes them (the expected
// bytes are assembled here from the test's own safetensors writer and its own table of the
// safetensors dtype order), grouped as huggingface_hub groups shards; corrupt, incomplete or
// ambiguous inputs and occupied outputs are refused; an interrupted export leaves no output.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/dtype_convert.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/export.h"
#include "reshard/plan/layout_tensors.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::ojson;
using test::TempDir;
using test::ThrowsError;

// safetensors 0.8.0's Dtype enum, ascending (it writes by descending rank, then name).
const std::vector<std::string>& SafetensorsDtypeOrder() {
  static const std::vector<std::string> order = {
      "BOOL", "F4",  "F6_E2M3", "F6_E3M2", "U8",  "I8",  "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16",
      "U16",  "F16", "BF16",    "I32",     "U32", "F32", "C64",     "F64",     "I64",     "U64"};
  return order;
}

size_t DtypeRank(const std::string& d) {
  const auto& o = SafetensorsDtypeOrder();
  return std::find(o.begin(), o.end(), d) - o.begin();
}

std::vector<test::TensorSpec> InSafetensorsOrder(std::vector<test::TensorSpec> t) {
  std::sort(t.begin(), t.end(), [](const test::TensorSpec& a, const test::TensorSpec& b) {
    const size_t ra = DtypeRank(a.dtype), rb = DtypeRank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });
  return t;
}

// What safetensors.torch.save_file(tensors, metadata={"format": "pt"}) writes.
std::string ExpectedFile(const std::vector<test::TensorSpec>& tensors) {
  const auto sorted = InSafetensorsOrder(tensors);
  std::string text =
      test::SafetensorsHeader(sorted, std::map<std::string, std::string>{{"format", "pt"}}).dump();
  while (text.size() % 8 != 0) text += ' ';
  return test::AssembleSafetensors(text, test::SafetensorsData(sorted));
}

// The huggingface_hub grouping, written out independently: greedy in order; an oversized
// tensor is a shard of its own, appended when met.
std::vector<std::vector<std::string>> ExpectedShards(const std::vector<test::TensorSpec>& order,
                                                     uint64_t max) {
  std::vector<std::vector<std::string>> shards;
  std::vector<std::string> cur;
  uint64_t size = 0;
  for (const auto& t : order) {
    const uint64_t n = t.data.size();
    if (n > max) {
      shards.push_back({t.name});
      continue;
    }
    if (size + n > max) {
      shards.push_back(cur);
      cur.clear();
      size = 0;
    }
    cur.push_back(t.name);
    size += n;
  }
  if (!cur.empty()) shards.push_back(cur);
  return shards;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    files_ = test::AwkwardCheckpointFiles(11);
    tensors_ = test::WriteShardedCheckpoint(Src(), files_);
    test::WriteBytes(Src() / "config.json", "{\"model_type\": \"test\"}");
    test::WriteBytes(Src() / "tokenizer.json", "{\"version\": \"1.0\"}");
    for (const auto& f : files_) order_.insert(order_.end(), f.begin(), f.end());
  }

  fs::path Src() const { return dir_ / "src"; }
  fs::path Out() const { return dir_ / "out"; }
  fs::path Hf() const { return dir_ / "hf"; }

  ConvertResult Convert(uint32_t ws, Codec codec = Codec::kRaw, std::string dtype = "keep",
                        std::optional<std::pair<uint32_t, uint32_t>> ranks = std::nullopt) {
    ConvertOptions o;
    o.source = Src();
    o.out = Out();
    o.layout.world_size = ws;
    o.layout.dtype = dtype;
    o.threads = 2;
    o.codec = codec;
    o.chunk_size = 4096;
    o.ranks = ranks;
    return reshard::Convert(o);
  }

  ExportOptions Options(std::string layout = "") const {
    ExportOptions o;
    o.out = Out();
    o.hf_dir = Hf();
    o.layout = std::move(layout);
    o.threads = 2;
    return o;
  }

  std::vector<std::string> Leftovers() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(dir_.path())) {
      const std::string n = e.path().filename().string();
      if (n.find("export-tmp") != std::string::npos) v.push_back(n);
    }
    return v;
  }

  // One model.safetensors equal to save_file of every source tensor, plus the aux files.
  void ExpectSingleFileRoundTrip() {
    EXPECT_EQ(test::ListFiles(Hf()),
              (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
    EXPECT_TRUE(test::SameBytes(test::ReadBytes(Hf() / "model.safetensors"), ExpectedFile(order_)));
    EXPECT_EQ(test::ReadBytes(Hf() / "config.json"), test::ReadBytes(Src() / "config.json"));
    EXPECT_EQ(test::ReadBytes(Hf() / "tokenizer.json"), test::ReadBytes(Src() / "tokenizer.json"));
    EXPECT_TRUE(Leftovers().empty());
  }

  TempDir dir_;
  std::vector<std::vector<test::TensorSpec>> files_;
  std::vector<test::TensorSpec> order_;  // the source's order: file, then offset
  test::TensorMap tensors_;
};

TEST_F(ExportTest, RoundTripAtSeveralWorldSizes) {
  for (uint32_t ws : {1u, 3u, 8u}) {
    SCOPED_TRACE("world size " + std::to_string(ws));
    fs::remove_all(Out());
    fs::remove_all(Hf());
    Convert(ws);
    const ExportResult r = Export(Options());
    EXPECT_EQ(r.layout_key, "fsdp2-ws" + std::to_string(ws));
    EXPECT_FALSE(r.sharded);
    EXPECT_EQ(r.weight_files, std::vector<std::string>{"model.safetensors"});
    EXPECT_EQ(r.tensors, tensors_.size());
    uint64_t total = 0;
    for (const auto& [_, t] : tensors_) total += t.data.size();
    EXPECT_EQ(r.total_size, total);
    EXPECT_EQ(r.bytes_read, total);
    ExpectSingleFileRoundTrip();
  }
}

TEST_F(ExportTest, ZstdLayoutRoundTrips) {
  Convert(5, Codec::kZstd);
  Export(Options());
  ExpectSingleFileRoundTrip();
}

TEST_F(ExportTest, OneThreadGivesTheSameBytes) {
  Convert(3);
  ExportOptions o = Options();
  o.threads = 1;
  Export(o);
  ExpectSingleFileRoundTrip();
}

TEST_F(ExportTest, MaxShardSizeSplitsLikeSavePretrained) {
  Convert(3);
  // 7000 bytes: the 7200-byte F32, 8710-byte F8 and 9000-byte U8 tensors are over the limit
  // and get shards of their own; the others are packed greedily in source order.
  const uint64_t max = 7000;
  const auto expected = ExpectedShards(order_, max);
  ASSERT_GE(expected.size(), 4u);
  ExportOptions o = Options();
  o.max_shard_size = max;
  const ExportResult r = Export(o);
  EXPECT_TRUE(r.sharded);
  ASSERT_EQ(r.weight_files.size(), expected.size());
  ojson weight_map = ojson::object();
  std::map<std::string, std::string> by_name;
  for (size_t i = 0; i < expected.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, expected.size());
    EXPECT_EQ(r.weight_files[i], name);
    std::vector<test::TensorSpec> shard;
    for (const auto& n : expected[i]) {
      shard.push_back(tensors_.at(n));
      by_name[n] = name;
    }
    EXPECT_TRUE(test::SameBytes(test::ReadBytes(Hf() / name), ExpectedFile(shard))) << name;
  }
  uint64_t total = 0;
  for (const auto& [_, t] : tensors_) total += t.data.size();
  // json.dumps(index, indent=2, sort_keys=True) + "\n": keys sorted, two-space indent.
  for (const auto& [n, f] : by_name) weight_map[n] = f;
  const ojson index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  EXPECT_EQ(test::ReadBytes(Hf() / "model.safetensors.index.json"), index.dump(2) + "\n");
  EXPECT_FALSE(fs::exists(Hf() / "model.safetensors"));
}

TEST_F(ExportTest, SplitIntoShardsMatchesHuggingfaceHub) {
  // The example of huggingface_hub's docstring: [6, 6, 2, 6, 2, 2] GB with a 10 GB limit.
  EXPECT_EQ(SplitIntoShards({6, 6, 2, 6, 2, 2}, 10),
            (std::vector<std::vector<size_t>>{{0}, {1, 2}, {3, 4, 5}}));
  // A tensor over the limit is a shard of its own, before the shard being filled.
  EXPECT_EQ(SplitIntoShards({1, 20, 1}, 5), (std::vector<std::vector<size_t>>{{1}, {0, 2}}));
  EXPECT_EQ(SplitIntoShards({5, 5}, 5), (std::vector<std::vector<size_t>>{{0}, {1}}));
  EXPECT_EQ(SplitIntoShards({0, 0}, 1), (std::vector<std::vector<size_t>>{{0, 1}}));
  EXPECT_TRUE(SplitIntoShards({}, 5).empty());
}

TEST_F(ExportTest, ParseMaxShardSize) {
  EXPECT_EQ(ParseMaxShardSize("5GB"), 5'000'000'000u);
  EXPECT_EQ(ParseMaxShardSize("500mb"), 500'000'000u);
  EXPECT_EQ(ParseMaxShardSize("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(ParseMaxShardSize(" 10 KB "), 10'000u);
  EXPECT_EQ(ParseMaxShardSize("2TB"), 2'000'000'000'000u);
  EXPECT_EQ(ParseMaxShardSize("1048576"), 1048576u);
  for (const char* bad : {"", "0", "0GB", "GB", "5GiB", "5G", "-5GB", "five GB", "1.2.3MB", "5 XB"}) {
    EXPECT_FALSE(ParseMaxShardSize(bad).has_value()) << bad;
  }
}

TEST_F(ExportTest, DtypeConversionAsTensorTo) {
  Convert(3);
  ExportOptions o = Options();
  o.dtype = "fp32";
  Export(o);
  std::vector<test::TensorSpec> expected;
  for (const auto& t : order_) {
    test::TensorSpec e = t;
    if (t.dtype == "BF16") {  // BF16 -> F32 is exact: the bits shifted left by 16
      e.dtype = "F32";
      e.data.assign(t.data.size() * 2, '\0');
      for (size_t i = 0; i < t.data.size() / 2; ++i) {
        e.data[4 * i + 2] = t.data[2 * i];
        e.data[4 * i + 3] = t.data[2 * i + 1];
      }
    } else if (t.dtype == "F16") {
      e.dtype = "F32";
      e.data.assign(t.data.size() * 2, '\0');
      for (size_t i = 0; i < t.data.size() / 2; ++i) {
        uint16_t h;
        std::memcpy(&h, t.data.data() + 2 * i, 2);
        const uint32_t f = F16BitsToF32(h);
        std::memcpy(e.data.data() + 4 * i, &f, 4);
      }
    }  // F32 stays; integers, BOOL and F8 are never converted
    expected.push_back(e);
  }
  EXPECT_TRUE(test::SameBytes(test::ReadBytes(Hf() / "model.safetensors"), ExpectedFile(expected)));
}

TEST_F(ExportTest, ExportsAConvertedLayoutAndConvertsAgain) {
  Convert(2, Codec::kRaw, "bf16");
  ExportOptions o = Options();
  o.dtype = "bf16";  // already bf16: kept
  Export(o);
  std::vector<test::TensorSpec> expected;
  for (const auto& t : order_) {
    test::TensorSpec e = t;
    if (t.dtype == "F32" || t.dtype == "F16") {
      const uint64_t item = t.dtype == "F32" ? 4 : 2;
      const uint64_t n = t.data.size() / item;
      e.dtype = "BF16";
      e.data.assign(n * 2, '\0');
      ConvertElements(t.dtype == "F32" ? DType::kF32 : DType::kF16, DType::kBF16, t.data.data(),
                      e.data.data(), n);
    }
    expected.push_back(e);
  }
  EXPECT_TRUE(test::SameBytes(test::ReadBytes(Hf() / "model.safetensors"), ExpectedFile(expected)));
}

TEST_F(ExportTest, CorruptRankFileIsRefusedAndLeavesNothing) {
  Convert(3);
  // Flip one byte of the data of rank 1's first non-empty tensor: its header is intact, so
  // only the chunk checksum, checked while reading, can notice.
  const fs::path p = Out() / "fsdp2-ws3" / RankFileName(1, 3);
  test::RawRankFile raw = test::RawRankFile::Read(p);
  uint64_t at = 0;
  for (const auto& t : raw.header["tensors"]) {
    if (t["nbytes"].get<uint64_t>() > 0) {
      at = raw.data_offset + t["offset"].get<uint64_t>() + 1;
      break;
    }
  }
  ASSERT_GT(at, 0u);
  raw.bytes[at] ^= 0x40;
  test::WriteBytes(p, raw.bytes);
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kDataLoss,
                          {p.string(), "checksum mismatch"}));
  EXPECT_FALSE(fs::exists(Hf()));
  EXPECT_TRUE(Leftovers().empty());
}

TEST_F(ExportTest, ReplacedRankFileIsRefused) {
  Convert(2);
  // A rank file of another conversion (other chunk size) put in place after the manifest.
  TempDir other;
  ConvertOptions c;
  c.source = Src();
  c.out = other.path();
  c.layout.world_size = 2;
  c.chunk_size = 8192;
  reshard::Convert(c);
  fs::copy_file(other / "fsdp2-ws2" / RankFileName(0, 2), Out() / "fsdp2-ws2" / RankFileName(0, 2),
                fs::copy_options::overwrite_existing);
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kMismatch,
                          {"rank-00000-of-00002.reshard", "manifest"}));
  EXPECT_FALSE(fs::exists(Hf()));
}

TEST_F(ExportTest, ExistingOutputIsRefusedUnlessForced) {
  Convert(2);
  fs::create_directories(Hf());
  test::WriteBytes(Hf() / "keep.txt", "mine");
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kMismatch,
                          {Hf().string(), "not empty", "--force"}));
  EXPECT_EQ(test::ReadBytes(Hf() / "keep.txt"), "mine");
  ExportOptions o = Options();
  o.force = true;
  Export(o);
  EXPECT_FALSE(fs::exists(Hf() / "keep.txt"));
  ExpectSingleFileRoundTrip();
  // An existing empty directory is fine without --force.
  fs::remove_all(Hf());
  fs::create_directories(Hf());
  Export(Options());
  ExpectSingleFileRoundTrip();
  // A regular file is never replaced.
  fs::remove_all(Hf());
  test::WriteBytes(Hf(), "a file");
  EXPECT_TRUE(ThrowsError([&] { Export(o); }, ErrorCode::kMismatch, {"not a directory"}));
}

TEST_F(ExportTest, OutputInsideTheReshardOutputIsRefused) {
  Convert(2);
  ExportOptions o = Options();
  o.hf_dir = Out() / "hf";
  EXPECT_TRUE(ThrowsError([&] { Export(o); }, ErrorCode::kInvalidArgument, {"outside"}));
  o.hf_dir = Out();
  o.force = true;
  EXPECT_TRUE(ThrowsError([&] { Export(o); }, ErrorCode::kInvalidArgument, {"outside"}));
  EXPECT_TRUE(fs::exists(Out() / "reshard.json"));
}

TEST_F(ExportTest, SeveralLayoutsNeedLayout) {
  Convert(2);
  Convert(3);
  std::string msg;
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kMismatch,
                          {"fsdp2-ws2", "fsdp2-ws3", "--layout"}));
  EXPECT_TRUE(ThrowsError([&] { Export(Options("fsdp2-ws4")); }, ErrorCode::kNotFound,
                          {"fsdp2-ws4", "fsdp2-ws2, fsdp2-ws3"}));
  EXPECT_EQ(Export(Options("fsdp2-ws3")).layout_key, "fsdp2-ws3");
  ExpectSingleFileRoundTrip();
}

TEST_F(ExportTest, IncompleteLayoutIsRefused) {
  Convert(4, Codec::kRaw, "keep", std::make_pair(0u, 2u));
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kMismatch,
                          {"incomplete", "3 of 4"}));
  EXPECT_FALSE(fs::exists(Hf()));
}

TEST_F(ExportTest, ManifestAuxFilesMustBePlainNames) {
  Convert(2);
  const fs::path m = Out() / "reshard.json";
  const std::string original = test::ReadBytes(m);
  for (const char* bad : {"../escape.json", "model.safetensors", "model.safetensors.index.json"}) {
    SCOPED_TRACE(bad);
    ojson j = ojson::parse(original);
    j["aux_files"].push_back(bad);
    test::WriteBytes(m, j.dump(2));
    EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kDataLoss,
                            {"reshard.json", "aux_files", bad}));
    EXPECT_FALSE(fs::exists(Hf()));
  }
  // A listed aux file that is gone is an error too.
  test::WriteBytes(m, original);
  fs::remove(Out() / "tokenizer.json");
  EXPECT_TRUE(ThrowsError([&] { Export(Options()); }, ErrorCode::kNotFound,
                          {"tokenizer.json", "missing"}));
  EXPECT_FALSE(fs::exists(Hf()));
  EXPECT_TRUE(Leftovers().empty());
}

TEST_F(ExportTest, NotAReshardOutput) {
  EXPECT_TRUE(ThrowsError(
      [&] {
        ExportOptions o = Options();
        o.out = Src();
        Export(o);
      },
      ErrorCode::kNotFound, {"reshard.json", "not a reshard output directory"}));
}

TEST_F(ExportTest, FailureDuringExportLeavesNothing) {
  Convert(3);
  ExportOptions o = Options();
  o.threads = 1;
  int calls = 0;
  o.progress = [&](uint64_t, uint64_t) {
    if (++calls == 3) throw std::runtime_error("interrupted by the test");
  };
  try {
    Export(o);
    ADD_FAILURE() << "did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "interrupted by the test");
  }
  EXPECT_FALSE(fs::exists(Hf()));
  EXPECT_TRUE(Leftovers().empty());
}

TEST_F(ExportTest, KilledExportLeavesNoIndexAndIsCleanedUpByTheNext) {
  Convert(3);
  ExportOptions o = Options();
  o.threads = 1;
  o.max_shard_size = 7000;  // sharded: an index would be written at the very end
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int calls = 0;
    o.progress = [&](uint64_t, uint64_t) {
      if (++calls == 4) ::raise(SIGKILL);
    };
    try {
      Export(o);
    } catch (...) {
    }
    ::_exit(0);  // not reached when killed
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_FALSE(fs::exists(Hf()));
  const auto left = Leftovers();
  ASSERT_EQ(left.size(), 1u);  // the dead export's staging directory, hidden, incomplete
  EXPECT_EQ(left[0][0], '.');
  EXPECT_FALSE(fs::exists(dir_ / left[0] / "model.safetensors.index.json"));
  // The next export removes it and completes.
  const ExportResult r = Export(o);
  EXPECT_TRUE(r.sharded);
  EXPECT_TRUE(fs::exists(Hf() / "model.safetensors.index.json"));
  EXPECT_TRUE(Leftovers().empty());
}

// ---- DescribeLayoutTensors: the checks every layout kind gets -------------------------------

RankFileHeader Header(uint32_t rank, uint32_t ws) {
  RankFileHeader h;
  h.layout_key = "fsdp2-ws" + std::to_string(ws);
  h.world_size = ws;
  h.rank = rank;
  return h;
}

TensorEntry Rows(const std::string& name, std::vector<uint64_t> shape, uint64_t s, uint64_t e) {
  TensorEntry t;
  t.name = name;
  t.dtype = DType::kF32;
  t.global_shape = shape;
  t.sharded = true;
  t.rows = {s, e};
  t.local_shape = shape;
  t.local_shape[0] = e - s;
  uint64_t n = 4;
  for (uint64_t d : t.local_shape) n *= d;
  t.nbytes = n;
  return t;
}

TEST(DescribeLayoutTensorsTest, Fsdp2RowsBecomeByteRanges) {
  RankFileHeader h0 = Header(0, 2), h1 = Header(1, 2);
  h0.tensors = {Rows("w", {5, 3}, 0, 3), Rows("b", {1, 2}, 0, 1)};
  h1.tensors = {Rows("b", {1, 2}, 1, 1), Rows("w", {5, 3}, 3, 5)};
  const auto locs = DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"});
  ASSERT_EQ(locs.size(), 2u);
  EXPECT_EQ(locs[0].name, "w");  // rank 0's order
  EXPECT_EQ(locs[0].nbytes, 60u);
  ASSERT_EQ(locs[0].pieces.size(), 2u);
  EXPECT_EQ(locs[0].pieces[0].rank, 0u);
  EXPECT_EQ(locs[0].pieces[0].dst_offset, 0u);
  EXPECT_EQ(locs[0].pieces[0].length, 36u);
  EXPECT_EQ(locs[0].pieces[1].rank, 1u);
  EXPECT_EQ(locs[0].pieces[1].entry, 1u);
  EXPECT_EQ(locs[0].pieces[1].dst_offset, 36u);
  EXPECT_EQ(locs[0].pieces[1].length, 24u);
  ASSERT_EQ(locs[1].pieces.size(), 1u);  // rank 1's empty shard holds nothing
  EXPECT_EQ(locs[1].pieces[0].length, 8u);
}

TEST(DescribeLayoutTensorsTest, RefusesHeadersThatDoNotTile) {
  RankFileHeader h0 = Header(0, 2), h1 = Header(1, 2);
  h0.tensors = {Rows("w", {5, 3}, 0, 3)};
  h1.tensors = {Rows("w", {5, 3}, 2, 5)};  // row 2 held twice
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kDataLoss, {"r1", "\"w\"", "held twice"}));
  h1.tensors = {Rows("w", {5, 3}, 4, 5)};  // row 3 held by no rank
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kDataLoss, {"\"w\"", "held by no rank"}));
  h1.tensors = {Rows("w", {5, 3}, 3, 4)};  // row 4 missing at the end
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kDataLoss, {"\"w\"", "48 of its 60 bytes"}));
  h1.tensors = {Rows("v", {5, 3}, 3, 5)};
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kMismatch, {"r1", "\"v\"", "not in r0"}));
  h1.tensors = {Rows("w", {5, 4}, 3, 5)};
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kMismatch, {"r1", "\"w\"", "global shape"}));
  h1.tensors = {};
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kMismatch, {"r1", "\"w\"", "missing"}));
  h1 = Header(0, 2);
  h1.tensors = {Rows("w", {5, 3}, 3, 5)};
  EXPECT_TRUE(ThrowsError([&] { DescribeLayoutTensors({&h0, &h1}, {"r0", "r1"}); },
                          ErrorCode::kMismatch, {"r1", "expected rank 1"}));
}

}  // namespace
}  // namespace reshard
