// Rank files (formats/rank-file.md): a file written by Convert is checked against the spec
// with the test's own decoder, read back through RankFileReader, and then broken one
// invariant at a time. Header edits re-serialize the JSON and recompute header_xxh3 and the
// preamble (test_util's EditRankHeader), so that each variant fails for exactly one reason.
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/io/checkpoint.h"
#include "reshard/io/rank_file.h"
#include "reshard/ops/convert.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

using test::ojson;
using test::TempDir;
using test::ThrowsError;

constexpr uint64_t kChunk = 4096;

ojson& Entry(ojson& header, const std::string& name) {
  for (auto& t : header["tensors"]) {
    if (t["name"] == name) return t;
  }
  throw std::runtime_error("no tensor " + name);
}

class RankFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_ = test::WriteShardedCheckpoint(dir_ / "src", test::AwkwardCheckpointFiles(3));
  }

  // Converts the source into dir_/out (world size `ws`) and returns rank `rank`'s file.
  fs::path Convert(Codec codec, uint32_t ws = 2, uint32_t rank = 0) {
    ConvertOptions o;
    o.source = dir_ / "src";
    o.out = dir_ / "out";
    o.layout.world_size = ws;
    o.threads = 2;
    o.codec = codec;
    o.chunk_size = kChunk;
    reshard::Convert(o);
    return dir_ / "out" / ("fsdp2-ws" + std::to_string(ws)) / RankFileName(rank, ws);
  }

  // A copy of rank 0 (raw) to break.
  fs::path Victim(Codec codec = Codec::kRaw) {
    const fs::path good = Convert(codec);
    const fs::path v = dir_ / "victim.reshard";
    fs::copy_file(good, v, fs::copy_options::overwrite_existing);
    return v;
  }

  ::testing::AssertionResult OpenFails(const fs::path& p,
                                       std::initializer_list<std::string_view> needles,
                                       ErrorCode code = ErrorCode::kDataLoss) {
    auto r = ThrowsError([&] { RankFileReader::Open(p); }, code, needles);
    if (!r) return r;
    return ThrowsError([&] { RankFileReader::Open(p); }, code, {p.string()});
  }

  // Replaces the preamble with one built from the given fields (correct preamble_xxh3).
  void RewritePreamble(const fs::path& p, const std::function<void(test::RawRankFile&)>& edit) {
    test::RawRankFile f = test::RawRankFile::Read(p);
    edit(f);
    f.bytes.replace(0, 64, test::RefPreamble(f.format_version, f.flags, f.data_offset, f.data_size,
                                             f.header_offset, f.header_size, f.header_xxh3));
    test::WriteBytes(p, f.bytes);
  }

  void FlipByte(const fs::path& p, uint64_t at, unsigned char mask = 0x01) {
    std::string b = test::ReadBytes(p);
    b[at] = static_cast<char>(b[at] ^ mask);
    test::WriteBytes(p, b);
  }

  TempDir dir_;
  test::TensorMap tensors_;
};

// ---- valid files ---------------------------------------------------------------------------

