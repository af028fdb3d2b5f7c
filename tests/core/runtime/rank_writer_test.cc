// RankFileWriter (reshard/io/rank_file_writer.h, the writer of convert and save) and
// SaveRankFile: files written from memory read back through RankFileReader and the test's
// own decoder (test_util), bytes and checksums equal to ones computed independently; raw
// chunks in any order equal to appended bytes; zstd frames; incomplete or corrupted files
// never reach their final name; the manifest of a saved layout.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/layout.h"
#include "reshard/format/manifest.h"
#include "reshard/io/manifest.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"
#include "reshard/ops/verify.h"
#include "reshard/runtime/rank_writer.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::ThrowsError;

constexpr uint64_t kChunk = 8192;

struct Spec {
  std::string name;
  DType dtype;
  std::vector<uint64_t> global_shape;
};

// Entries of rank `rank` of `ws` for the specs, by the FSDP2 rule (0-dim stored whole).
RankFileHeader MakeHeader(const std::vector<Spec>& specs, uint32_t ws, uint32_t rank,
                          const SourceFingerprint& source) {
  RankFileHeader h;
  h.layout_key = "fsdp2-ws" + std::to_string(ws);
  h.world_size = ws;
  h.rank = rank;
  h.source = source;
  h.chunk_size = kChunk;
  for (const auto& s : specs) {
    TensorEntry e;
    e.name = s.name;
    e.dtype = s.dtype;
    e.global_shape = s.global_shape;
    e.local_shape = s.global_shape;
    if (!s.global_shape.empty()) {
      auto [a, b] = test::BruteRows(s.global_shape[0], ws, rank);
      e.sharded = true;
      e.rows = {a, b};
      e.local_shape[0] = b - a;
    }
    h.tensors.push_back(e);
  }
  return h;
}

uint64_t Bytes(const TensorEntry& e) {
  uint64_t n = test::DtypeBits(Name(e.dtype));
  for (uint64_t d : e.local_shape) n *= d;
  return n / 8;
}

const std::vector<Spec> kSpecs = {
    {"embed", DType::kBF16, {37, 48}},     // 3552 bytes per rank of 2
    {"big", DType::kF32, {301, 29}},       // several chunks, odd sizes
    {"scalar", DType::kF32, {}},           // 0-dim: whole
    {"few_rows", DType::kI64, {1, 3}},     // rank 1 of 2 holds no rows
    {"empty", DType::kF16, {0, 4}},
};

SourceFingerprint Saved(uint64_t id, std::optional<uint64_t> step) {
  return SourceFingerprint::FromSaved({id, step});
}

TEST(RankFileWriter, RoundTripInPiecesOfEverySize) {
  TempDir dir;
  for (uint32_t rank : {0u, 1u}) {
    RankFileHeader h = MakeHeader(kSpecs, 2, rank, Saved(0x1234, 7));
    const fs::path path = dir / RankFileName(rank, 2);
    std::vector<std::string> data;
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      data.push_back(test::PatternBytes(Bytes(h.tensors[i]), 100 * rank + i));
    }
    RankFileWriter w = RankFileWriter::Create(path, h);
    EXPECT_FALSE(fs::exists(path));
    EXPECT_TRUE(fs::exists(w.temp_path()));
    // Interleave tensors and cut them in pieces that cross chunk boundaries (1, 4095, 5000,
    // 8192, ... bytes), backwards over tensors, to exercise the streaming checksums.
    const uint64_t piece_sizes[] = {1, 4095, 5000, 8192, 13, 20000};
    std::vector<uint64_t> at(data.size(), 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (size_t j = data.size(); j-- > 0;) {
        if (at[j] == data[j].size()) continue;
        const uint64_t n = std::min<uint64_t>(piece_sizes[(at[j] + j) % 6], data[j].size() - at[j]);
        w.Append(j, data[j].data() + at[j], n);
        at[j] += n;
        progress = true;
      }
    }
    const uint64_t size = w.Commit(/*verify_data=*/true);
    EXPECT_FALSE(fs::exists(w.temp_path()));
    ASSERT_TRUE(fs::exists(path));
    EXPECT_EQ(size, fs::file_size(path));

    RankFileReader r = RankFileReader::Open(path);
    EXPECT_TRUE(r.header().source == Saved(0x1234, 7));
    ASSERT_TRUE(r.header().source.saved.has_value());
    EXPECT_EQ(r.header().source.saved->step, std::optional<uint64_t>(7));
    const auto raw = test::RawRankFile::Read(path);
    for (size_t i = 0; i < data.size(); ++i) {
      const TensorEntry* e = r.header().Find(kSpecs[i].name);
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->offset % 4096, 0u);
      std::string got(e->nbytes, '\0');
      r.ReadTensor(*e, got.data());
      EXPECT_TRUE(test::SameBytes(got, data[i]));
      // Independently: the test's decoder and reference hashes agree.
      EXPECT_TRUE(test::SameBytes(test::RawTensorBytes(raw, e->name), data[i]));
      EXPECT_EQ(e->chunk_xxh3, test::RefChunkHashes(data[i], kChunk)) << e->name;
      EXPECT_EQ(e->xxh3, test::RefCombine(test::RefChunkHashes(data[i], kChunk)));
    }
  }
  VerifyOptions vo;
  vo.path = dir.path();
  VerifyReport report = Verify(vo);
  EXPECT_TRUE(report.ok()) << (report.problems.empty() ? "" : report.problems[0].message);
  EXPECT_EQ(report.files, 2u);
}

