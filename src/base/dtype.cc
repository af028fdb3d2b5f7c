#include "reshard/base/dtype.h"

#include <array>

namespace reshard {
namespace {

constexpr std::array<DTypeInfo, 20> kInfos = {{
    {DType::kBool, "BOOL", 8, false},     {DType::kU8, "U8", 8, false},
    {DType::kI8, "I8", 8, false},         {DType::kU16, "U16", 16, false},
    {DType::kI16, "I16", 16, false},      {DType::kU32, "U32", 32, false},
    {DType::kI32, "I32", 32, false},      {DType::kU64, "U64", 64, false},
    {DType::kI64, "I64", 64, false},      {DType::kF16, "F16", 16, true},
    {DType::kBF16, "BF16", 16, true},     {DType::kF32, "F32", 32, true},
    {DType::kF64, "F64", 64, true},       {DType::kC64, "C64", 64, false},
    {DType::kF8_E4M3, "F8_E4M3", 8, true}, {DType::kF8_E5M2, "F8_E5M2", 8, true},
    {DType::kF8_E8M0, "F8_E8M0", 8, true}, {DType::kF6_E2M3, "F6_E2M3", 6, true},
    {DType::kF6_E3M2, "F6_E3M2", 6, true}, {DType::kF4, "F4", 4, true},
}};

}  // namespace

const DTypeInfo& Info(DType dtype) { return kInfos[static_cast<size_t>(dtype)]; }
std::string_view Name(DType dtype) { return Info(dtype).name; }

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& info : kInfos) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

std::optional<uint64_t> BytesFor(DType dtype, uint64_t numel) {
  uint64_t bits;
  if (__builtin_mul_overflow(numel, uint64_t{Info(dtype).bits}, &bits)) return std::nullopt;
  if (bits % 8 != 0) return std::nullopt;
  return bits / 8;
}

}  // namespace reshard
