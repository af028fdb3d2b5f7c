// SourceRankView: a rank's part of a layout read straight from a Hugging Face checkpoint or
// from another layout's rank files. Every rank's bytes of every world size are compared with
// the brute-force slice of the tensors the test wrote (tests/core/test_util.h), host targets.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/host_device_copier.h"
#include "core/test_util.h"
#include "reshard/base/error.h"
#include "reshard/format/dtensor.h"
#include "reshard/format/layout.h"
#include "reshard/format/parallel_plan.h"
#include "reshard/io/file_io.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/layout_reader.h"
#include "reshard/io/manifest.h"
#include "reshard/runtime/source_load.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::TempDir;

class SourceLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = test::WriteShardedCheckpoint(Src(), test::AwkwardCheckpointFiles(11));
    test::WriteBytes(Src() / "config.json", "{\"model_type\": \"test\"}");
  }
  fs::path Src() const { return dir_.path() / "src"; }
  fs::path Out() const { return dir_.path() / "out"; }

  void ConvertTo(uint32_t ws, Codec codec = Codec::kRaw) { ConvertDir(Src(), Out(), ws, codec); }
  static void ConvertDir(const fs::path& src, const fs::path& out, uint32_t ws, Codec codec = Codec::kRaw) {
    ConvertOptions o;
    o.source = src;
    o.out = out;
    o.layout.world_size = ws;
    o.threads = 2;
    o.codec = codec;
    o.chunk_size = 4096;  // many chunks per tensor: pieces start and end inside chunks
    Convert(o);
  }
  // A checkpoint in `src` of one F32 tensor "w" [128, 1024] (64 chunks per rank file at world
  // size 2): runs of whole chunks, rows that interleave chunks, column splits.
  static test::TensorMap WriteOneBigTensor(const fs::path& src, uint64_t seed) {
    test::TensorMap t = test::WriteShardedCheckpoint(src, {{test::MakeTensor("w", "F32", {128, 1024}, seed)}});
    test::WriteBytes(src / "config.json", "{\"model_type\": \"test\"}");
    return t;
  }

  static LayoutSpec Fsdp2(uint32_t ws) {
    LayoutSpec l;
    l.world_size = ws;
    return l;
  }

  // Loads every tensor of the view into host memory and compares it with the brute-force
  // slice of rank `rank` of `ws`. Small pieces (span_bytes) so that a tensor is several pieces.
  // With `io` kDirect the source files are read O_DIRECT (stats say so). The targets are
  // page-aligned, as pinned staging is: O_DIRECT reads land straight in them where the
  // source is aligned too. `copier`: the targets are "device" memory copied through it.
  void ExpectBruteSlices(const SourceRankView& view, uint32_t ws, uint32_t rank, IoMode io = IoMode::kAuto,
                         DeviceCopier* copier = nullptr, LoadStats* stats = nullptr,
                         uint64_t cold_span = 8192) {
    const auto& tensors = view.header().tensors;
    ASSERT_EQ(tensors.size(), tensors_.size());
    struct Free {
      void operator()(char* p) const { std::free(p); }
    };
    std::vector<std::unique_ptr<char, Free>> bufs;
    std::vector<LoadTarget> targets;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t n = (tensors[i].nbytes + 4095) / 4096 * 4096 + 4096;
      bufs.emplace_back(static_cast<char*>(std::aligned_alloc(4096, n)));
      std::memset(bufs.back().get(), 0, n);
      targets.push_back({tensors[i].name, bufs[i].get(), tensors[i].nbytes, copier != nullptr});
    }
    LoadOptions o;
    o.threads = 3;
    o.span_bytes = 8192;  // small pieces, so that a tensor is several pieces
    o.cold_span_bytes = cold_span;
    o.io = io;
    const LoadStats s = view.Load(targets, copier, o);
    if (stats) *stats = s;
    if (io != IoMode::kAuto || copier == nullptr) {  // kAuto reads O_DIRECT for device targets only
      EXPECT_EQ(s.direct_io, io == IoMode::kDirect) << view.description();
    }
    uint64_t total = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const test::TensorSpec& t = tensors_.at(tensors[i].name);
      EXPECT_EQ(std::string(bufs[i].get(), tensors[i].nbytes), test::BruteSlice(t, ws, rank))
          << view.description() << ": " << tensors[i].name << " rank " << rank << " of " << ws;
      total += tensors[i].nbytes;
    }
    EXPECT_EQ(s.bytes, total);
    EXPECT_EQ(s.tensors, tensors.size());
  }

  TempDir dir_;
  test::TensorMap tensors_;
};