TEST_F(RankFileTest, ConvertedFileFollowsTheSpecByteForByte) {
  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const fs::path p = Convert(Codec::kRaw, 2, rank);
    const test::RawRankFile f = test::RawRankFile::Read(p);
    const unsigned char magic[8] = {0x89, 'R', 'S', 'H', 'D', '\r', '\n', 0x1a};
    EXPECT_EQ(std::memcmp(f.bytes.data(), magic, 8), 0);
    EXPECT_EQ(f.format_version, 1u);
    EXPECT_EQ(f.flags, 0u);
    EXPECT_EQ(f.data_offset, 4096u);
    EXPECT_EQ(f.data_size % 4096, 0u);
    EXPECT_EQ(f.header_offset, 4096 + f.data_size);
    EXPECT_EQ(f.header_xxh3, test::RefXxh3(std::string_view(f.bytes).substr(f.header_offset)));
    EXPECT_EQ(test::Le64(f.bytes, 56), test::RefXxh3(std::string_view(f.bytes).substr(0, 56)));
    EXPECT_EQ(f.bytes.substr(64, 4096 - 64), std::string(4096 - 64, '\0'));

    const ojson& h = f.header;
    EXPECT_EQ(h["format"], "reshard.rank");
    EXPECT_EQ(h["format_version"], 1);
    EXPECT_EQ(h["layout"]["key"], "fsdp2-ws2");
    EXPECT_EQ(h["layout"]["kind"], "fsdp2");
    EXPECT_EQ(h["layout"]["world_size"], 2);
    EXPECT_EQ(h["layout"]["dtype"], "keep");
    EXPECT_EQ(h["rank"], rank);
    EXPECT_EQ(h["chunk_size"], kChunk);
    EXPECT_EQ(h["source"]["files"].size(), 3u);
    EXPECT_EQ(h["source"]["files"][0]["name"], "model-00001-of-00003.safetensors");

    // Source order (file, offset), not name order.
    std::vector<std::string> names;
    for (const auto& t : h["tensors"]) names.push_back(t["name"]);
    EXPECT_EQ(names, (std::vector<std::string>{
                         "model.embed_tokens.weight", "model.scale",
                         "model.layers.0.mlp.up_proj.weight", "model.empty",
                         "model.layers.0.input_layernorm.weight",
                         "model.layers.1.self_attn.q_proj.weight", "model.layers.1.tiny",
                         "model.step", "lm_head.weight", "model.mask", "model.zero_rows",
                         "model.norm.weight", "model.layers.2.big"}));

    uint64_t previous_end = 0;
    for (const auto& t : h["tensors"]) {
      const std::string name = t["name"];
      SCOPED_TRACE(name);
      const test::TensorSpec& src = tensors_.at(name);
      const std::string expected = test::BruteSlice(src, 2, rank);
      EXPECT_EQ(t["dtype"], src.dtype);
      EXPECT_EQ(t["global_shape"].get<std::vector<uint64_t>>(), src.shape);
      if (src.shape.empty()) {
        EXPECT_TRUE(t["shard"].is_null());
        EXPECT_EQ(t["local_shape"].get<std::vector<uint64_t>>(), src.shape);
      } else {
        auto [s, e] = test::BruteRows(src.shape[0], 2, rank);
        EXPECT_EQ(t["shard"].size(), 3u);
        EXPECT_EQ(t["shard"]["dim"], 0);
        EXPECT_EQ(t["shard"]["start"], s);
        EXPECT_EQ(t["shard"]["end"], e);
        std::vector<uint64_t> local = src.shape;
        local[0] = e - s;
        EXPECT_EQ(t["local_shape"].get<std::vector<uint64_t>>(), local);
      }
      EXPECT_EQ(t["nbytes"], expected.size());
      EXPECT_EQ(t["stored_size"], expected.size());
      EXPECT_EQ(t["codec"], "raw");
      EXPECT_FALSE(t.contains("frames"));
      const uint64_t offset = t["offset"];
      EXPECT_EQ(offset % 4096, 0u);
      EXPECT_GE(offset, previous_end);
      // Padding between tensors is zero.
      EXPECT_EQ(f.bytes.substr(4096 + previous_end, offset - previous_end),
                std::string(offset - previous_end, '\0'));
      previous_end = offset + expected.size();
      EXPECT_LE(previous_end, f.data_size);
      EXPECT_EQ(test::RawTensorBytes(f, name), expected);
      std::vector<std::string> chunks;
      for (uint64_t c : test::RefChunkHashes(expected, kChunk)) chunks.push_back(test::RefHex16(c));
      EXPECT_EQ(t["chunk_xxh3"].get<std::vector<std::string>>(), chunks);
      EXPECT_EQ(t["xxh3"], test::RefHex16(test::RefCombine(test::RefChunkHashes(expected, kChunk))));
    }
    EXPECT_EQ(f.bytes.substr(4096 + previous_end, f.data_size - previous_end),
              std::string(f.data_size - previous_end, '\0'));
  }
}

TEST_F(RankFileTest, ReaderReturnsEveryTensorRawAndZstd) {
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    fs::remove_all(dir_ / "out");
    for (uint32_t rank : {0u, 1u}) {
      SCOPED_TRACE(std::string(CodecName(codec)) + " rank " + std::to_string(rank));
      const RankFileReader r = RankFileReader::Open(Convert(codec, 2, rank));
      EXPECT_EQ(r.header().rank, rank);
      EXPECT_EQ(r.header().world_size, 2u);
      EXPECT_EQ(r.header().layout_key, "fsdp2-ws2");
      EXPECT_EQ(r.header().chunk_size, kChunk);
      EXPECT_TRUE(r.header().source == OpenCheckpoint(dir_ / "src").fingerprint);
      EXPECT_EQ(r.header().tensors.size(), tensors_.size());
      EXPECT_EQ(r.file_size(), fs::file_size(r.path()));
      for (const auto& [name, src] : tensors_) {
        const TensorEntry* t = r.header().Find(name);
        ASSERT_NE(t, nullptr) << name;
        const std::string expected = test::BruteSlice(src, 2, rank);
        ASSERT_EQ(t->nbytes, expected.size()) << name;
        std::string got(expected.size(), '\x55');
        r.ReadTensor(*t, got.data());
        EXPECT_EQ(got, expected) << name;
        if (t->nbytes == 0) {
          EXPECT_EQ(t->codec, Codec::kRaw) << name;  // nothing to compress
          EXPECT_TRUE(t->chunk_xxh3.empty());
          EXPECT_EQ(t->xxh3, 0x2d06800538d394c2ull);
        } else {
          EXPECT_EQ(t->codec, codec) << name;
        }
        if (t->codec == Codec::kZstd) {
          ASSERT_EQ(t->frames.size(), t->chunk_xxh3.size());
          for (const auto& fr : t->frames) EXPECT_LE(fr.offset + fr.size, t->stored_size);
        }
      }
      // Chunk by chunk: the 4500-byte tensor has a full chunk and a 404-byte one.
      const TensorEntry* big = r.header().Find("model.layers.2.big");
      ASSERT_EQ(big->chunk_xxh3.size(), 2u);
      std::string buf(kChunk, '\0'), scratch;
      EXPECT_EQ(r.ReadChunk(*big, 1, buf.data(), scratch), 404u);
      EXPECT_EQ(buf.substr(0, 404), test::BruteSlice(tensors_.at("model.layers.2.big"), 2, rank).substr(4096));
    }
  }
}

