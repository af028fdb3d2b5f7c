// Numbers as people read them: byte counts and rates in the unit that fits. The one rule for
// every size reshard prints (the CLI's convert, verify, export and inspect, and the Python
// package's reports through reshard._C.format_bytes / format_rate); --json output keeps
// plain byte counts.
#pragma once

#include <cstdint>
#include <string>

namespace reshard {

/// `bytes` in the largest unit of B, KB, MB, GB, TB, PB (powers of 1000, as --max-shard-size
/// and huggingface_hub count) in which it is at least 1, with three significant digits:
/// 0 -> "0 B", 999 -> "999 B", 1000 -> "1.00 KB", 1536 -> "1.54 KB", 12345678 -> "12.3 MB",
/// 999999 -> "1.00 MB" (rounding carries into the next unit), 7.6e9 -> "7.60 GB".
std::string FormatBytes(double bytes);

/// A rate: FormatBytes(bytes_per_second) + "/s" ("1.54 GB/s", "12.0 KB/s", "0 B/s"); a
/// negative, NaN or infinite rate (e.g. from a zero duration) is "-".
std::string FormatRate(double bytes_per_second);

}  // namespace reshard
