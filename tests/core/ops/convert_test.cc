// Convert and Verify end to end on generated multi-file checkpoints: every rank's bytes are
// compared with a brute-force slice of the tensors the test wrote; the output directory's
// rules (manifest, lock, same source, atomic rank files) and Verify's findings are checked.
#include <thread>
#include <unistd.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/manifest.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/file_io.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/inspect.h"
#include "reshard/ops/verify.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::ojson;
using test::TempDir;
using test::ThrowsError;

constexpr uint64_t kChunk = 4096;

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = test::WriteShardedCheckpoint(Src(), test::AwkwardCheckpointFiles(7));
    test::WriteBytes(Src() / "config.json", "{\"model_type\": \"test\"}");
    test::WriteBytes(Src() / "tokenizer.json", "{\"version\": \"1.0\"}");
  }

  fs::path Src() const { return dir_ / "src"; }

  // Another checkpoint with other bytes and one more tensor, so its headers (and therefore
  // its fingerprint) differ from Src()'s.
  static test::TensorMap WriteOtherSource(const fs::path& dir) {
    auto files = test::AwkwardCheckpointFiles(8);
    files[2].push_back(test::MakeTensor("model.extra", "F32", {3}, 99));
    return test::WriteShardedCheckpoint(dir, files);
  }
  fs::path Out() const { return dir_ / "out"; }

  ConvertOptions Options(uint32_t ws, Codec codec = Codec::kRaw) const {
    ConvertOptions o;
    o.source = Src();
    o.out = Out();
    o.layout.world_size = ws;
    o.threads = 2;
    o.codec = codec;
    o.chunk_size = kChunk;
    return o;
  }

  fs::path RankPath(uint32_t ws, uint32_t rank) const {
    return Out() / ("fsdp2-ws" + std::to_string(ws)) / RankFileName(rank, ws);
  }

  // Every tensor of every rank equals the brute-force slice, read both through the library
  // and (raw codec) with the test's own decoder.
  void ExpectRanksMatchSource(uint32_t ws, const test::TensorMap& tensors, bool raw) {
    for (uint32_t r = 0; r < ws; ++r) {
      SCOPED_TRACE("W=" + std::to_string(ws) + " rank " + std::to_string(r));
      const RankFileReader reader = RankFileReader::Open(RankPath(ws, r));
      ASSERT_EQ(reader.header().tensors.size(), tensors.size());
      test::RawRankFile raw_file;
      if (raw) raw_file = test::RawRankFile::Read(RankPath(ws, r));
      for (const auto& [name, spec] : tensors) {
        const std::string expected = test::BruteSlice(spec, ws, r);
        const TensorEntry* t = reader.header().Find(name);
        ASSERT_NE(t, nullptr) << name;
        std::string got(t->nbytes, '\0');
        reader.ReadTensor(*t, got.data());
        EXPECT_TRUE(test::SameBytes(got, expected)) << name;
        if (raw) EXPECT_TRUE(test::SameBytes(test::RawTensorBytes(raw_file, name), expected)) << name;
      }
    }
  }

  uint64_t SliceBytes(uint32_t ws) const {
    uint64_t n = 0;
    for (uint32_t r = 0; r < ws; ++r) {
      for (const auto& [name, spec] : tensors_) n += test::BruteSlice(spec, ws, r).size();
    }
    return n;
  }

  std::vector<std::string> Temporaries() const {
    std::vector<std::string> tmp;
    if (!fs::exists(Out())) return tmp;
    for (const auto& f : test::ListFiles(Out())) {
      if (f.find(".tmp-") != std::string::npos) tmp.push_back(f);
    }
    return tmp;
  }

  std::vector<std::string> RankFiles(uint32_t ws) const {
    std::vector<std::string> names;
    const fs::path d = Out() / ("fsdp2-ws" + std::to_string(ws));
    if (!fs::exists(d)) return names;
    for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  static bool AnyProblem(const VerifyReport& r, std::initializer_list<std::string_view> needles,
                         std::string_view tensor = {}) {
    for (const auto& p : r.problems) {
      bool all = true;
      for (auto n : needles) all = all && (p.message.find(n) != std::string::npos ||
                                           p.file.find(n) != std::string::npos);
      if (all && (tensor.empty() || p.tensor == tensor)) return true;
    }
    return false;
  }

  static std::string Problems(const VerifyReport& r) {
    std::string s;
    for (const auto& p : r.problems) s += p.file + " [" + p.tensor + "] " + p.message + "\n";
    return s;
  }

  TempDir dir_;
  test::TensorMap tensors_;
};