TEST_F(SourceLoadTest, CheckpointViewHoldsEveryRanksSlice) {
  for (uint32_t ws : {1u, 2u, 3u, 5u, 8u}) {
    for (uint32_t r = 0; r < ws; ++r) {
      auto view = SourceRankView::OfCheckpoint(Src(), Fsdp2(ws), r, {});
      EXPECT_EQ(view->header().layout_key, "fsdp2-ws" + std::to_string(ws));
      EXPECT_EQ(view->header().rank, r);
      // World size 1 reads every file; a rank of more reads those that hold its rows.
      if (ws == 1) EXPECT_EQ(view->files().size(), 3u);
      EXPECT_GE(view->files().size(), 1u);
      EXPECT_LE(view->files().size(), 3u);
      ExpectBruteSlices(*view, ws, r);
    }
  }
}

TEST_F(SourceLoadTest, LayoutViewReshardsAnyWorldSize) {
  ConvertTo(3);
  for (uint32_t ws : {1u, 2u, 4u, 7u}) {
    for (uint32_t r = 0; r < ws; ++r) {
      auto view = SourceRankView::OfLayout(Out(), "fsdp2-ws3", Fsdp2(ws), r, {});
      EXPECT_EQ(view->description(), "layout fsdp2-ws3 of " + Out().string());
      if (ws == 1) EXPECT_EQ(view->files().size(), 3u);  // every rank file of fsdp2-ws3
      ExpectBruteSlices(*view, ws, r);
    }
  }
}

TEST_F(SourceLoadTest, LayoutViewDecodesZstdChunks) {
  ConvertTo(2, Codec::kZstd);
  for (uint32_t r = 0; r < 3; ++r) {
    ExpectBruteSlices(*SourceRankView::OfLayout(Out(), "fsdp2-ws2", Fsdp2(3), r, {}), 3, r);
  }
}

// O_DIRECT reads (what a load bound for the device does from a source on disk): the same
// bytes from a Hugging Face checkpoint (tensors at any offset: through the bounce buffer),
// from raw rank files (whole chunks straight into place) and from zstd ones.
TEST_F(SourceLoadTest, DirectReadsGiveTheSameBytes) {
  try {
    File::OpenRead(Src() / "model-00001-of-00003.safetensors").ReopenDirect();
  } catch (const Error& e) {
    GTEST_SKIP() << "this file system refuses O_DIRECT (" << e.what() << ")";
  }
  for (uint32_t r = 0; r < 3; ++r) {
    ExpectBruteSlices(*SourceRankView::OfCheckpoint(Src(), Fsdp2(3), r, {}), 3, r, IoMode::kDirect);
  }
  ConvertTo(3);
  for (uint32_t ws : {2u, 4u}) {
    for (uint32_t r = 0; r < ws; ++r) {
      ExpectBruteSlices(*SourceRankView::OfLayout(Out(), "fsdp2-ws3", Fsdp2(ws), r, {}), ws, r, IoMode::kDirect);
    }
  }
  fs::remove_all(Out());
  ConvertTo(2, Codec::kZstd);
  for (uint32_t r = 0; r < 3; ++r) {
    ExpectBruteSlices(*SourceRankView::OfLayout(Out(), "fsdp2-ws2", Fsdp2(3), r, {}), 3, r, IoMode::kDirect);
  }
}

