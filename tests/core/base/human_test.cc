// FormatBytes / FormatRate: the unit that fits, three significant digits, rounding that
// carries into the next unit.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "reshard/base/human.h"

namespace reshard {
namespace {

TEST(FormatBytes, UnitThatFits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1), "1 B");
  EXPECT_EQ(FormatBytes(999), "999 B");
  EXPECT_EQ(FormatBytes(1000), "1.00 KB");
  EXPECT_EQ(FormatBytes(1536), "1.54 KB");
  EXPECT_EQ(FormatBytes(12345), "12.3 KB");
  EXPECT_EQ(FormatBytes(123456), "123 KB");
  EXPECT_EQ(FormatBytes(12345678), "12.3 MB");
  EXPECT_EQ(FormatBytes(51'800'000), "51.8 MB");
  EXPECT_EQ(FormatBytes(7.6e9), "7.60 GB");
  EXPECT_EQ(FormatBytes(1.75e9), "1.75 GB");
  EXPECT_EQ(FormatBytes(140e12), "140 TB");
  EXPECT_EQ(FormatBytes(3e15), "3.00 PB");
}

TEST(FormatBytes, RoundingCarries) {
  EXPECT_EQ(FormatBytes(999.4), "999 B");
  EXPECT_EQ(FormatBytes(999.6), "1.00 KB");
  EXPECT_EQ(FormatBytes(9994), "9.99 KB");
  EXPECT_EQ(FormatBytes(9996), "10.0 KB");
  EXPECT_EQ(FormatBytes(99'940), "99.9 KB");
  EXPECT_EQ(FormatBytes(99'960), "100 KB");
  EXPECT_EQ(FormatBytes(999'499), "999 KB");
  EXPECT_EQ(FormatBytes(999'999), "1.00 MB");
  EXPECT_EQ(FormatBytes(999'600'000), "1.00 GB");
}

TEST(FormatBytes, NeverZeroPointZeroGb) {
  // The reason it exists: small models printed "0.00 GB".
  for (double n : {1.0, 12.0, 4096.0, 3.5e5, 2.2e7}) {
    const std::string s = FormatBytes(n);
    EXPECT_EQ(s.find("0.00"), std::string::npos) << s;
    EXPECT_NE(s[0], '0') << s;
  }
}

TEST(FormatRate, SuffixAndOddValues) {
  EXPECT_EQ(FormatRate(6.6e9), "6.60 GB/s");
  EXPECT_EQ(FormatRate(12000), "12.0 KB/s");
  EXPECT_EQ(FormatRate(0), "0 B/s");
  EXPECT_EQ(FormatRate(-1), "-");
  EXPECT_EQ(FormatRate(std::numeric_limits<double>::infinity()), "-");
  EXPECT_EQ(FormatRate(std::nan("")), "-");
}

}  // namespace
}  // namespace reshard