TEST_F(RankFileTest, HandBuiltFileWithLibraryEncodersOpens) {
  // One 0-dim F32 tensor, rank 0 of 1, built with EncodePreamble/SerializeHeader.
  const std::string data = "\x01\x02\x03\x04";
  RankFileHeader h;
  h.layout_key = "fsdp2-ws1";
  h.world_size = 1;
  h.rank = 0;
  h.chunk_size = kChunk;
  h.source = SourceFingerprint::FromFiles({{"m.safetensors", 100, 0x1234}});
  TensorEntry t;
  t.name = "s";
  t.dtype = DType::kF32;
  t.nbytes = 4;
  t.stored_size = 4;
  t.chunk_xxh3 = {test::RefXxh3(data)};
  t.xxh3 = test::RefCombine(t.chunk_xxh3);
  h.tensors.push_back(t);
  const std::string header = SerializeHeader(h);
  Preamble p;
  p.data_size = 4096;
  p.header_offset = 8192;
  p.header_size = header.size();
  p.header_xxh3 = test::RefXxh3(header);
  const auto pre = EncodePreamble(p);
  // The library's preamble equals the one the test builds from the spec's table.
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(pre.data()), 64),
            test::RefPreamble(1, 0, 4096, 4096, 8192, header.size(), p.header_xxh3));
  std::string file(8192, '\0');
  std::memcpy(file.data(), pre.data(), 64);
  file.replace(4096, 4, data);
  file += header;
  const fs::path path = dir_ / "hand.reshard";
  test::WriteBytes(path, file);
  const RankFileReader r = RankFileReader::Open(path);
  ASSERT_EQ(r.header().tensors.size(), 1u);
  EXPECT_FALSE(r.header().tensors[0].sharded);
  std::string got(4, '\0');
  r.ReadTensor(r.header().tensors[0], got.data());
  EXPECT_EQ(got, data);
  EXPECT_EQ(r.header().source.fingerprint, h.source.fingerprint);
  // DecodePreamble gives the fields back.
  const Preamble q = DecodePreamble(pre.data(), file.size(), "hand");
  EXPECT_EQ(q.data_size, 4096u);
  EXPECT_EQ(q.header_offset, 8192u);
  EXPECT_EQ(q.header_size, header.size());
  EXPECT_EQ(q.header_xxh3, p.header_xxh3);
}

TEST(RankFileName, FiveDigitRankAndWorldSize) {
  EXPECT_EQ(RankFileName(3, 8), "rank-00003-of-00008.reshard");
  EXPECT_EQ(RankFileName(0, 1), "rank-00000-of-00001.reshard");
  EXPECT_EQ(RankFileName(12345, 99999), "rank-12345-of-99999.reshard");
}

// ---- the preamble, one failure mode each ---------------------------------------------------

TEST_F(RankFileTest, TruncatedInsidePreamble) {
  const fs::path v = Victim();
  const std::string b = test::ReadBytes(v);
  for (size_t cut : {0u, 7u, 10u, 63u}) {
    test::WriteBytes(v, b.substr(0, cut));
    EXPECT_TRUE(OpenFails(v, {"preamble", "a file of " + std::to_string(cut) + " bytes",
                              "truncated file?"}))
        << cut;
  }
}

TEST_F(RankFileTest, TruncatedInsideDataOrHeader) {
  const fs::path v = Victim();
  const std::string b = test::ReadBytes(v);
  const test::RawRankFile f = test::RawRankFile::Read(v);
  for (uint64_t cut : {uint64_t{64}, uint64_t{2000}, uint64_t{4096 + 100}, f.header_offset,
                       f.header_offset + 5, uint64_t{b.size() - 1}}) {
    test::WriteBytes(v, b.substr(0, cut));
    EXPECT_TRUE(OpenFails(v, {"file size", "found " + std::to_string(cut) + " bytes",
                              "the file is truncated"}))
        << cut;
  }
  // One byte too many is also wrong, but not "truncated".
  test::WriteBytes(v, b + "x");
  std::string message;
  EXPECT_TRUE(ThrowsError([&] { RankFileReader::Open(v); }, ErrorCode::kDataLoss, {"file size"},
                          &message));
  EXPECT_EQ(message.find("truncated"), std::string::npos) << message;
}