// Runs of whole chunks are read O_DIRECT in one request and each chunk checked after: a
// tensor of 64 chunks per rank file, read at another world size, lands exactly, and a byte
// flipped in a chunk in the middle of a run is caught.
TEST_F(SourceLoadTest, DirectRunsOfWholeChunksAreEachChecked) {
  const fs::path src = dir_.path() / "big", out = dir_.path() / "big-out";
  tensors_ = WriteOneBigTensor(src, 9);
  try {
    File::OpenRead(src / "model-00001-of-00001.safetensors").ReopenDirect();
  } catch (const Error& e) {
    GTEST_SKIP() << "this file system refuses O_DIRECT (" << e.what() << ")";
  }
  ConvertDir(src, out, 2);
  for (uint32_t r = 0; r < 3; ++r) {
    ExpectBruteSlices(*SourceRankView::OfLayout(out, "fsdp2-ws2", Fsdp2(3), r, {}), 3, r, IoMode::kDirect);
    // From the safetensors file: reads of 64 KiB and more go O_DIRECT (its tensor data starts
    // at no particular alignment: through the bounce buffer), smaller ones buffered.
    for (uint64_t span : {uint64_t{8192}, uint64_t{1} << 20}) {
      ExpectBruteSlices(*SourceRankView::OfCheckpoint(src, Fsdp2(3), r, {}), 3, r, IoMode::kDirect, nullptr, nullptr,
                        span);
    }
  }
  const fs::path path = out / "fsdp2-ws2" / RankFileName(0, 2);
  const RankFileReader reader = RankFileReader::Open(path);
  const TensorEntry& e = reader.header().tensors.at(0);
  ASSERT_GE(e.nbytes, 40u * 4096);
  std::string bytes = test::ReadBytes(path);
  bytes[reader.preamble().data_offset + e.offset + 20 * 4096 + 77] ^= 0x10;  // chunk 20 of 64
  test::WriteBytes(path, bytes);
  // Rank 0 of 3 reads rows [0, 43): chunks 0-42 of this file, chunk 20 inside a run.
  try {
    ExpectBruteSlices(*SourceRankView::OfLayout(out, "fsdp2-ws2", Fsdp2(3), 0, {}), 3, 0, IoMode::kDirect);
    ADD_FAILURE() << "a flipped byte in a run of whole chunks was not caught";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(err.what()).find(path.string() + ": tensor \"w\" chunk 20: checksum mismatch"),
              std::string::npos)
        << err.what();
  }
}