TEST(RankFileWriter, IncompleteCommitRefusedAndNothingLeft) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(1, std::nullopt));
  const fs::path path = dir / RankFileName(0, 2);
  fs::path tmp;
  {
    RankFileWriter w = RankFileWriter::Create(path, h);
    tmp = w.temp_path();
    const std::string d = test::PatternBytes(Bytes(w.header().tensors[0]), 1);
    w.Append(0, d.data(), d.size());
    EXPECT_TRUE(ThrowsError([&] { w.Commit(); }, ErrorCode::kInvalidArgument,
                            {"tensor \"big\" is incomplete: 0 of"}));
    EXPECT_FALSE(fs::exists(tmp));
  }
  EXPECT_FALSE(fs::exists(path));
  {
    RankFileWriter w = RankFileWriter::Create(path, h);
    tmp = w.temp_path();
    EXPECT_TRUE(ThrowsError([&] { w.Append(0, "x", Bytes(w.header().tensors[0]) + 1); },
                            ErrorCode::kInvalidArgument, {"\"embed\"", "appending"}));
  }  // destroyed without Commit: the temporary goes
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

TEST(RankFileWriter, CorruptedBeforeCommitRefused) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(2, 3));
  const fs::path path = dir / RankFileName(0, 2);
  RankFileWriter w = RankFileWriter::Create(path, h);
  for (size_t i = 0; i < w.header().tensors.size(); ++i) {
    const std::string d = test::PatternBytes(w.header().tensors[i].nbytes, i);
    w.Append(i, d.data(), d.size());
  }
  // Another process (or the disk) changes a byte of tensor "big" after it was hashed.
  const TensorEntry& big = w.header().tensors[w.IndexOf("big")];
  {
    std::string all = test::ReadBytes(w.temp_path());
    all[kDataOffset + big.offset + 9000] ^= 0x40;
    test::WriteBytes(w.temp_path(), all);
  }
  EXPECT_TRUE(ThrowsError([&] { w.Commit(/*verify_data=*/true); }, ErrorCode::kDataLoss,
                          {"\"big\"", "chunk 1", "checksum mismatch"}));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

TEST(RankFileWriter, TruncatedBeforeCommitRefused) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(2, 3));
  const fs::path path = dir / RankFileName(0, 2);
  RankFileWriter w = RankFileWriter::Create(path, h);
  for (size_t i = 0; i < w.header().tensors.size(); ++i) {
    const std::string d = test::PatternBytes(w.header().tensors[i].nbytes, i);
    w.Append(i, d.data(), d.size());
  }
  // The data written so far is lost (zeros after the truncation): the header the writer
  // then writes is valid, but the re-read of every chunk before the rename finds it.
  ASSERT_EQ(::truncate(w.temp_path().c_str(), 4096), 0);
  EXPECT_TRUE(ThrowsError([&] { w.Commit(/*verify_data=*/true); }, ErrorCode::kDataLoss,
                          {"checksum mismatch"}));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