TEST_F(RankFileTest, BadMagic) {
  const fs::path v = Victim();
  FlipByte(v, 1, 0x20);  // 'R' -> 'r'
  EXPECT_TRUE(OpenFails(v, {"magic", "found 89 72 53 48", "not a reshard rank file"}));
  // A safetensors file is not a rank file either.
  const fs::path st = dir_ / "src" / "model-00001-of-00003.safetensors";
  EXPECT_TRUE(OpenFails(st, {"magic"}));
}

TEST_F(RankFileTest, FutureFormatVersionSaysUpgrade) {
  fs::path v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) { f.format_version = 2; });
  EXPECT_TRUE(OpenFails(v, {"format_version", "found 2", "upgrade reshard"}));
  v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) { f.format_version = 0; });
  std::string message;
  EXPECT_TRUE(ThrowsError([&] { RankFileReader::Open(v); }, ErrorCode::kDataLoss,
                          {"format_version", "found 0"}, &message));
  EXPECT_EQ(message.find("upgrade"), std::string::npos);
}

TEST_F(RankFileTest, CorruptVersionFieldIsNotAdvertisedAsNewerFormat) {
  // A bit flip in format_version (1 -> 257) without a matching preamble_xxh3: the file is
  // corrupt; telling the user to upgrade would send them the wrong way.
  const fs::path v = Victim();
  FlipByte(v, 9, 0x01);
  std::string message;
  EXPECT_TRUE(ThrowsError([&] { RankFileReader::Open(v); }, ErrorCode::kDataLoss,
                          {"format_version", "found 257", "preamble_xxh3 does not match",
                           "the file is corrupt"},
                          &message));
  EXPECT_EQ(message.find("upgrade"), std::string::npos) << message;
}

TEST_F(RankFileTest, NonzeroFlags) {
  const fs::path v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) { f.flags = 4; });
  EXPECT_TRUE(OpenFails(v, {"flags", "found 4, expected 0"}));
}

TEST_F(RankFileTest, PreambleChecksumMismatch) {
  const fs::path v = Victim();
  FlipByte(v, 60);  // inside preamble_xxh3 itself
  EXPECT_TRUE(OpenFails(v, {"preamble_xxh3", "preamble corrupt"}));
  const fs::path w = Victim();
  FlipByte(w, 25, 0x10);  // data_size changed without updating the checksum
  EXPECT_TRUE(OpenFails(w, {"preamble_xxh3", "preamble corrupt"}));
}

TEST_F(RankFileTest, HeaderChecksumMismatch) {
  const fs::path v = Victim();
  const test::RawRankFile f = test::RawRankFile::Read(v);
  const size_t at = f.bytes.find("model.embed_tokens.weight", f.header_offset);
  ASSERT_NE(at, std::string::npos);
  FlipByte(v, at + 3, 0x01);  // 'e' -> 'd' in a tensor name: still valid JSON
  EXPECT_TRUE(OpenFails(v, {"header_xxh3", "the header is corrupt"}));
}

TEST_F(RankFileTest, HeaderSizeOutOfRange) {
  const fs::path v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) { f.header_size = uint64_t{1} << 40; });
  EXPECT_TRUE(OpenFails(v, {"header_size", "found 1099511627776", "1 to 268435456"}));
  const fs::path w = Victim();
  RewritePreamble(w, [](test::RawRankFile& f) { f.header_size = 0; });
  EXPECT_TRUE(OpenFails(w, {"header_size", "found 0"}));
}

TEST_F(RankFileTest, DataSizeNotMultipleOf4096) {
  const fs::path v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) {
    f.data_size -= 1;
    f.header_offset -= 1;
  });
  EXPECT_TRUE(OpenFails(v, {"data_size", "a multiple of 4096"}));
}

TEST_F(RankFileTest, DataOffsetAndHeaderOffsetChecked) {
  const fs::path v = Victim();
  RewritePreamble(v, [](test::RawRankFile& f) { f.data_offset = 8192; });
  EXPECT_TRUE(OpenFails(v, {"data_offset", "found 8192, expected 4096"}));
  const fs::path w = Victim();
  RewritePreamble(w, [](test::RawRankFile& f) { f.header_offset += 4096; });
  EXPECT_TRUE(OpenFails(w, {"header_offset", "(data_offset + data_size)"}));
}