TEST_F(ConvertTest, EveryWorldSizeMatchesBruteForceSlices) {
  for (uint32_t ws : {1u, 2u, 3u, 5u, 8u}) {
    SCOPED_TRACE("W=" + std::to_string(ws));
    const ConvertResult res = Convert(Options(ws));
    EXPECT_EQ(res.layout_key, "fsdp2-ws" + std::to_string(ws));
    EXPECT_EQ(res.world_size, ws);
    EXPECT_TRUE(res.layout_complete);
    std::vector<uint32_t> all(ws);
    for (uint32_t r = 0; r < ws; ++r) all[r] = r;
    EXPECT_EQ(res.ranks_written, all);
    EXPECT_TRUE(res.ranks_up_to_date.empty());
    EXPECT_EQ(res.bytes_read, SliceBytes(ws));
    EXPECT_EQ(res.bytes_decoded, SliceBytes(ws));
    EXPECT_EQ(res.bytes_stored, SliceBytes(ws));
    ExpectRanksMatchSource(ws, tensors_, /*raw=*/true);
    std::vector<std::string> expected_files;
    for (uint32_t r = 0; r < ws; ++r) expected_files.push_back(RankFileName(r, ws));
    EXPECT_EQ(RankFiles(ws), expected_files);
  }
  EXPECT_TRUE(Temporaries().empty());

  // The manifest, read with the test's own JSON parser.
  const ojson m = ojson::parse(test::ReadBytes(Out() / "reshard.json"));
  EXPECT_EQ(m["format"], "reshard.manifest");
  EXPECT_EQ(m["format_version"], 1);
  EXPECT_EQ(m["source"]["fingerprint"], Hex16(OpenCheckpoint(Src()).fingerprint.fingerprint));
  EXPECT_EQ(m["aux_files"], (ojson{"config.json", "tokenizer.json"}));
  EXPECT_EQ(m["layouts"].size(), 5u);
  for (uint32_t ws : {1u, 2u, 3u, 5u, 8u}) {
    const std::string key = "fsdp2-ws" + std::to_string(ws);
    const ojson& l = m["layouts"][key];
    EXPECT_EQ(l["kind"], "fsdp2");
    EXPECT_EQ(l["world_size"], ws);
    EXPECT_EQ(l["dtype"], "keep");
    EXPECT_EQ(l["dir"], key);
    EXPECT_EQ(l["complete"], true);
    ASSERT_EQ(l["ranks"].size(), ws);
    for (uint32_t r = 0; r < ws; ++r) {
      const ojson& e = l["ranks"][r];
      const test::RawRankFile f = test::RawRankFile::Read(RankPath(ws, r));
      EXPECT_EQ(e["rank"], r);
      EXPECT_EQ(e["file"], RankFileName(r, ws));
      EXPECT_EQ(e["size"], f.bytes.size());
      EXPECT_EQ(e["header_xxh3"], test::RefHex16(test::RefXxh3(
                                      std::string_view(f.bytes).substr(f.header_offset))));
    }
  }
  // Aux files are copied byte for byte.
  EXPECT_EQ(test::ReadBytes(Out() / "config.json"), test::ReadBytes(Src() / "config.json"));
  EXPECT_EQ(test::ReadBytes(Out() / "tokenizer.json"), test::ReadBytes(Src() / "tokenizer.json"));
}

TEST_F(ConvertTest, ZstdRoundTrip) {
  const ConvertResult res = Convert(Options(3, Codec::kZstd));
  EXPECT_TRUE(res.layout_complete);
  EXPECT_EQ(res.bytes_decoded, SliceBytes(3));
  ExpectRanksMatchSource(3, tensors_, /*raw=*/false);

  // Compressible data really shrinks, and comes back exactly.
  TempDir other;
  test::TensorSpec zeros{"zeros", "U8", {64, 1024}, std::string(65536, '\0')};
  test::TensorSpec text{"text", "I8", {3, 5000}, {}};
  for (int i = 0; i < 15000; ++i) text.data += "abcabcabd"[i % 9];
  const test::TensorMap small = test::WriteShardedCheckpoint(other / "src", {{zeros, text}});
  ConvertOptions o = Options(2, Codec::kZstd);
  o.source = other / "src";
  o.out = other / "out";
  o.zstd_level = 5;
  const ConvertResult r2 = Convert(o);
  EXPECT_LT(r2.bytes_stored * 20, r2.bytes_decoded);
  for (uint32_t r = 0; r < 2; ++r) {
    const RankFileReader reader =
        RankFileReader::Open(other / "out" / "fsdp2-ws2" / RankFileName(r, 2));
    for (const auto& [name, spec] : small) {
      const TensorEntry* t = reader.header().Find(name);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->codec, Codec::kZstd);
      EXPECT_LT(t->stored_size, t->nbytes);
      std::string got(t->nbytes, '\0');
      reader.ReadTensor(*t, got.data());
      EXPECT_TRUE(test::SameBytes(got, test::BruteSlice(spec, 2, r))) << name;
    }
  }
  VerifyOptions v;
  v.path = other / "out";
  v.source = other / "src";
  v.threads = 2;
  const VerifyReport rep = Verify(v);
  EXPECT_TRUE(rep.ok()) << Problems(rep);
  EXPECT_EQ(rep.source_bytes_compared, 65536u + 15000u);
}

