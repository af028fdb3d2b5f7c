// Element types as safetensors names them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace reshard {

enum class DType : uint8_t {
  kBool, kU8, kI8, kU16, kI16, kU32, kI32, kU64, kI64,
  kF16, kBF16, kF32, kF64, kC64,
  kF8_E4M3, kF8_E5M2, kF8_E8M0, kF6_E2M3, kF6_E3M2, kF4,
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;  // safetensors spelling, e.g. "BF16"
  uint32_t bits;          // bits per element (4 and 6 for the packed small floats)
  bool is_float;
};

const DTypeInfo& Info(DType dtype);
std::string_view Name(DType dtype);
std::optional<DType> ParseDType(std::string_view name);

/// Bytes taken by `numel` elements; nullopt when it is not a whole number of bytes or
/// overflows.
std::optional<uint64_t> BytesFor(DType dtype, uint64_t numel);

}  // namespace reshard