TEST(RankFileWriter, BadEntriesRefusedBeforeWriting) {
  TempDir dir;
  const fs::path path = dir / RankFileName(1, 2);
  RankFileHeader h = MakeHeader(kSpecs, 2, 1, Saved(3, 1));
  h.tensors[1].rows = {0, 151};  // rank 1 of 2 holds [151, 301)
  h.tensors[1].local_shape[0] = 151;
  EXPECT_TRUE(ThrowsError([&] { RankFileWriter::Create(path, h); }, ErrorCode::kInvalidArgument,
                          {"cannot write", "\"big\"", "FSDP2 chunk rule"}));
  h = MakeHeader(kSpecs, 2, 1, Saved(3, 1));
  h.tensors.push_back(h.tensors[0]);
  EXPECT_TRUE(ThrowsError([&] { RankFileWriter::Create(path, h); }, ErrorCode::kInvalidArgument,
                          {"unique names"}));
  h = MakeHeader(kSpecs, 2, 1, Saved(3, 1));
  h.chunk_size = 1000;
  EXPECT_TRUE(ThrowsError([&] { RankFileWriter::Create(path, h); }, ErrorCode::kInvalidArgument,
                          {"chunk_size 1000"}));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

// Whole chunks, in reverse order and from two threads at once, give the same bytes as the
// same tensors appended in order: the two ways into a raw file are one layout.
TEST(RankFileWriter, WholeChunksInAnyOrderFromThreadsEqualAppend) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(4, 2));
  std::vector<std::string> data;
  for (const auto& e : h.tensors) data.push_back(test::PatternBytes(Bytes(e), 70 + data.size()));
  const fs::path appended = dir / "a" / RankFileName(0, 2);
  const fs::path chunked = dir / "c" / RankFileName(0, 2);
  fs::create_directories(appended.parent_path());
  fs::create_directories(chunked.parent_path());
  {
    RankFileWriter w = RankFileWriter::Create(appended, h);
    for (size_t i = 0; i < data.size(); ++i) w.Append(i, data[i].data(), data[i].size());
    w.Commit();
  }
  RankFileWriter w = RankFileWriter::Create(chunked, h, {Codec::kRaw, false});
  std::vector<std::pair<size_t, uint64_t>> chunks;  // (tensor, chunk), last first
  for (size_t i = 0; i < data.size(); ++i) {
    for (uint64_t c = 0; c < w.header().tensors[i].ChunkCount(kChunk); ++c) chunks.push_back({i, c});
  }
  std::reverse(chunks.begin(), chunks.end());
  auto write = [&](size_t parity) {
    ChunkEncoder enc(Codec::kRaw, kChunk);
    for (size_t k = parity; k < chunks.size(); k += 2) {
      const auto [i, c] = chunks[k];
      const char* at = data[i].data() + c * kChunk;
      w.WriteChunk(i, c, w.EncodeChunk(i, c, at, enc));
    }
  };
  std::thread other(write, 1);
  write(0);
  other.join();
  for (size_t i = 0; i < data.size(); ++i) EXPECT_EQ(w.Written(i), data[i].size());
  w.Commit(/*verify_data=*/true);
  EXPECT_TRUE(test::SameBytes(test::ReadBytes(chunked), test::ReadBytes(appended)));
}

// zstd: one frame per chunk, appended in file order; empty tensors stay raw and sit after
// their predecessor; the file reads back through the reader and the test's frame table.
TEST(RankFileWriter, ZstdFramesAppendedInFileOrder) {
  TempDir dir;
  const fs::path path = dir / RankFileName(1, 2);
  RankFileHeader h = MakeHeader(kSpecs, 2, 1, Saved(6, 1));
  RankFileWriter w = RankFileWriter::Create(path, h, {Codec::kZstd});
  EXPECT_EQ(w.codec(), Codec::kZstd);
  std::vector<std::string> data;
  for (const auto& e : w.header().tensors) {
    // Half the bytes repeat, so that frames are smaller than their chunks.
    std::string d = test::PatternBytes(e.nbytes / 2, 90 + data.size());
    d += std::string(e.nbytes - d.size(), 'z');
    data.push_back(d);
  }
  EXPECT_TRUE(ThrowsError([&] { w.Append(0, data[0].data(), 1); }, ErrorCode::kInvalidArgument,
                          {"Append writes raw files"}));
  ChunkEncoder raw(Codec::kRaw, kChunk);
  EXPECT_TRUE(ThrowsError([&] { w.EncodeChunk(0, 0, data[0].data(), raw); },
                          ErrorCode::kInvalidArgument, {"a raw encoder for a zstd file"}));
  ChunkEncoder enc(Codec::kZstd, kChunk, 3);
  uint64_t stored = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    for (uint64_t c = 0; c < w.header().tensors[i].ChunkCount(kChunk); ++c) {
      const auto frame = w.EncodeChunk(i, c, data[i].data() + c * kChunk, enc);
      stored += frame.size();
      w.WriteChunk(i, c, frame);
    }
  }
  const uint64_t size = w.Commit(/*verify_data=*/true);
  EXPECT_EQ(size, fs::file_size(path));
  RankFileReader r = RankFileReader::Open(path);
  uint64_t total_stored = 0, previous_end = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const TensorEntry& e = r.header().tensors[i];
    EXPECT_EQ(e.codec, e.nbytes == 0 ? Codec::kRaw : Codec::kZstd) << e.name;
    EXPECT_EQ(e.frames.size(), e.nbytes == 0 ? 0u : e.ChunkCount(kChunk)) << e.name;
    EXPECT_EQ(e.offset % 4096, 0u) << e.name;
    EXPECT_GE(e.offset, previous_end) << e.name;
    previous_end = e.offset + e.stored_size;
    total_stored += e.stored_size;
    EXPECT_EQ(e.chunk_xxh3, test::RefChunkHashes(data[i], kChunk)) << e.name;
    std::string got(e.nbytes, '\0');
    r.ReadTensor(e, got.data());
    EXPECT_TRUE(test::SameBytes(got, data[i])) << e.name;
  }
  EXPECT_EQ(total_stored, stored);
  uint64_t decoded = 0;
  for (const auto& d : data) decoded += d.size();
  EXPECT_LT(stored, decoded);  // frames, not chunks
}

