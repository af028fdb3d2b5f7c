// Errors: every failure the library reports is a reshard::Error with a code and a message
// that names the file, the field, what was found and what was expected.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace reshard {

enum class ErrorCode {
  kInvalidArgument,  // the caller asked for something impossible (bad flag, bad rank range)
  kNotFound,         // a file or directory is missing
  kDataLoss,         // a file is corrupt, truncated or malformed
  kMismatch,         // valid files that do not belong together (other source, other layout), or
                     // a state of the output the operation refuses (a layout already there)
  kUnsupported,      // valid input this version does not handle
  kIo,               // the operating system refused (permissions, disk full, ...)
  kBusy,             // another process holds the output's lock
  kCancelled,        // a signal (Ctrl-C) stopped the operation (base/cancel.h)
};

std::string_view ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message)
      : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] void Fail(ErrorCode code, std::string message);

/// Throws kDataLoss "<file>: <field>: found <found>, expected <expected>".
[[noreturn]] void FailField(std::string_view file, std::string_view field, std::string_view found,
                            std::string_view expected);

/// `text` made safe for an error message: valid UTF-8 is kept, control characters and bytes
/// that are not valid UTF-8 are written as \xNN; cut after `max_bytes` input bytes ("...").
std::string Printable(std::string_view text, size_t max_bytes = 200);

/// Overflow-checked arithmetic for sizes and offsets read from files; throws kDataLoss naming
/// `what` on overflow.
uint64_t CheckedAdd(uint64_t a, uint64_t b, std::string_view what);
uint64_t CheckedMul(uint64_t a, uint64_t b, std::string_view what);

inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }
inline uint64_t AlignUp(uint64_t a, uint64_t alignment) {
  return CeilDiv(a, alignment) * alignment;
}

}  // namespace reshard