// ReadRanges lists every byte a load reads: with every other byte of the source files'
// data overwritten, each rank's load is still exact (from the HF files, and from another
// layout's raw and zstd rank files, whose chunks are listed whole).
TEST_F(SourceLoadTest, ReadRangesHoldEveryByteALoadReads) {
  // Overwrites bytes [from, size) of `path` outside the listed ranges of that path.
  auto scribble = [](const std::string& path, uint64_t from, uint64_t to,
                     const std::vector<SourceRankView::Range>& ranges) {
    std::string bytes = test::ReadBytes(path);
    std::vector<bool> keep(bytes.size(), false);
    for (const auto& r : ranges) {
      if (r.path != path) continue;
      ASSERT_LE(r.offset + r.length, bytes.size()) << path;
      std::fill(keep.begin() + static_cast<long>(r.offset), keep.begin() + static_cast<long>(r.offset + r.length),
                true);
    }
    for (uint64_t i = from; i < std::min<uint64_t>(to, bytes.size()); ++i) {
      if (!keep[i]) bytes[i] = static_cast<char>(0xEE);
    }
    test::WriteBytes(path, bytes);
  };
  auto check_sorted = [](const std::vector<SourceRankView::Range>& ranges) {
    ASSERT_FALSE(ranges.empty());
    for (size_t i = 1; i < ranges.size(); ++i) {
      const auto& a = ranges[i - 1];
      const auto& b = ranges[i];
      EXPECT_TRUE(a.path < b.path || (a.path == b.path && a.offset + a.length < b.offset))
          << "ranges " << i - 1 << " and " << i << " are not sorted and merged";
    }
  };
  // From the HF files: rank 1 of 3 (another rank reads other rows: the scribble must not
  // matter to this one). Each file is scribbled past its safetensors header.
  {
    auto view = SourceRankView::OfCheckpoint(Src(), Fsdp2(3), 1, {});
    const auto ranges = view->ReadRanges();
    check_sorted(ranges);
    uint64_t listed = 0, lands = 0;
    for (const auto& r : ranges) listed += r.length;
    for (const TensorEntry& e : view->header().tensors) lands += e.nbytes;
    EXPECT_EQ(listed, lands);  // no conversion: exactly the bytes that land
    for (const std::string& f : view->files()) {
      const std::string head = test::ReadBytes(f).substr(0, 8);
      uint64_t n = 0;
      std::memcpy(&n, head.data(), 8);
      scribble(f, 8 + n, ~uint64_t{0}, ranges);
    }
    ExpectBruteSlices(*view, 3, 1);
  }
  SetUp();  // the source again
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    fs::remove_all(Out());
    ConvertTo(3, codec);
    auto view = SourceRankView::OfLayout(Out(), "fsdp2-ws3", Fsdp2(2), 0, {});
    const auto ranges = view->ReadRanges();
    check_sorted(ranges);
    uint64_t listed = 0, lands = 0;
    for (const auto& r : ranges) listed += r.length;
    for (const TensorEntry& e : view->header().tensors) lands += e.nbytes;
    EXPECT_GE(listed, codec == Codec::kRaw ? lands : 1);
    // Whole chunks: at most one more at each end of each tensor's piece in each rank file.
    if (codec == Codec::kRaw) EXPECT_LE(listed, lands + 2 * 4096 * 3 * view->header().tensors.size());
    for (const std::string& f : view->files()) {
      const RankFileReader r = RankFileReader::Open(f);
      scribble(f, r.preamble().data_offset, r.preamble().header_offset, ranges);
    }
    ExpectBruteSlices(*view, 2, 0);
  }
}

// kAuto reads a source out of the page cache O_DIRECT when every target is on the device,
// through read-ahead when a target is in host memory, and buffered when it is cached; every
// way lands the same bytes.
TEST_F(SourceLoadTest, AutoReadsAColdSourceDirectOnlyForDeviceTargets) {
  ConvertTo(3);
  auto view = SourceRankView::OfLayout(Out(), "fsdp2-ws3", Fsdp2(2), 1, {});
  bool direct_possible = true;
  try {
    File::OpenRead(view->files().front()).ReopenDirect();
  } catch (const Error&) {
    direct_possible = false;
  }
  for (bool device : {true, false}) {
    SCOPED_TRACE(device ? "device targets" : "host targets");
    for (const std::string& f : view->files()) test::Evict(f);
    if (PageCacheResidency(view->files().front()) > 0.5) GTEST_SKIP() << "the kernel kept the pages";
    test::HostDeviceCopier copier;
    LoadStats cold;
    ExpectBruteSlices(*view, 2, 1, IoMode::kAuto, device ? &copier : nullptr, &cold);
    EXPECT_TRUE(cold.cold);
    EXPECT_EQ(cold.direct_io, device && direct_possible);
    EXPECT_EQ(copier.misuse, "");
    LoadStats warm;  // the load read the files: now they are in the page cache
    for (const std::string& f : view->files()) {
      std::string all = test::ReadBytes(f);
      ASSERT_FALSE(all.empty());
    }
    ExpectBruteSlices(*view, 2, 1, IoMode::kAuto, device ? &copier : nullptr, &warm);
    EXPECT_FALSE(warm.cold);
    EXPECT_FALSE(warm.direct_io);
    EXPECT_EQ(copier.misuse, "");
  }
}