TEST(RankFileWriter, ZstdIncompleteCommitRefused) {
  TempDir dir;
  const fs::path path = dir / RankFileName(0, 2);
  RankFileWriter w = RankFileWriter::Create(path, MakeHeader(kSpecs, 2, 0, Saved(8, 8)),
                                            {Codec::kZstd});
  ChunkEncoder enc(Codec::kZstd, kChunk);
  const std::string d = test::PatternBytes(kChunk, 3);
  w.WriteChunk(0, 0, w.EncodeChunk(0, 0, d.data(), enc));
  EXPECT_TRUE(ThrowsError([&] { w.Commit(); }, ErrorCode::kInvalidArgument,
                          {"tensor \"big\" is incomplete: 0 of"}));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

TEST(SaveRankFile, HostSourcesAndManifest) {
  TempDir dir;
  const fs::path out = dir / "out";
  fs::create_directories(out / "fsdp2-ws2");
  const SourceFingerprint source = Saved(0xfeed, 12);
  LayoutSpec spec{LayoutKind::kFsdp2, 2, "keep"};
  EXPECT_TRUE(ThrowsError([&] { WriteSavedManifest(out, spec, source, {}); },
                          ErrorCode::kDataLoss, {"rank 0, 1 missing"}));
  std::map<std::string, std::string> written;
  for (uint32_t rank : {0u, 1u}) {
    RankFileHeader h = MakeHeader(kSpecs, 2, rank, source);
    std::vector<std::string> data;
    std::vector<SaveSource> sources;
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      data.push_back(test::PatternBytes(Bytes(h.tensors[i]), 7 + rank * 10 + i));
    }
    for (size_t i = 0; i < h.tensors.size(); ++i) {
      sources.push_back({h.tensors[i].name, data[i].data(), data[i].size(), false});
    }
    std::vector<size_t> order;
    SaveOptions o;
    o.before_tensor = [&](size_t i) { order.push_back(i); };
    std::vector<SaveSource> reversed(sources.rbegin(), sources.rend());  // matched by name
    SaveReport rep = SaveRankFile(out / "fsdp2-ws2" / RankFileName(rank, 2), h, reversed,
                                  nullptr, o);
    EXPECT_EQ(order.size(), kSpecs.size());
    uint64_t total = 0;
    for (const auto& d : data) total += d.size();
    EXPECT_EQ(rep.bytes, total);
    RankFileReader r = RankFileReader::Open(out / "fsdp2-ws2" / RankFileName(rank, 2));
    EXPECT_EQ(rep.header_xxh3, r.preamble().header_xxh3);
    for (size_t i = 0; i < data.size(); ++i) {
      std::string got(data[i].size(), '\0');
      r.ReadTensor(*r.header().Find(kSpecs[i].name), got.data());
      EXPECT_TRUE(test::SameBytes(got, data[i]));
    }
    if (rank == 0) {
      EXPECT_TRUE(ThrowsError([&] { WriteSavedManifest(out, spec, source, {}); },
                              ErrorCode::kDataLoss, {"rank 1 missing"}));
    }
  }
  ManifestLayout l = WriteSavedManifest(out, spec, source, {"config.json"});
  EXPECT_TRUE(l.complete);
  auto m = ReadManifest(out);
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->source == source);
  EXPECT_EQ(m->aux_files, std::vector<std::string>{"config.json"});
  EXPECT_TRUE(m->layouts.at("fsdp2-ws2").complete);
  // Another save's source into the same directory is refused.
  EXPECT_TRUE(ThrowsError([&] { WriteSavedManifest(out, spec, Saved(0xbeef, 12), {}); },
                          ErrorCode::kMismatch, {"another source"}));
  test::WriteBytes(out / "config.json", "{}");
  VerifyOptions vo;
  vo.path = out;
  VerifyReport report = Verify(vo);
  EXPECT_TRUE(report.ok()) << (report.problems.empty() ? "" : report.problems[0].message);
  EXPECT_EQ(report.files, 2u);
}