TEST_F(ConvertTest, ProgressReachesTheTotal) {
  uint64_t last_done = 0, last_total = 0, calls = 0;
  ConvertOptions o = Options(3);
  o.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
    ++calls;
  };
  Convert(o);
  EXPECT_GT(calls, 1u);
  EXPECT_EQ(last_total, SliceBytes(3));
  EXPECT_EQ(last_done, last_total);
}

TEST_F(ConvertTest, RankSubsetThenRestCompletesTheManifest) {
  ConvertOptions o = Options(4);
  o.ranks = std::make_pair(0u, 1u);
  ConvertResult a = Convert(o);
  EXPECT_EQ(a.ranks_written, (std::vector<uint32_t>{0, 1}));
  EXPECT_FALSE(a.layout_complete);
  EXPECT_EQ(RankFiles(4), (std::vector<std::string>{RankFileName(0, 4), RankFileName(1, 4)}));
  std::optional<Manifest> m = ReadManifest(Out());
  ASSERT_TRUE(m.has_value());
  const ManifestLayout& l = m->layouts.at("fsdp2-ws4");
  EXPECT_FALSE(l.complete);
  ASSERT_EQ(l.ranks.size(), 2u);
  EXPECT_EQ(l.ranks[1].rank, 1u);

  o.ranks = std::make_pair(2u, 3u);
  ConvertResult b = Convert(o);
  EXPECT_EQ(b.ranks_written, (std::vector<uint32_t>{2, 3}));
  EXPECT_TRUE(b.ranks_up_to_date.empty());
  EXPECT_TRUE(b.layout_complete);
  m = ReadManifest(Out());
  const ManifestLayout& l2 = m->layouts.at("fsdp2-ws4");
  EXPECT_TRUE(l2.complete);
  ASSERT_EQ(l2.ranks.size(), 4u);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ(l2.ranks[r].rank, r);
    EXPECT_EQ(l2.ranks[r].size, fs::file_size(RankPath(4, r)));
  }
  ExpectRanksMatchSource(4, tensors_, /*raw=*/true);
  // The split conversion gives the same bytes as a single one.
  TempDir once;
  ConvertOptions whole = Options(4);
  whole.out = once.path();
  Convert(whole);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ(test::ReadBytes(RankPath(4, r)),
              test::ReadBytes(once / "fsdp2-ws4" / RankFileName(r, 4)));
  }
}

TEST_F(ConvertTest, EmptyTensorWithHugeFirstDimRoundTrips) {
  // shape [2^64 − 1, 0] holds no bytes and is legal; the chunk rule must not overflow when
  // it splits 2^64 − 1 rows over 2 ranks (c = 2^63, 2·c = 2^64).
  TempDir other;
  constexpr uint64_t kMax = ~uint64_t{0};
  const test::TensorSpec huge{"huge", "BF16", {kMax, 0}, ""};
  const test::TensorSpec w = test::MakeTensor("w", "F32", {5, 3}, 1);
  test::WriteShardedCheckpoint(other / "src", {{huge, w}});
  ConvertOptions o = Options(2);
  o.source = other / "src";
  o.out = other / "out";
  EXPECT_TRUE(Convert(o).layout_complete);
  for (uint32_t r = 0; r < 2; ++r) {
    const RankFileReader reader =
        RankFileReader::Open(other / "out" / "fsdp2-ws2" / RankFileName(r, 2));
    const TensorEntry* t = reader.header().Find("huge");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->rows, (RowRange{r == 0 ? 0 : uint64_t{1} << 63, r == 0 ? uint64_t{1} << 63 : kMax}));
    EXPECT_EQ(t->local_shape, (std::vector<uint64_t>{r == 0 ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1, 0}));
    EXPECT_EQ(t->nbytes, 0u);
    const TensorEntry* wt = reader.header().Find("w");
    std::string got(wt->nbytes, '\0');
    reader.ReadTensor(*wt, got.data());
    EXPECT_TRUE(test::SameBytes(got, test::BruteSlice(w, 2, r)));
  }
}

TEST_F(ConvertTest, InvalidArguments) {
  ConvertOptions o = Options(4);
  o.ranks = std::make_pair(3u, 2u);
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument, {"--ranks 3-2"}));
  o.ranks = std::make_pair(0u, 4u);
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument, {"0-3"}));
  o = Options(0);
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument, {"world-size"}));
  // Rank file names have five digits for rank and world size (rank-RRRRR-of-WWWWW):
  // with W = 100000 the files could not be found again by name.
  o = Options(100000);
  o.ranks = std::make_pair(0u, 0u);
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument,
                          {"world size 100000", "99999"}));
  o = Options(2);
  o.chunk_size = 5000;
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kInvalidArgument, {"chunk size"}));
  EXPECT_FALSE(fs::exists(Out()));
}