// A column split (a DTensor Shard(1) layout planned over the HF file) of 1/8 of each row
// reads one row's part at a time (FillStrided batches rows only while a quarter of what it
// reads is wanted): ReadRanges lists each, and nothing else of the file is needed.
TEST_F(SourceLoadTest, ReadRangesOfAColumnSplitListEveryRow) {
  const fs::path src = dir_.path() / "cols";
  const test::TensorMap cols = WriteOneBigTensor(src, 5);
  const ParallelPlan plan = ParseParallelPlan(R"J({"format": "reshard.parallel-plan", "format_version": 1,
    "name": "cols", "fsdp": {"mesh_dim": "dp_shard"},
    "rules": [{"pattern": "w", "placements": {"tp": "S(1)"}}]})J", "cols.json");
  LayoutSpec l;
  l.kind = LayoutKind::kDTensor;
  l.mesh = ParseMeshFlag("dp_shard=1,tp=8");
  l.world_size = 8;
  l.plan_name = plan.name;
  l.plan_xxh3 = plan.xxh3;
  const uint32_t rank = 2;  // columns [256, 384)
  auto view = SourceRankView::OfCheckpoint(src, l, rank, {}, "", &plan, "cols.json");
  EXPECT_EQ(view->files(), std::vector<std::string>{(src / "model-00001-of-00001.safetensors").string()});
  const auto ranges = view->ReadRanges();
  ASSERT_EQ(ranges.size(), 128u);  // one per row, 512 bytes each, 4 KiB apart
  for (const auto& r : ranges) EXPECT_EQ(r.length, 128u * 4);
  const std::string file = ranges.front().path;
  std::string bytes = test::ReadBytes(file);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  std::vector<bool> keep(bytes.size(), false);
  for (const auto& r : ranges) {
    for (uint64_t i = r.offset; i < r.offset + r.length; ++i) keep[i] = true;
  }
  for (uint64_t i = 8 + header; i < bytes.size(); ++i) {
    if (!keep[i]) bytes[i] = static_cast<char>(0xEE);
  }
  test::WriteBytes(file, bytes);
  ASSERT_EQ(view->header().tensors.size(), 1u);
  std::string got(view->header().tensors[0].nbytes, '\0');
  ASSERT_EQ(got.size(), 128u * 128 * 4);
  const LoadTarget t{"w", got.data(), got.size(), false};
  view->Load({&t, 1}, nullptr, LoadOptions{});
  const std::string& w = cols.at("w").data;
  for (uint64_t row = 0; row < 128; ++row) {
    ASSERT_EQ(got.substr(row * 512, 512), w.substr((row * 1024 + rank * 128) * 4, 512)) << "row " << row;
  }
}

TEST_F(SourceLoadTest, WholeTensorsStayWhole) {
  // The largest tensor with at least 2 rows, stored whole: every rank holds all of it.
  std::string name;
  for (const auto& [n, t] : tensors_) {
    if (t.shape.size() >= 1 && t.shape[0] >= 2 && (name.empty() || t.data.size() > tensors_.at(name).data.size())) {
      name = n;
    }
  }
  ASSERT_FALSE(name.empty());
  auto view = SourceRankView::OfCheckpoint(Src(), Fsdp2(3), 1, {name});
  for (const TensorEntry& e : view->header().tensors) {
    if (e.name != name) continue;
    EXPECT_FALSE(e.sharded);
    EXPECT_EQ(e.nbytes, tensors_.at(name).data.size());
    std::string buf(e.nbytes, '\0');
    const LoadTarget t{e.name, buf.data(), e.nbytes, false};
    view->Load({&t, 1}, nullptr, LoadOptions{});
    EXPECT_EQ(buf, tensors_.at(name).data);
  }
}

TEST_F(SourceLoadTest, FlippedByteInAChunkReadIsCaught) {
  ConvertTo(2);
  const fs::path path = Out() / "fsdp2-ws2" / RankFileName(1, 2);
  const RankFileReader r = RankFileReader::Open(path);
  const TensorEntry* big = nullptr;
  for (const auto& e : r.header().tensors) {
    if (!big || e.nbytes > big->nbytes) big = &e;
  }
  ASSERT_GT(big->nbytes, 4096u);
  std::string bytes = test::ReadBytes(path);
  bytes[r.preamble().data_offset + big->offset + big->nbytes - 1] ^= 0x40;  // its last chunk
  test::WriteBytes(path, bytes);
  for (IoMode io : {IoMode::kAuto, IoMode::kDirect}) {
    int caught = 0;
    for (uint32_t rank = 0; rank < 3; ++rank) {
      auto view = SourceRankView::OfLayout(Out(), "fsdp2-ws2", Fsdp2(3), rank, {});
      try {
        ExpectBruteSlices(*view, 3, rank, io);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
        EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
        ++caught;
      }
    }
    EXPECT_GE(caught, 1) << (io == IoMode::kDirect ? "O_DIRECT" : "buffered");
  }
}