TEST_F(RankFileTest, OffsetArithmeticOverflowIsDetected) {
  const fs::path v = Victim();
  // data_offset + data_size = 2^64 wraps to 0.
  RewritePreamble(v, [](test::RawRankFile& f) {
    f.data_size = std::numeric_limits<uint64_t>::max() - 4095;
    f.header_offset = 0;
  });
  EXPECT_TRUE(OpenFails(v, {"header_offset", "overflow"}));
}

// ---- the header, one failure mode each -----------------------------------------------------

struct HeaderCase {
  const char* name;
  std::function<void(ojson&)> mutate;
  std::vector<std::string> needles;
};
void PrintTo(const HeaderCase& c, std::ostream* os) { *os << c.name; }

class RankHeaderTest : public RankFileTest, public ::testing::WithParamInterface<HeaderCase> {};

TEST_P(RankHeaderTest, RejectedWithItsOwnError) {
  const HeaderCase& c = GetParam();
  const fs::path v = Victim(std::string(c.name).starts_with("Zstd") ? Codec::kZstd : Codec::kRaw);
  test::EditRankHeader(v, c.mutate);
  std::string message;
  auto r = ThrowsError([&] { RankFileReader::Open(v); }, ErrorCode::kDataLoss, {v.string()},
                       &message);
  ASSERT_TRUE(r);
  for (const auto& n : c.needles) EXPECT_NE(message.find(n), std::string::npos) << n << "\n" << message;
}

// Sets rows [s, e) of tensor `name` and keeps local_shape, nbytes, stored_size, chunk_xxh3
// count and xxh3 consistent with them, so that only the shard rule can fail.
void SetRows(ojson& h, const std::string& name, uint64_t s, uint64_t e) {
  ojson& t = Entry(h, name);
  const uint64_t old_rows = t["local_shape"][0];
  const uint64_t row = t["nbytes"].get<uint64_t>() / old_rows;
  t["shard"]["start"] = s;
  t["shard"]["end"] = e;
  t["local_shape"][0] = e - s;
  t["nbytes"] = (e - s) * row;
  t["stored_size"] = (e - s) * row;
  std::vector<uint64_t> chunks;
  for (uint64_t i = 0; i < ((e - s) * row + kChunk - 1) / kChunk; ++i) chunks.push_back(i);
  ojson hex = ojson::array();
  for (uint64_t c : chunks) hex.push_back(test::RefHex16(c));
  t["chunk_xxh3"] = hex;
  t["xxh3"] = test::RefHex16(test::RefCombine(chunks));
}

const char kEmbed[] = "model.embed_tokens.weight";  // rank 0 of 2: rows [0, 66), 3168 B
const char kBig[] = "model.layers.2.big";           // rank 0 of 2: 4500 B, last in the file