TEST_F(ConvertTest, RerunIsANoOp) {
  Convert(Options(3));
  struct stat before[3];
  for (uint32_t r = 0; r < 3; ++r) ASSERT_EQ(::stat(RankPath(3, r).c_str(), &before[r]), 0);
  const std::string manifest = test::ReadBytes(Out() / "reshard.json");
  const ConvertResult again = Convert(Options(3));
  EXPECT_TRUE(again.ranks_written.empty());
  EXPECT_EQ(again.ranks_up_to_date, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(again.bytes_read, 0u);
  EXPECT_TRUE(again.layout_complete);
  for (uint32_t r = 0; r < 3; ++r) {
    struct stat after;
    ASSERT_EQ(::stat(RankPath(3, r).c_str(), &after), 0);
    EXPECT_EQ(after.st_ino, before[r].st_ino) << "rank " << r << " was rewritten";
  }
  EXPECT_EQ(test::ReadBytes(Out() / "reshard.json"), manifest);

  // A file damaged after it was written (a tensor byte flipped, the header intact) is not up
  // to date: a re-run writes it again and says what it found; the others are left alone.
  {
    std::string raw = test::ReadBytes(RankPath(3, 2));
    raw[4096] ^= 0x40;  // the first byte of the data region: the first tensor's first byte
    test::WriteBytes(RankPath(3, 2), raw);
    const ConvertResult fixed = Convert(Options(3));
    EXPECT_EQ(fixed.ranks_written, (std::vector<uint32_t>{2}));
    EXPECT_EQ(fixed.ranks_up_to_date, (std::vector<uint32_t>{0, 1}));
    ASSERT_EQ(fixed.ranks_damaged.size(), 1u);
    EXPECT_EQ(fixed.ranks_damaged[0].first, 2u);
    EXPECT_NE(fixed.ranks_damaged[0].second.find("checksum"), std::string::npos) << fixed.ranks_damaged[0].second;
    EXPECT_NE(fixed.ranks_damaged[0].second.find(RankPath(3, 2).filename().string()), std::string::npos)
        << fixed.ranks_damaged[0].second;
    ExpectRanksMatchSource(3, tensors_, /*raw=*/true);
    const ConvertResult quiet = Convert(Options(3));
    EXPECT_TRUE(quiet.ranks_written.empty());
    EXPECT_TRUE(quiet.ranks_damaged.empty());
  }

  // A different codec is a different file: rewritten.
  const ConvertResult z = Convert(Options(3, Codec::kZstd));
  EXPECT_EQ(z.ranks_written, (std::vector<uint32_t>{0, 1, 2}));
  // A rank file with a broken header is rewritten, the others are left alone.
  std::string b = test::ReadBytes(RankPath(3, 1));
  b[b.size() - 3] ^= 1;
  test::WriteBytes(RankPath(3, 1), b);
  const ConvertResult fix = Convert(Options(3, Codec::kZstd));
  EXPECT_EQ(fix.ranks_written, (std::vector<uint32_t>{1}));
  EXPECT_EQ(fix.ranks_up_to_date, (std::vector<uint32_t>{0, 2}));
  ExpectRanksMatchSource(3, tensors_, /*raw=*/false);
}

TEST_F(ConvertTest, DifferentSourceIntoSameOutIsMismatch) {
  Convert(Options(2));
  const std::string manifest = test::ReadBytes(Out() / "reshard.json");
  TempDir other;
  WriteOtherSource(other / "src");
  ConvertOptions o = Options(3);
  o.source = other / "src";
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kMismatch,
                          {Out().string(), "another source", "convert into an empty directory"}));
  EXPECT_EQ(test::ReadBytes(Out() / "reshard.json"), manifest);
  EXPECT_FALSE(fs::exists(Out() / "fsdp2-ws3" / RankFileName(0, 3)));
  // The same layout as the one present: refused too, the rank files are left alone.
  o.layout.world_size = 2;
  const std::string rank0 = test::ReadBytes(RankPath(2, 0));
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kMismatch, {"another source"}));
  EXPECT_EQ(test::ReadBytes(RankPath(2, 0)), rank0);
}

// A checkpoint rewritten in place with new weights of the same shapes (the next training
// step) is another source: the fingerprint's data sample (sample_xxh3) differs, so Convert
// refuses the old OUT instead of taking its rank files for "up to date".
TEST_F(ConvertTest, SameShapesNewWeightsAreNotTakenForUpToDate) {
  Convert(Options(2));
  const test::TensorMap updated =
      test::WriteShardedCheckpoint(Src(), test::AwkwardCheckpointFiles(8));
  try {
    Convert(Options(2));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
    return;
  }
  ExpectRanksMatchSource(2, updated, /*raw=*/true);
}

TEST_F(ConvertTest, ConcurrentConversionIsBusy) {
  fs::create_directories(Out());
  {
    DirectoryLock held(Out() / ".reshard.lock");
    ConvertOptions o = Options(2);
    o.lock_wait_seconds = 0.2;
    EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kBusy,
                            {Out().string(), "another reshard process"}));
    EXPECT_TRUE(RankFiles(2).empty());
  }
  // Released: now it works.
  EXPECT_TRUE(Convert(Options(2)).layout_complete);
}

