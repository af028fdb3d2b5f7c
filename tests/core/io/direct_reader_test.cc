// DirectReader: reads of a file opened O_DIRECT into destinations and at offsets of every
// alignment equal buffered reads of the same bytes; aligned runs of whole blocks go straight,
// the rest through the bounce buffer; a read past the end is "truncated", naming the file.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "core/test_util.h"
#include "reshard/base/error.h"
#include "reshard/io/file_io.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

struct Aligned {
  explicit Aligned(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(::posix_memalign(&p, 4096, n), 0);
    ptr.reset(static_cast<char*>(p));
  }
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> ptr;
};

class DirectReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.path() / "data.bin";
    bytes_.resize(9 * DirectReader::kBounce / 4 + 4096 * 3 + 123);  // not a whole block at the end
    uint32_t x = 12345;
    for (char& c : bytes_) c = static_cast<char>((x = x * 1664525u + 1013904223u) >> 24);
    test::WriteBytes(path_, bytes_);
    buffered_ = File::OpenRead(path_);
    try {
      direct_ = buffered_.ReopenDirect();
    } catch (const Error& e) {
      GTEST_SKIP() << "this file system refuses O_DIRECT (" << e.what() << ")";
    }
  }
  test::TempDir dir_;
  fs::path path_;
  std::string bytes_;
  File buffered_, direct_;
};

TEST_F(DirectReaderTest, EveryAlignmentReadsTheSameBytes) {
  const uint64_t size = bytes_.size();
  const uint64_t offsets[] = {0, 1, 4095, 4096, 8192 + 17, DirectReader::kBounce - 5, size - 4096 - 123,
                              size - 200};
  const uint64_t lengths[] = {1, 100, 4096, 4096 * 3, 4096 * 3 + 7, DirectReader::kBounce + 4096 * 2 + 9};
  Aligned buf(DirectReader::kBounce * 2 + 3 * 4096);
  for (uint64_t shift : {0u, 1u, 512u, 4096u}) {
    for (uint64_t off : offsets) {
      for (uint64_t len : lengths) {
        if (off + len > size) continue;
        DirectReader r;
        std::memset(buf.ptr.get(), 0x5a, len + shift + 64);
        r.Read(direct_, buf.ptr.get() + shift, len, off);
        ASSERT_EQ(std::string(buf.ptr.get() + shift, len), bytes_.substr(off, len))
            << "offset " << off << " length " << len << " destination +" << shift;
        // Nothing written past the requested bytes.
        for (uint64_t k = 0; k < 64; ++k) ASSERT_EQ(buf.ptr.get()[shift + len + k], 0x5a);
        // Aligned: all but a tail shorter than a block straight. Equally misaligned: a head
        // up to the first block boundary and such a tail through the bounce buffer, the rest
        // straight. Otherwise every byte through it.
        const uint64_t head = off % 4096 ? std::min<uint64_t>(len, 4096 - off % 4096) : 0;
        const uint64_t bounced = shift % 4096 != off % 4096 ? len : head + (len - head) % 4096;
        EXPECT_EQ(r.bounced(), bounced) << "offset " << off << " length " << len << " destination +" << shift;
      }
    }
  }
  // The file's tail, to its last byte.
  DirectReader r;
  std::string tail(123 + 4096, '\0');
  r.Read(direct_, tail.data(), tail.size(), size - tail.size());
  EXPECT_EQ(tail, bytes_.substr(size - tail.size()));
}

TEST_F(DirectReaderTest, ReadingPastTheEndIsTruncation) {
  Aligned buf(4 * 4096);
  const uint64_t last_block = (bytes_.size() - 1) / 4096 * 4096;
  // Straight into an aligned destination, and through the bounce buffer from a misaligned offset.
  for (uint64_t at : {last_block - 4096, last_block - 4096 + 5}) {
    DirectReader r;
    try {
      r.Read(direct_, buf.ptr.get(), 3 * 4096, at);
      ADD_FAILURE() << "a read past the end succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
      EXPECT_NE(std::string(e.what()).find(path_.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(bytes_.size())), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("wanted 12288 bytes at offset " + std::to_string(at)), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(DirectReaderTest, ReopenReadsTheOpenFileNotTheNameNow) {
  // The name now names another file: the reopened one is still the file that was opened.
  fs::rename(path_, dir_.path() / "moved.bin");
  test::WriteBytes(path_, std::string(bytes_.size(), 'x'));
  File again = buffered_.ReopenDirect();
  EXPECT_EQ(again.path(), path_.string());
  DirectReader r;
  std::string got(5000, '\0');
  r.Read(again, got.data(), got.size(), 100);
  EXPECT_EQ(got, bytes_.substr(100, 5000));
}

}  // namespace
}  // namespace reshard
