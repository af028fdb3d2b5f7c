#include "reshard/base/human.h"

#include <cmath>
#include <cstdio>

namespace reshard {

std::string FormatBytes(double bytes) {
  if (!(bytes >= 0) || std::isinf(bytes)) return "-";
  static constexpr const char* kUnits[] = {"KB", "MB", "GB", "TB", "PB", "EB"};
  char buf[48];
  if (bytes < 999.5) {  // whole bytes; 999.5 and up rounds to 1000 B, written as 1.00 KB
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
    return buf;
  }
  double v = bytes / 1000;
  size_t u = 0;
  while (v >= 999.5 && u + 1 < std::size(kUnits)) {  // 999.5 KB prints as 1.00 MB
    v /= 1000;
    ++u;
  }
  // Three significant digits; the thresholds are where rounding would add a digit.
  const char* fmt = v < 9.995 ? "%.2f %s" : v < 99.95 ? "%.1f %s" : "%.0f %s";
  std::snprintf(buf, sizeof buf, fmt, v, kUnits[u]);
  return buf;
}

std::string FormatRate(double bytes_per_second) {
  const std::string b = FormatBytes(bytes_per_second);
  return b == "-" ? b : b + "/s";
}

}  // namespace reshard