// Disjoint --ranks conversions into one OUT at the same time (one per machine): both finish
// and the manifest ends complete.
TEST_F(ConvertTest, ConcurrentDisjointRankConversionsBothComplete) {
  ConvertOptions a = Options(4), b = Options(4);
  a.ranks = std::make_pair(0u, 1u);
  b.ranks = std::make_pair(2u, 3u);
  std::exception_ptr ea, eb;
  std::thread ta([&] { try { Convert(a); } catch (...) { ea = std::current_exception(); } });
  std::thread tb([&] { try { Convert(b); } catch (...) { eb = std::current_exception(); } });
  ta.join();
  tb.join();
  for (auto* e : {&ea, &eb}) {
    if (*e) {
      try {
        std::rethrow_exception(*e);
      } catch (const std::exception& x) {
        FAIL() << x.what();
      }
    }
  }
  std::optional<Manifest> m = ReadManifest(Out());
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->layouts.at("fsdp2-ws4").complete);
  EXPECT_EQ(m->layouts.at("fsdp2-ws4").ranks.size(), 4u);
  EXPECT_TRUE(Temporaries().empty());
}

// OUT holding the user's files (another checkpoint's config.json) is refused before anything
// is written, unless force; an OUT left by an interrupted conversion of this source (layout
// directory, identical aux files, no manifest yet) is resumed.
TEST_F(ConvertTest, NonEmptyDirectoryThatIsNoOutputOfThisSourceNeedsForce) {
  fs::create_directories(Out());
  test::WriteBytes(Out() / "config.json", "{\"model_type\": \"someone else's\"}");
  test::WriteBytes(Out() / "notes.txt", "mine");
  EXPECT_TRUE(ThrowsError([&] { Convert(Options(2)); }, ErrorCode::kMismatch,
                          {Out().string(), "found ", "without reshard.json",
                           "expected an empty directory or a reshard output of this source",
                           "--force"}));
  EXPECT_EQ(test::ReadBytes(Out() / "config.json"), "{\"model_type\": \"someone else's\"}");
  EXPECT_FALSE(fs::exists(Out() / "fsdp2-ws2"));
  ConvertOptions o = Options(2);
  o.force = true;
  Convert(o);
  EXPECT_EQ(test::ReadBytes(Out() / "config.json"), test::ReadBytes(Src() / "config.json"));
  EXPECT_EQ(test::ReadBytes(Out() / "notes.txt"), "mine");
  // A reshard output of this source: converting another layout into it is fine.
  Convert(Options(3));
}

TEST_F(ConvertTest, InterruptedOutputWithoutManifestIsResumed) {
  Convert(Options(2));
  fs::remove(Out() / "reshard.json");  // killed before the manifest was written
  fs::remove(RankPath(2, 1));
  Convert(Options(2));
  EXPECT_TRUE(fs::exists(Out() / "reshard.json"));
  // A differing config.json without a manifest is not this source's output.
  fs::remove(Out() / "reshard.json");
  test::WriteBytes(Out() / "config.json", "{}");
  EXPECT_TRUE(ThrowsError([&] { Convert(Options(2)); }, ErrorCode::kMismatch,
                          {"config.json (differing from", "--force"}));
}

