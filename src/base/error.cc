#include "reshard/base/error.h"

#include <algorithm>
#include <string>

namespace reshard {

std::string_view ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kDataLoss: return "corrupt input";
    case ErrorCode::kMismatch: return "mismatch";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kIo: return "I/O error";
    case ErrorCode::kBusy: return "busy";
    case ErrorCode::kCancelled: return "cancelled";
  }
  return "error";
}

void Fail(ErrorCode code, std::string message) { throw Error(code, std::move(message)); }

void FailField(std::string_view file, std::string_view field, std::string_view found,
               std::string_view expected) {
  std::string m;
  m.append(file).append(": ").append(field).append(": found ").append(found);
  m.append(", expected ").append(expected);
  throw Error(ErrorCode::kDataLoss, std::move(m));
}

std::string Printable(std::string_view text, size_t max_bytes) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = std::min(text.size(), max_bytes);
  size_t i = 0;
  auto escape = [&](unsigned char c) {
    static const char* hex = "0123456789abcdef";
    out += "\\x";
    out += hex[c >> 4];
    out += hex[c & 15];
  };
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x20 || c == 0x7f) {
      escape(static_cast<unsigned char>(c));
      ++i;
      continue;
    }
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // The length of a valid UTF-8 sequence starting here, or 0.
    size_t len = 0;
    uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    if (len && i + len <= n) {
      for (size_t k = 1; k < len; ++k) {
        if ((p[i + k] & 0xC0) != 0x80) { len = 0; break; }
        cp = (cp << 6) | (p[i + k] & 0x3F);
      }
    } else {
      len = 0;
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (len && (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) len = 0;
    if (!len) {
      escape(static_cast<unsigned char>(c));
      ++i;
      continue;
    }
    out.append(text.data() + i, len);
    i += len;
  }
  if (text.size() > max_bytes) out += "...";
  return out;
}

uint64_t CheckedAdd(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    Fail(ErrorCode::kDataLoss, std::string(what) + ": arithmetic overflow (" + std::to_string(a) +
                                   " + " + std::to_string(b) + ")");
  }
  return r;
}

uint64_t CheckedMul(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) {
    Fail(ErrorCode::kDataLoss, std::string(what) + ": arithmetic overflow (" + std::to_string(a) +
                                   " × " + std::to_string(b) + ")");
  }
  return r;
}

}  // namespace reshard