const HeaderCase kHeaderCases[] = {
    {"HeaderNotAnObject", [](ojson& h) { h = "not an object"; }, {"header: found string", "a JSON object"}},
    {"WrongFormatName", [](ojson& h) { h["format"] = "reshard.rnk"; },
     {"format: found \"reshard.rnk\""}},
    {"HeaderVersionDiffers", [](ojson& h) { h["format_version"] = 2; },
     {"format_version (header): found 2"}},
    {"MissingKey", [](ojson& h) { h.erase("chunk_size"); }, {"header.chunk_size", "found nothing"}},
    {"BadLayoutKey", [](ojson& h) { h["layout"]["key"] = "../up"; }, {"layout.key", "\"../up\""}},
    {"UnknownLayoutKind", [](ojson& h) { h["layout"]["kind"] = "fsdp3"; }, {"layout.kind"}},
    {"ZeroWorldSize", [](ojson& h) { h["layout"]["world_size"] = 0; },
     {"layout.world_size", "found 0"}},
    {"RankOutsideWorld", [](ojson& h) { h["rank"] = 2; }, {"rank: found 2", "less than world_size 2"}},
    {"FingerprintMismatch",
     [](ojson& h) { h["source"]["fingerprint"] = "0000000000000000"; },
     {"source.fingerprint", "computed from source.files"}},
    {"FingerprintNotHex16",
     [](ojson& h) { h["source"]["fingerprint"] = "ABCDEF0123456789"; },
     {"source.fingerprint", "16 lower-case hex digits"}},
    {"ChunkSizeNotMultipleOf4096", [](ojson& h) { h["chunk_size"] = 5000; },
     {"chunk_size: found 5000", "multiple of 4096"}},
    {"DuplicateTensorName",
     [](ojson& h) { Entry(h, "model.scale")["name"] = kEmbed; },
     {"tensor \"model.embed_tokens.weight\"", "unique names"}},
    {"UnknownCodec", [](ojson& h) { Entry(h, kEmbed)["codec"] = "lz4"; },
     {"tensor \"model.embed_tokens.weight\".codec", "\"lz4\""}},
    {"BadDtypeName", [](ojson& h) { Entry(h, kEmbed)["dtype"] = "BF17"; },
     {"tensor \"model.embed_tokens.weight\".dtype", "found \"BF17\""}},
    {"LocalShapeInconsistent", [](ojson& h) { Entry(h, kEmbed)["local_shape"][1] = 25; },
     {"tensor \"model.embed_tokens.weight\".local_shape", "found [66, 25]", "expected [66, 24]"}},
    {"ShardNotFollowingChunkRule", [](ojson& h) { SetRows(h, kEmbed, 0, 65); },
     {"tensor \"model.embed_tokens.weight\".shard", "rows [0, 65)",
      "rows [0, 66) by the FSDP2 chunk rule for rank 0 of 2"}},
    {"ShardPastGlobalShape", [](ojson& h) { SetRows(h, kEmbed, 0, 132); },
     {"tensor \"model.embed_tokens.weight\".shard", "0 <= start <= end <= global_shape[0]"}},
    {"ShardNullForShapedTensor", [](ojson& h) { Entry(h, kEmbed)["shard"] = nullptr; },
     // Whole (a persistent buffer's form): then the local shape must be the global one.
     {"tensor \"model.embed_tokens.weight\".local_shape", "found [66, 24]", "expected [131, 24]"}},
    {"ShardOnOtherDim", [](ojson& h) { Entry(h, kEmbed)["shard"]["dim"] = 1; },
     {"tensor \"model.embed_tokens.weight\".shard.dim", "found 1"}},
    {"NbytesWrong", [](ojson& h) { Entry(h, kEmbed)["nbytes"] = 3167; },
     {"tensor \"model.embed_tokens.weight\".nbytes", "found 3167, expected 3168"}},
    {"OffsetOutsideDataRegion",
     [](ojson& h) { Entry(h, kBig)["offset"] = Entry(h, kBig)["offset"].get<uint64_t>() + 4096; },
     {"tensor \"model.layers.2.big\".offset", "inside the data region"}},
    {"OverlappingOffsets", [](ojson& h) { Entry(h, "model.scale")["offset"] = 0; },
     {"tensor \"model.scale\".offset", "found 0", "at least 3168", "not overlapping"}},
    {"RawOffsetNotAligned",
     [](ojson& h) { Entry(h, kBig)["offset"] = Entry(h, kBig)["offset"].get<uint64_t>() + 8; },
     {"tensor \"model.layers.2.big\".offset", "a multiple of 4096"}},
    {"RawStoredSizeNotNbytes", [](ojson& h) { Entry(h, kBig)["stored_size"] = 4000; },
     {"tensor \"model.layers.2.big\".stored_size", "found 4000", "= nbytes for raw"}},
    {"RawWithFrames", [](ojson& h) { Entry(h, kBig)["frames"] = ojson::array(); },
     {"tensor \"model.layers.2.big\".frames", "none for raw"}},
    {"ChunkXxh3WrongCount",
     [](ojson& h) {
       ojson& t = Entry(h, kEmbed);
       t["chunk_xxh3"].push_back(test::RefHex16(7));
       std::vector<uint64_t> c;
       for (const auto& x : t["chunk_xxh3"]) c.push_back(std::stoull(x.get<std::string>(), nullptr, 16));
       t["xxh3"] = test::RefHex16(test::RefCombine(c));
     },
     {"tensor \"model.embed_tokens.weight\".chunk_xxh3", "found 2 entries", "expected 1 (ceil"}},
    {"ChunkXxh3NotHex", [](ojson& h) { Entry(h, kEmbed)["chunk_xxh3"][0] = "xyz"; },
     {"tensor \"model.embed_tokens.weight\".chunk_xxh3[0]", "16 lower-case hex digits"}},
    // After valid entries (parsed whole while every entry is hex16): still the entry named.
    {"ChunkXxh3UpperCaseAfterValidOnes",
     [](ojson& h) { Entry(h, kBig)["chunk_xxh3"][1] = "ABCDEF0123456789"; },
     {"tensor \"model.layers.2.big\".chunk_xxh3[1]", "16 lower-case hex digits"}},
    {"ChunkXxh3NotAnArray", [](ojson& h) { Entry(h, kEmbed)["chunk_xxh3"] = test::RefHex16(7); },
     {"tensor \"model.embed_tokens.weight\".chunk_xxh3", "expected an array"}},
    {"Xxh3NotMatchingChunks", [](ojson& h) { Entry(h, kEmbed)["xxh3"] = test::RefHex16(1); },
     {"tensor \"model.embed_tokens.weight\".xxh3", "found 0000000000000001",
      "the checksum of chunk_xxh3"}},
    {"EmptyTensorXxh3NotEmptyHash", [](ojson& h) { Entry(h, "model.empty")["xxh3"] = test::RefHex16(0); },
     {"tensor \"model.empty\".xxh3", "found 0000000000000000, expected 2d06800538d394c2"}},
    {"ZstdFramesWrongCount", [](ojson& h) { Entry(h, kBig)["frames"].erase(1); },
     {"tensor \"model.layers.2.big\".frames", "found 1 entries", "2 (one per chunk)"}},
    {"ZstdFrameOutsideStoredSize",
     [](ojson& h) {
       ojson& t = Entry(h, kBig);
       t["frames"][1][1] = t["stored_size"].get<uint64_t>();
     },
     {"tensor \"model.layers.2.big\".frames[1]", "inside stored_size"}},
    {"ZstdFramesOverlap",
     [](ojson& h) { Entry(h, kBig)["frames"][1][0] = 0; },
     {"tensor \"model.layers.2.big\".frames[1]", "after the previous frame"}},
    {"ZstdMissingFrames", [](ojson& h) { Entry(h, kBig).erase("frames"); },
     {"tensor \"model.layers.2.big\".frames", "found nothing"}},
};