// A save removes the temporaries that dead writers on this host left for the file it writes
// (a killed save's full-size temporary); a live writer's, another host's and other files'
// temporaries stay.
TEST(SaveRankFile, RemovesDeadWritersTemporariesOfItsFile) {
  TempDir dir;
  const fs::path d = dir / "fsdp2-ws2";
  fs::create_directories(d);
  const std::string host = SafeHostName();
  const std::string name = RankFileName(1, 2);
  pid_t dead = ::fork();  // a pid that is surely not running: a child that has exited
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(dead, &status, 0), dead);
  const std::string dead_tmp = "." + name + ".tmp-" + host + "-" + std::to_string(dead);
  const std::string old_style = "." + name + ".tmp-" + std::to_string(dead);
  const std::string live_tmp = "." + name + ".tmp-" + host + "-" + std::to_string(::getppid());
  const std::string other_host = "." + name + ".tmp-elsewhere-" + std::to_string(dead);
  const std::string other_file = "." + RankFileName(0, 2) + ".tmp-" + host + "-" + std::to_string(dead);
  for (const auto& n : {dead_tmp, old_style, live_tmp, other_host, other_file}) {
    test::WriteBytes(d / n, std::string(4096, 'x'));
  }
  RankFileHeader h = MakeHeader(kSpecs, 2, 1, Saved(0xfeed, 3));
  std::vector<std::string> data;
  std::vector<SaveSource> sources;
  for (const auto& e : h.tensors) data.push_back(test::PatternBytes(Bytes(e), 5));
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    sources.push_back({h.tensors[i].name, data[i].data(), data[i].size(), false});
  }
  SaveRankFile(d / name, h, sources, nullptr, SaveOptions{});
  EXPECT_FALSE(fs::exists(d / dead_tmp));
  EXPECT_FALSE(fs::exists(d / old_style));
  EXPECT_TRUE(fs::exists(d / live_tmp));
  EXPECT_TRUE(fs::exists(d / other_host));
  EXPECT_TRUE(fs::exists(d / other_file));
  EXPECT_TRUE(fs::exists(d / name));
}

// A device copier whose "device" is host memory and whose copies land only when waited for,
// as an asynchronous copy would: appending a staging buffer before waiting for its copy, or
// reusing a slot whose copy is still in flight, gives wrong bytes or a recorded misuse.
class DeferredCopier final : public DeviceCopier {
 public:
  void* Staging(int lane, int slot, size_t bytes) override {
    auto& b = buffers_[{lane, slot}];
    if (b.size() < bytes) b.assign(bytes, '\0');
    return b.data();
  }
  void CopyAsync(int, int, void*, const void*, size_t) override { misuse = "CopyAsync"; }
  void CopyToHostAsync(int lane, int slot, void* dst, const void* src, size_t n) override {
    auto& p = pending_[{lane, slot}];
    if (p.n) misuse = "slot reused while its copy is in flight";
    p = {dst, src, n};
    // What a reader of the buffer would see before the copy completes.
    std::memset(dst, 0xAB, n);
    ++copies;
  }
  void WaitSlot(int lane, int slot) override {
    auto& p = pending_[{lane, slot}];
    if (p.n) std::memcpy(p.dst, p.src, p.n);
    p = {};
  }
  void Synchronize() override {
    for (auto& [k, p] : pending_) WaitSlot(k.first, k.second);
  }
  void BindThread(int) override {}

  std::string misuse;
  int copies = 0;