// LayoutByteReader keeps one chunk read in part while every partial chunk is wanted once (a
// load: fresh buffers per chunk cost their page faults on every load), and up to 16 once a
// chunk has to be read again (rows that interleave chunks, a Shard(1) tensor's): each chunk of
// the interleaved rounds is read at most twice, every byte as the source holds it.
TEST_F(SourceLoadTest, LayoutReaderKeepsChunksOnlyWhenReadAgain) {
  // One tensor of 64 chunks per rank at world size 2.
  const fs::path src = dir_.path() / "big", out = dir_.path() / "big-out";
  const test::TensorMap big = WriteOneBigTensor(src, 7);
  ConvertDir(src, out, 2);
  const std::optional<Manifest> manifest = ReadManifest(out);
  ASSERT_TRUE(manifest);
  OpenedLayout opened;
  OpenLayout(out, *manifest, "fsdp2-ws2", opened);
  ASSERT_EQ(opened.bytes.tensors.size(), 1u);
  ASSERT_GE(opened.bytes.tensors[0].pieces.at(0).length, 6u * 4096);
  const uint64_t start = opened.bytes.starts[0];
  const std::string& want = big.at("w").data;
  auto read = [&](LayoutByteReader& r, uint64_t at, size_t n) {
    std::string got(n, '\0');
    r.Read(start + at, n, got.data());
    EXPECT_EQ(got, want.substr(at, n)) << "bytes " << at << "+" << n;
  };
  {
    LayoutByteReader r(opened.bytes, /*verify=*/true);
    for (uint64_t k = 0; k < 6; ++k) read(r, k * 4096 + 100, 200);  // each chunk once, in part
    EXPECT_EQ(r.partial_chunk_reads(), 6u);
    EXPECT_EQ(r.kept_chunks(), 1u);
  }
  {
    LayoutByteReader r(opened.bytes, /*verify=*/true);
    for (uint64_t round = 0; round < 10; ++round) {
      for (uint64_t k = 0; k < 4; ++k) read(r, k * 4096 + round * 64, 64);
    }
    EXPECT_LE(r.partial_chunk_reads(), 8u);  // 40 with one buffer
    EXPECT_EQ(r.kept_chunks(), 4u);
  }
}

TEST_F(SourceLoadTest, Refusals) {
  EXPECT_THROW(SourceRankView::OfCheckpoint(Src(), Fsdp2(2), 2, {}), Error);
  ConvertTo(2);
  EXPECT_THROW(SourceRankView::OfLayout(Out(), "fsdp2-ws5", Fsdp2(2), 0, {}), Error);
  LayoutSpec fsdp1 = Fsdp2(2);
  fsdp1.kind = LayoutKind::kFsdp1;
  try {
    SourceRankView::OfCheckpoint(Src(), fsdp1, 0, {});
    ADD_FAILURE() << "an FSDP1 view without a model manifest was planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model manifest"), std::string::npos) << e.what();
  }
  auto view = SourceRankView::OfCheckpoint(Src(), Fsdp2(2), 0, {});
  const LoadTarget wrong{"no.such.tensor", nullptr, 0, false};
  EXPECT_THROW(view->Load({&wrong, 1}, nullptr, LoadOptions{}), Error);
  std::string buf(1, '\0');
  const TensorEntry& e = view->header().tensors.front();
  const LoadTarget short_target{e.name, buf.data(), e.nbytes + 1, false};
  EXPECT_THROW(view->Load({&short_target, 1}, nullptr, LoadOptions{}), Error);
}

}  // namespace
}  // namespace reshard