INSTANTIATE_TEST_SUITE_P(Invariants, RankHeaderTest, ::testing::ValuesIn(kHeaderCases),
                         [](const ::testing::TestParamInfo<HeaderCase>& i) {
                           return std::string(i.param.name);
                         });

TEST_F(RankFileTest, DuplicateJsonKeyInHeader) {
  const fs::path v = Victim();
  test::RawRankFile f = test::RawRankFile::Read(v);
  // Insert a second "rank" key right after the opening brace; recompute the checksums.
  std::string text = f.bytes.substr(f.header_offset);
  ASSERT_EQ(text[0], '{');
  text.insert(1, "\"rank\":0,");
  std::string out = f.bytes.substr(0, f.header_offset) + text;
  out.replace(0, 64, test::RefPreamble(1, 0, 4096, f.data_size, f.header_offset, text.size(),
                                       test::RefXxh3(text)));
  test::WriteBytes(v, out);
  EXPECT_TRUE(OpenFails(v, {"header: duplicate key \"rank\""}));
}

TEST_F(RankFileTest, HeaderNotJsonText) {
  const fs::path v = Victim();
  test::RawRankFile f = test::RawRankFile::Read(v);
  const std::string text = "{\"format\": \"reshard.rank\", ";
  std::string out = f.bytes.substr(0, f.header_offset) + text;
  out.replace(0, 64, test::RefPreamble(1, 0, 4096, f.data_size, f.header_offset, text.size(),
                                       test::RefXxh3(text)));
  test::WriteBytes(v, out);
  EXPECT_TRUE(OpenFails(v, {"header is not valid JSON"}));
}

// ---- the header cache ---------------------------------------------------------------------

TEST_F(RankFileTest, HeaderCacheReusesAParseOnlyForTheSameBytes) {
  const fs::path v = Victim();
  HeaderCache cache(2);
  const RankFileReader a = RankFileReader::Open(v, &cache);
  const RankFileReader b = RankFileReader::Open(v, &cache);
  EXPECT_EQ(cache.hits(), 1u);
  EXPECT_EQ(&a.header(), &b.header());  // the same parse
  EXPECT_EQ(SerializeHeader(b.header()), SerializeHeader(RankFileReader::Open(v).header()));
  // Another valid file at the same path (rank 1's): parsed anew, not served from the cache.
  fs::copy_file(Convert(Codec::kRaw, 2, 1), v, fs::copy_options::overwrite_existing);
  const RankFileReader c = RankFileReader::Open(v, &cache);
  EXPECT_EQ(cache.hits(), 1u);
  EXPECT_EQ(c.header().rank, 1u);
  // A corrupt header after a cached open still fails, with the same errors as without a cache.
  const test::RawRankFile f = test::RawRankFile::Read(v);
  const size_t at = f.bytes.find("model.embed_tokens.weight", f.header_offset);
  ASSERT_NE(at, std::string::npos);
  FlipByte(v, at + 3, 0x01);
  EXPECT_TRUE(ThrowsError([&] { RankFileReader::Open(v, &cache); }, ErrorCode::kDataLoss,
                          {v.string(), "header_xxh3", "the header is corrupt"}));
  // A header that is valid JSON text with a consistent checksum but breaks the format.
  std::string text = f.bytes.substr(f.header_offset);
  text.insert(1, "\"rank\":0,");
  std::string out = f.bytes.substr(0, f.header_offset) + text;
  out.replace(0, 64, test::RefPreamble(1, 0, 4096, f.data_size, f.header_offset, text.size(),
                                       test::RefXxh3(text)));
  test::WriteBytes(v, out);
  EXPECT_TRUE(ThrowsError([&] { RankFileReader::Open(v, &cache); }, ErrorCode::kDataLoss,
                          {"header: duplicate key \"rank\""}));
  EXPECT_EQ(cache.hits(), 1u);
  // Capacity 2: a third path evicts the least recently used one.
  const fs::path r0 = Convert(Codec::kRaw, 2, 0), r1 = Convert(Codec::kRaw, 2, 1);
  RankFileReader::Open(r0, &cache);
  RankFileReader::Open(r1, &cache);
  RankFileReader::Open(r0, &cache);
  EXPECT_EQ(cache.hits(), 2u);
  fs::copy_file(r0, v, fs::copy_options::overwrite_existing);
  RankFileReader::Open(v, &cache);  // evicts r1 (r0 was used after it)
  RankFileReader::Open(r1, &cache);
  EXPECT_EQ(cache.hits(), 2u);
  // A byte budget: room for one of these headers (each costs twice its size).
  const uint64_t size0 = RankFileReader::Open(r0).preamble().header_size;
  const uint64_t size1 = RankFileReader::Open(r1).preamble().header_size;
  HeaderCache one(64, 3 * std::max(size0, size1));
  RankFileReader::Open(r0, &one);
  RankFileReader::Open(r1, &one);  // evicts r0
  RankFileReader::Open(r1, &one);
  RankFileReader::Open(r0, &one);
  EXPECT_EQ(one.hits(), 1u);
  HeaderCache none(64, std::min(size0, size1));  // no header fits: nothing is kept
  RankFileReader::Open(r0, &none);
  RankFileReader::Open(r0, &none);
  EXPECT_EQ(none.hits(), 0u);
}