 private:
  struct Pending {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t n = 0;
  };
  std::map<std::pair<int, int>, std::string> buffers_;
  std::map<std::pair<int, int>, Pending> pending_;
};

TEST(SaveRankFile, DeviceSourcesThroughDoubleBufferedStaging) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(9, 9));
  const fs::path path = dir / RankFileName(0, 2);
  std::vector<std::string> data;
  std::vector<SaveSource> sources;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    data.push_back(test::PatternBytes(Bytes(h.tensors[i]), 50 + i));
  }
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    // Every other tensor "on the device".
    sources.push_back({h.tensors[i].name, data[i].data(), data[i].size(), i % 2 == 1});
  }
  DeferredCopier copier;
  SaveOptions o;
  o.staging_bytes = 8192;  // two 4096-byte halves: "big" (17458 bytes) takes 5 pieces
  SaveReport rep = SaveRankFile(path, h, sources, &copier, o);
  EXPECT_EQ(copier.misuse, "");
  EXPECT_EQ(rep.staging_bytes, 8192u);
  EXPECT_GE(copier.copies, 5);
  RankFileReader r = RankFileReader::Open(path);
  for (size_t i = 0; i < data.size(); ++i) {
    std::string got(data[i].size(), '\0');
    r.ReadTensor(*r.header().Find(kSpecs[i].name), got.data());
    EXPECT_TRUE(test::SameBytes(got, data[i])) << kSpecs[i].name;
  }
}

TEST(SaveRankFile, SourcesMustMatchEntries) {
  TempDir dir;
  RankFileHeader h = MakeHeader(kSpecs, 2, 0, Saved(5, 5));
  const fs::path path = dir / RankFileName(0, 2);
  std::vector<std::string> data;
  std::vector<SaveSource> sources;
  for (const auto& e : MakeHeader(kSpecs, 2, 0, Saved(5, 5)).tensors) data.push_back(std::string(Bytes(e), 'x'));
  for (size_t i = 0; i < data.size(); ++i) sources.push_back({kSpecs[i].name, data[i].data(), data[i].size(), false});
  auto missing = sources;
  missing.pop_back();
  EXPECT_TRUE(ThrowsError([&] { SaveRankFile(path, h, missing, nullptr, {}); },
                          ErrorCode::kInvalidArgument, {"no source for tensor \"empty\""}));
  auto short_one = sources;
  short_one[1].nbytes -= 4;
  EXPECT_TRUE(ThrowsError([&] { SaveRankFile(path, h, short_one, nullptr, {}); },
                          ErrorCode::kInvalidArgument, {"\"big\"", "the source has"}));
  auto on_device = sources;
  on_device[0].on_device = true;
  EXPECT_TRUE(ThrowsError([&] { SaveRankFile(path, h, on_device, nullptr, {}); },
                          ErrorCode::kInvalidArgument, {"device copier"}));
  EXPECT_TRUE(test::ListFiles(dir.path()).empty());
}

TEST(SavedSource, FingerprintAndJsonRoundTrip) {
  const SourceFingerprint a = Saved(0x0123456789abcdefull, 40);
  // formats/rank-file.md: XXH3-64 of "saved\0<id hex16>\0<step>\n".
  const std::string canonical = std::string("saved\0", 6) + "0123456789abcdef" +
                                std::string("\0", 1) + "40\n";
  EXPECT_EQ(a.fingerprint, test::RefXxh3(canonical));
  const std::string no_step = std::string("saved\0", 6) + "0123456789abcdef" +
                              std::string("\0", 1) + "\n";
  EXPECT_EQ(Saved(0x0123456789abcdefull, std::nullopt).fingerprint, test::RefXxh3(no_step));
  EXPECT_FALSE(a == Saved(0x0123456789abcdefull, 41));
  EXPECT_FALSE(a == SourceFingerprint::FromFiles({}));
  // Through a manifest: parsed, recomputed, equal; a tampered step is refused.
  Manifest m;
  m.source = a;
  const std::string text = SerializeManifest(m);
  EXPECT_TRUE(ParseManifest(text, "m.json").source == a);
  std::string bad = text;
  const auto at = bad.find("\"step\": 40");
  ASSERT_NE(at, std::string::npos);
  bad.replace(at, 10, "\"step\": 41");
  EXPECT_TRUE(ThrowsError([&] { ParseManifest(bad, "m.json"); }, ErrorCode::kDataLoss,
                          {"source.fingerprint", "computed from source.saved"}));
}

}  // namespace
}  // namespace reshard
