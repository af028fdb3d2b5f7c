// XXH3-64 and its hex16 text form. The known values were computed with the xxhsum CLI
// (xxhsum 0.8.1, `printf ... | xxhsum -H3`), independently of this library.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/checksum.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

TEST(Xxh3, KnownValuesFromXxhsum) {
  EXPECT_EQ(Xxh3(""), 0x2d06800538d394c2ull);         // printf ''
  EXPECT_EQ(Xxh3("a"), 0xe6c632b61e964e1full);        // printf 'a'
  EXPECT_EQ(Xxh3("abc"), 0x78af5f94892f3950ull);      // printf 'abc'
  EXPECT_EQ(Xxh3("reshard"), 0x2cd50bb8e17b7f9bull);  // printf 'reshard'
  EXPECT_EQ(Xxh3(std::string(8, '\0')), 0xc77b3abb6f87acd9ull);
  // bytes(range(256)) * 20: 5120 bytes, past XXH3's 240-byte short-input path.
  std::string long_input;
  for (int k = 0; k < 20; ++k) {
    for (int i = 0; i < 256; ++i) long_input += static_cast<char>(i);
  }
  EXPECT_EQ(Xxh3(long_input), 0xf875f2fa2e99df80ull);
  // (i*7+3) % 256 for i < 5000
  std::string ramp;
  for (int i = 0; i < 5000; ++i) ramp += static_cast<char>((i * 7 + 3) % 256);
  EXPECT_EQ(Xxh3(ramp.data(), ramp.size()), 0x799aaddd7339581dull);
}

TEST(CombineChunkChecksums, EmptyListIsXxh3OfEmptyString) {
  EXPECT_EQ(CombineChunkChecksums({}), 0x2d06800538d394c2ull);
}

TEST(CombineChunkChecksums, HashesChecksumsAsLittleEndianU64) {
  // ef cd ab 89 67 45 23 01 | 01 00 00 00 00 00 00 00, hashed by xxhsum -H3.
  const std::vector<uint64_t> chunks = {0x0123456789abcdefull, 1};
  EXPECT_EQ(CombineChunkChecksums(chunks), 0x7f0249b3e464163aull);
  // The same through the test's own encoding.
  std::string le(16, '\0');
  test::PutLe64(le, 0, chunks[0]);
  test::PutLe64(le, 8, chunks[1]);
  EXPECT_EQ(CombineChunkChecksums(chunks), test::RefXxh3(le));
  // Order matters.
  EXPECT_NE(CombineChunkChecksums(std::vector<uint64_t>{1, 0x0123456789abcdefull}),
            0x7f0249b3e464163aull);
}

TEST(Hex16, FormatsSixteenLowerCaseDigits) {
  EXPECT_EQ(Hex16(0), "0000000000000000");
  EXPECT_EQ(Hex16(1), "0000000000000001");
  EXPECT_EQ(Hex16(0x2d06800538d394c2ull), "2d06800538d394c2");
  EXPECT_EQ(Hex16(0xffffffffffffffffull), "ffffffffffffffff");
  EXPECT_EQ(Hex16(0xABCDEF0123456789ull), "abcdef0123456789");
}

TEST(Hex16, RoundTrips) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{0x8000000000000000ull},
                     uint64_t{0xdeadbeefcafef00dull}, ~uint64_t{0}}) {
    auto parsed = ParseHex16(Hex16(v));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, v);
  }
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 1000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    ASSERT_EQ(ParseHex16(Hex16(x)), x);
  }
  EXPECT_EQ(ParseHex16("00000000000000ff"), 255u);
}

TEST(ParseHex16, RejectsAnythingButSixteenLowerCaseHexDigits) {
  EXPECT_FALSE(ParseHex16("2D06800538D394C2").has_value());   // upper case
  EXPECT_FALSE(ParseHex16("2d06800538d394C2").has_value());   // one upper-case digit
  EXPECT_FALSE(ParseHex16("2d06800538d394c").has_value());    // 15 digits
  EXPECT_FALSE(ParseHex16("2d06800538d394c20").has_value());  // 17 digits
  EXPECT_FALSE(ParseHex16("").has_value());
  EXPECT_FALSE(ParseHex16("2d06800538d394cg").has_value());   // non-hex
  EXPECT_FALSE(ParseHex16("0x06800538d394c2").has_value());   // prefix
  EXPECT_FALSE(ParseHex16(" d06800538d394c2").has_value());   // space
  EXPECT_FALSE(ParseHex16("-d06800538d394c2").has_value());   // sign
  EXPECT_FALSE(ParseHex16(std::string_view("2d06800538d394\0c", 16)).has_value());
}

TEST(Xxh3, EveryImplementationHashesAlike) {
  const std::vector<std::string> impls = Xxh3Implementations();
  ASSERT_FALSE(impls.empty());
  const char* forced = std::getenv("RESHARD_XXH3");
  if (forced == nullptr || std::find(impls.begin(), impls.end(), forced) == impls.end()) {
    EXPECT_EQ(std::string(Xxh3Implementation()), impls.front()) << "the best one is used";
  } else {
    EXPECT_EQ(std::string(Xxh3Implementation()), forced);
  }
  std::vector<unsigned char> data(1 << 20);
  uint64_t x = 0x2545F4914F6CDD1Dull;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  for (const std::string& impl : impls) {
    SCOPED_TRACE(impl);
    EXPECT_EQ(Xxh3With(impl, "reshard", 7), 0x2cd50bb8e17b7f9bull);  // xxhsum's value
    for (size_t size : {size_t{0}, size_t{17}, size_t{240}, size_t{241}, size_t{1025},
                        size_t{64 << 10}, size_t{(256 << 10) + 3}, data.size()}) {
      EXPECT_EQ(Xxh3With(impl, data.data(), size), Xxh3(data.data(), size)) << "size " << size;
    }
  }
  EXPECT_THROW(Xxh3With("no-such-isa", data.data(), 8), std::invalid_argument);
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

TEST(Xxh3Hasher, PiecesHashLikeTheWhole) {
  // Sizes around XXH3's internal boundaries (240-byte short path, 256-byte buffer, 1 KiB
  // stripes block) and pieces that split them unevenly.
  std::vector<unsigned char> data(3 << 20);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  Xxh3Hasher h;
  for (size_t size : {size_t{0}, size_t{1}, size_t{240}, size_t{241}, size_t{1024}, size_t{4097},
                      size_t{256 << 10}, data.size()}) {
    for (size_t piece : {size_t{1}, size_t{7}, size_t{256}, size_t{1000}, size_t{64 << 10}}) {
      if (piece == 1 && size > 5000) continue;
      h.Reset();
      for (size_t at = 0; at < size; at += piece) h.Update(data.data() + at, std::min(piece, size - at));
      EXPECT_EQ(h.Digest(), Xxh3(data.data(), size)) << "size " << size << " piece " << piece;
    }
  }
  h.Reset();
  h.Update("reshard", 7);
  EXPECT_EQ(h.Digest(), 0x2cd50bb8e17b7f9bull);  // the xxhsum value above
}

}  // namespace
}  // namespace reshard