// ---- data (invariant 8) --------------------------------------------------------------------

TEST_F(RankFileTest, BitFlipInTensorDataIsAChecksumMismatch) {
  const fs::path v = Victim();
  test::RawRankFile f = test::RawRankFile::Read(v);
  const uint64_t big_offset = Entry(f.header, kBig)["offset"];
  FlipByte(v, 4096 + big_offset + 4096 + 17, 0x80);  // inside chunk 1 of the big tensor
  const RankFileReader r = RankFileReader::Open(v);   // the header is still fine
  const TensorEntry* big = r.header().Find(kBig);
  std::string buf(kChunk, '\0'), scratch;
  EXPECT_EQ(r.ReadChunk(*big, 0, buf.data(), scratch), 4096u);  // chunk 0 is intact
  EXPECT_TRUE(ThrowsError([&] { r.ReadChunk(*big, 1, buf.data(), scratch); },
                          ErrorCode::kDataLoss,
                          {v.string(), "tensor \"model.layers.2.big\" chunk 1", "checksum mismatch"}));
  std::string whole(big->nbytes, '\0');
  EXPECT_TRUE(ThrowsError([&] { r.ReadTensor(*big, whole.data()); }, ErrorCode::kDataLoss,
                          {"chunk 1", "checksum mismatch"}));
  // Other tensors still read.
  const TensorEntry* embed = r.header().Find(kEmbed);
  std::string e(embed->nbytes, '\0');
  r.ReadTensor(*embed, e.data());
  EXPECT_EQ(e, test::BruteSlice(tensors_.at(kEmbed), 2, 0));
}

TEST_F(RankFileTest, CorruptZstdFrame) {
  const fs::path v = Victim(Codec::kZstd);
  const RankFileReader good = RankFileReader::Open(v);
  const TensorEntry big = *good.header().Find(kBig);
  const uint64_t frame1 = 4096 + big.offset + big.frames[1].offset;
  const std::string original = test::ReadBytes(v);

  // The frame's magic number: no valid frame header at all.
  FlipByte(v, frame1, 0xff);
  {
    const RankFileReader r = RankFileReader::Open(v);
    std::string buf(kChunk, '\0'), scratch;
    EXPECT_EQ(r.ReadChunk(big, 0, buf.data(), scratch), 4096u);
    EXPECT_TRUE(ThrowsError([&] { r.ReadChunk(big, 1, buf.data(), scratch); },
                            ErrorCode::kDataLoss,
                            {"tensor \"model.layers.2.big\" chunk 1", "zstd frame declares no valid size"}));
  }
  // A byte near the end of the frame: the frame decodes to wrong bytes or not at all.
  test::WriteBytes(v, original);
  FlipByte(v, frame1 + big.frames[1].size - 2, 0x5a);
  {
    const RankFileReader r = RankFileReader::Open(v);
    std::string whole(big.nbytes, '\0');
    EXPECT_TRUE(ThrowsError([&] { r.ReadTensor(big, whole.data()); }, ErrorCode::kDataLoss,
                            {"tensor \"model.layers.2.big\" chunk 1"}));
  }
}

TEST(DecodeZstdFrame, RejectsGarbageAndWrongSize) {
  std::string out(16, '\0');
  EXPECT_TRUE(ThrowsError([&] { DecodeZstdFrame("garbage!", 8, out.data(), 16, "thing"); },
                          ErrorCode::kDataLoss, {"thing", "no valid size"}));
}

}  // namespace
}  // namespace reshard