// Aux files copied into OUT keep the source's restrictions: a 0600 config.json (or a link
// to a 0600 secret) is not published as 0644.
TEST_F(ConvertTest, AuxFileCopiesAreNeverMorePermissive) {
  const mode_t old_mask = ::umask(022);
  test::WriteBytes(dir_ / "secret.json", "{\"token\": \"s3cret\"}");
  ::chmod((dir_ / "secret.json").c_str(), 0600);
  fs::remove(Src() / "tokenizer.json");
  fs::create_symlink(dir_ / "secret.json", Src() / "tokenizer.json");
  ::chmod((Src() / "config.json").c_str(), 0640);
  Convert(Options(2));
  struct stat st;
  ASSERT_EQ(::stat((Out() / "tokenizer.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_FALSE(fs::is_symlink(Out() / "tokenizer.json"));
  ASSERT_EQ(::stat((Out() / "config.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ::umask(old_mask);
}

// A temporary of a live process on this host (another conversion in progress) is kept.
TEST_F(ConvertTest, LiveProcessTemporaryIsKept) {
  fs::create_directories(Out() / "fsdp2-ws2");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string h(host);
  for (char& c : h) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_')) c = '_';
  }
  // pid 1 is always alive.
  const fs::path live = Out() / "fsdp2-ws2" / (".rank-00000-of-00002.reshard.tmp-" + h + "-1");
  test::WriteBytes(live, "in progress elsewhere");
  Convert(Options(2));
  EXPECT_TRUE(fs::exists(live));
  fs::remove(live);
}

TEST_F(ConvertTest, StaleTemporariesAreRemoved) {
  fs::create_directories(Out() / "fsdp2-ws2");
  test::WriteBytes(Out() / "fsdp2-ws2" / ".rank-00000-of-00002.reshard.tmp-99999", "junk");
  Convert(Options(2));
  EXPECT_TRUE(Temporaries().empty());
  EXPECT_EQ(RankFiles(2), (std::vector<std::string>{RankFileName(0, 2), RankFileName(1, 2)}));
}

// A source file shrinks after OpenCheckpoint validated it (between planning and reading):
// the conversion fails and leaves neither a rank file under its final name nor a temporary.
TEST_F(ConvertTest, SourceTruncatedMidwayLeavesNothingBehind) {
  const fs::path victim = Src() / "model-00003-of-00003.safetensors";
  ConvertOptions o = Options(2);
  bool truncated = false;
  o.progress = [&](uint64_t, uint64_t) {
    if (!truncated) fs::resize_file(victim, 200);
    truncated = true;
  };
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kDataLoss, {victim.string(), "truncated"}));
  EXPECT_TRUE(truncated);
  EXPECT_TRUE(RankFiles(2).empty()) << ::testing::PrintToString(RankFiles(2));
  EXPECT_TRUE(Temporaries().empty()) << ::testing::PrintToString(Temporaries());
  EXPECT_FALSE(fs::exists(Out() / "reshard.json"));
}

TEST_F(ConvertTest, ExceptionFromProgressLeavesNothingBehind) {
  ConvertOptions o = Options(5, Codec::kZstd);
  int calls = 0;
  o.progress = [&](uint64_t, uint64_t) {
    if (++calls == 2) throw Error(ErrorCode::kIo, "interrupted by the test");
  };
  EXPECT_TRUE(ThrowsError([&] { Convert(o); }, ErrorCode::kIo, {"interrupted by the test"}));
  EXPECT_TRUE(RankFiles(5).empty());
  EXPECT_TRUE(Temporaries().empty());
}

// Writes fail with EFBIG (RLIMIT_FSIZE) while rank files are being written: an I/O error,
// no partial rank file, and a later conversion succeeds.
TEST_F(ConvertTest, DiskFullMidwayLeavesNothingBehindAndRecovers) {
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 12288;  // the lock file and the first 8 KiB of data fit, not more
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  bool threw = false;
  try {
    Convert(Options(2, Codec::kZstd));
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find(".tmp-"), std::string::npos) << e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(threw);
  EXPECT_TRUE(RankFiles(2).empty()) << ::testing::PrintToString(RankFiles(2));
  EXPECT_TRUE(Temporaries().empty());
  EXPECT_TRUE(Convert(Options(2, Codec::kZstd)).layout_complete);
  ExpectRanksMatchSource(2, tensors_, /*raw=*/false);
}

TEST_F(ConvertTest, SingleSafetensorsFileAsSource) {
  TempDir other;
  std::vector<test::TensorSpec> ts = test::AwkwardCheckpointFiles(11)[1];
  test::WriteBytes(other / "weights.safetensors", test::SafetensorsBytes(ts));
  ConvertOptions o = Options(3);
  o.source = other / "weights.safetensors";
  EXPECT_TRUE(Convert(o).layout_complete);
  test::TensorMap m;
  for (const auto& t : ts) m[t.name] = t;
  ExpectRanksMatchSource(3, m, /*raw=*/true);
  VerifyOptions v;
  v.path = Out();
  v.source = other / "weights.safetensors";
  v.threads = 2;
  const VerifyReport r = Verify(v);
  EXPECT_TRUE(r.ok()) << Problems(r);
}

TEST_F(ConvertTest, InspectDescribesEveryKindOfPath) {
  Convert(Options(2));
  Convert(Options(3, Codec::kZstd));
  const auto out = Inspect(Out());
  EXPECT_EQ(out["kind"], "output");
  EXPECT_EQ(out["layouts"].size(), 2u);
  EXPECT_EQ(out["layouts"]["fsdp2-ws2"]["complete"], true);
  EXPECT_EQ(out["layouts"]["fsdp2-ws3"]["ranks"].size(), 3u);
  EXPECT_EQ(out["layouts"]["fsdp2-ws2"]["nbytes"], SliceBytes(2));
  const auto layout = Inspect(Out() / "fsdp2-ws3");
  EXPECT_EQ(layout["kind"], "layout");
  EXPECT_EQ(layout["world_size"], 3);
  const auto rank = Inspect(RankPath(2, 1));
  EXPECT_EQ(rank["kind"], "rank_file");
  EXPECT_EQ(rank["rank"], 1);
  EXPECT_EQ(rank["tensors"].size(), tensors_.size());
  const auto src = Inspect(Src());
  EXPECT_EQ(src["kind"], "source");
  EXPECT_EQ(src["tensor_count"], tensors_.size());
  EXPECT_EQ(src["fingerprint"], Hex16(OpenCheckpoint(Src()).fingerprint.fingerprint));
  for (const auto* d : {&out, &layout, &rank, &src}) {
    const std::string text = RenderInspect(*d);
    EXPECT_FALSE(text.empty());
  }
  EXPECT_NE(RenderInspect(rank).find("model.embed_tokens.weight"), std::string::npos);
  EXPECT_NE(RenderInspect(out).find("fsdp2-ws3"), std::string::npos);
  EXPECT_TRUE(ThrowsError([&] { Inspect(dir_ / "absent"); }, ErrorCode::kNotFound, {"absent"}));
}

// ---- Verify ------------------------------------------------------------------------------

class VerifyTest : public ConvertTest {
 protected:
  VerifyReport Run(bool with_source, fs::path path = {}) {
    VerifyOptions v;
    v.path = path.empty() ? Out() : path;
    if (with_source) v.source = Src();
    v.threads = 2;
    return Verify(v);
  }
};

TEST_F(VerifyTest, GoodOutputPassesWithAndWithoutSource) {
  Convert(Options(3));
  Convert(Options(5, Codec::kZstd));
  for (bool with_source : {false, true}) {
    SCOPED_TRACE(with_source ? "with source" : "without source");
    const VerifyReport r = Run(with_source);
    EXPECT_TRUE(r.ok()) << Problems(r);
    EXPECT_EQ(r.layouts, (std::vector<std::string>{"fsdp2-ws3", "fsdp2-ws5"}));
    EXPECT_EQ(r.files, 8u);
    EXPECT_EQ(r.tensors, 8 * tensors_.size());
    EXPECT_EQ(r.bytes, SliceBytes(3) + SliceBytes(5));
    EXPECT_EQ(r.source_bytes_compared, with_source ? SliceBytes(3) + SliceBytes(5) : 0u);
  }
  // A layout directory and a single rank file can be verified on their own.
  const VerifyReport layout = Run(true, Out() / "fsdp2-ws3");
  EXPECT_TRUE(layout.ok()) << Problems(layout);
  EXPECT_EQ(layout.files, 3u);
  const VerifyReport one = Run(true, RankPath(5, 4));
  EXPECT_TRUE(one.ok()) << Problems(one);
  EXPECT_EQ(one.files, 1u);
}

TEST_F(VerifyTest, FlippedDataByteIsFound) {
  Convert(Options(3));
  const fs::path p = RankPath(3, 2);
  test::RawRankFile f = test::RawRankFile::Read(p);
  uint64_t offset = 0;
  for (const auto& t : f.header["tensors"]) {
    if (t["name"] == "lm_head.weight") offset = t["offset"];
  }
  std::string b = f.bytes;
  b[4096 + offset + 10] ^= 0x04;
  test::WriteBytes(p, b);
  for (bool with_source : {false, true}) {
    const VerifyReport r = Run(with_source);
    EXPECT_FALSE(r.ok());
    EXPECT_TRUE(AnyProblem(r, {p.string(), "chunk 0", "checksum mismatch"}, "lm_head.weight"))
        << Problems(r);
    EXPECT_EQ(r.problems.size(), 1u) << Problems(r);
  }
}

TEST_F(VerifyTest, DataThatDiffersFromSourceWithConsistentChecksums) {
  // A rank file that is self-consistent (checksums recomputed) but holds wrong bytes: only
  // the comparison with the source can tell.
  Convert(Options(2));
  const fs::path p = RankPath(2, 1);
  test::RawRankFile f = test::RawRankFile::Read(p);
  uint64_t offset = 0, nbytes = 0;
  for (const auto& t : f.header["tensors"]) {
    if (t["name"] == "model.layers.1.self_attn.q_proj.weight") {
      offset = t["offset"];
      nbytes = t["nbytes"];
    }
  }
  ASSERT_EQ(nbytes, 3600u);
  f.bytes[4096 + offset + 100] ^= 0x01;
  test::WriteBytes(p, f.bytes);
  const std::string part = f.bytes.substr(4096 + offset, nbytes);
  test::EditRankHeader(p, [&](ojson& h) {
    for (auto& t : h["tensors"]) {
      if (t["name"] == "model.layers.1.self_attn.q_proj.weight") {
        const uint64_t c = test::RefXxh3(part);
        t["chunk_xxh3"] = ojson::array({test::RefHex16(c)});
        t["xxh3"] = test::RefHex16(test::RefCombine({c}));
      }
    }
  });
  // Manifest sizes and header checksums no longer match; rebuild them with a rerun-free
  // check of the layout directory instead.
  const fs::path layout = Out() / "fsdp2-ws2";
  const VerifyReport without = Run(false, layout);
  EXPECT_TRUE(without.ok()) << Problems(without);
  const VerifyReport with = Run(true, layout);
  EXPECT_TRUE(AnyProblem(with, {"differs from the source at byte 100 of this rank's part"},
                         "model.layers.1.self_attn.q_proj.weight"))
      << Problems(with);
  EXPECT_EQ(with.problems.size(), 1u) << Problems(with);
}

TEST_F(VerifyTest, MissingRankIsFound) {
  Convert(Options(3));
  fs::remove(RankPath(3, 1));
  const VerifyReport r = Run(false);
  // One problem for one missing file (it was counted twice), naming the command that writes it.
  EXPECT_TRUE(AnyProblem(r, {RankPath(3, 1).string(), "listed in the manifest but missing",
                             "run reshard convert SRC -o " + Out().string() +
                                 " --world-size 3 --ranks 1-1"}))
      << Problems(r);
  EXPECT_EQ(r.problems.size(), 1u) << Problems(r);
  // Without a manifest, from the layout directory alone.
  fs::remove(Out() / "reshard.json");
  const VerifyReport l = Run(false, Out() / "fsdp2-ws3");
  EXPECT_TRUE(AnyProblem(l, {"rank 1 of 3 is missing", "--world-size 3 --ranks 1-1"})) << Problems(l);
  EXPECT_EQ(l.problems.size(), 1u) << Problems(l);
}

TEST_F(VerifyTest, TruncatedRankIsOneProblemWithTheCommand) {
  Convert(Options(3));
  fs::resize_file(RankPath(3, 2), 5000);
  const VerifyReport r = Run(false);
  EXPECT_TRUE(AnyProblem(r, {RankPath(3, 2).string(), "(truncated)",
                             " --world-size 3 --ranks 2-2"}))
      << Problems(r);
  EXPECT_EQ(r.problems.size(), 1u) << Problems(r);
}

TEST_F(VerifyTest, RankFileFromAnotherSourceIsFound) {
  Convert(Options(2));
  TempDir other;
  WriteOtherSource(other / "src");
  ConvertOptions o = Options(2);
  o.source = other / "src";
  o.out = other / "out";
  Convert(o);
  fs::copy_file(other / "out" / "fsdp2-ws2" / RankFileName(1, 2), RankPath(2, 1),
                fs::copy_options::overwrite_existing);
  for (bool with_source : {false, true}) {
    SCOPED_TRACE(with_source ? "with source" : "without source");
    const VerifyReport r = Run(with_source);
    EXPECT_TRUE(AnyProblem(r, {RankPath(2, 1).string(), "converted from source", "the manifest names"}))
        << Problems(r);
    EXPECT_TRUE(AnyProblem(r, {RankPath(2, 1).string(), "not present in"}, "model.extra"))
        << Problems(r);
    if (with_source) {
      EXPECT_TRUE(AnyProblem(r, {RankPath(2, 1).string(), "differs from the source"})) << Problems(r);
    }
  }
  // Verifying the output against the other checkpoint: wrong source.
  VerifyOptions v;
  v.path = Out();
  v.source = other / "src";
  v.threads = 2;
  const VerifyReport wrong = Verify(v);
  EXPECT_TRUE(AnyProblem(wrong, {"another checkpoint, or it changed"})) << Problems(wrong);
  EXPECT_TRUE(AnyProblem(wrong, {"source tensor missing from the layout"}, "model.extra"))
      << Problems(wrong);
}

TEST_F(VerifyTest, SameShapesOtherWeightsAreFoundOnlyByComparingWithTheSource) {
  // Same names, shapes and header bytes, other weights: the fingerprints are equal (see
  // ConvertTest.DISABLED_SameShapesNewWeightsAreNotTakenForUpToDate), so only the byte
  // comparison with the source tells.
  Convert(Options(2));
  TempDir other;
  test::WriteShardedCheckpoint(other / "src", test::AwkwardCheckpointFiles(9));
  VerifyOptions v;
  v.path = Out();
  v.source = other / "src";
  v.threads = 2;
  const VerifyReport r = Verify(v);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(AnyProblem(r, {RankPath(2, 0).string(), "differs from the source at byte 0"},
                         "model.embed_tokens.weight"))
      << Problems(r);
  EXPECT_TRUE(AnyProblem(r, {RankPath(2, 1).string(), "differs from the source"},
                         "model.layers.2.big"))
      << Problems(r);
}

TEST_F(VerifyTest, MissingPathThrows) {
  VerifyOptions v;
  v.path = dir_ / "absent";
  EXPECT_TRUE(ThrowsError([&] { Verify(v); }, ErrorCode::kNotFound, {"absent"}));
}

// The model manifest convert uses without --model-manifest, and that the CLI looks for
// before capturing one: SOURCE's (beside a weight file), else OUT's; none: empty.
TEST(FindModelManifest, SourceThenOut) {
  TempDir dir;
  const fs::path src = dir / "src", out = dir / "out";
  fs::create_directories(src);
  fs::create_directories(out);
  test::WriteBytes(src / "model.safetensors", "x");
  EXPECT_TRUE(FindModelManifest(src, out).empty());
  EXPECT_TRUE(FindModelManifest(src / "model.safetensors", out).empty());
  test::WriteBytes(out / "reshard-model.json", "{}");
  EXPECT_EQ(FindModelManifest(src, out), out / "reshard-model.json");
  test::WriteBytes(src / "reshard-model.json", "{}");
  EXPECT_EQ(FindModelManifest(src, out), src / "reshard-model.json");
  EXPECT_EQ(FindModelManifest(src / "model.safetensors", out), src / "reshard-model.json");
  EXPECT_EQ(FindModelManifest(dir / "missing", out), out / "reshard-model.json");
}

}  // namespace
}  // namespace reshard
