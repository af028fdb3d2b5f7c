#include "reshard/error.h"

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
