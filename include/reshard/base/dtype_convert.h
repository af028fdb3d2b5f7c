// The dtype policy of `reshard convert --dtype`, and element conversion that gives the bits
// torch's CPU Tensor.to(dtype) gives (torch 2.11 on x86-64 with AVX2 / AVX-512).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "reshard/base/dtype.h"

namespace reshard {

enum class DTypePolicy { kKeep, kBF16, kFP16, kFP32 };

/// "keep", "bf16", "fp16", "fp32"; nullopt for anything else.
std::optional<DTypePolicy> ParseDTypePolicy(std::string_view name);
std::string_view PolicyName(DTypePolicy policy);

/// True for the dtypes a policy converts: F16, BF16, F32, F64 (not F8 or smaller floats,
/// not integers, not bool, not complex).
bool IsConvertibleFloat(DType dtype);

/// The dtype a tensor of `source` dtype is stored as under `policy`: the policy's dtype for
/// convertible floats, `source` itself otherwise (and always under kKeep).
DType StoredDType(DType source, DTypePolicy policy);

/// Converts `n` elements from `from` to `to` (both convertible floats; equal dtypes copy).
/// `src` and `dst` must not overlap. Rounding is to nearest, ties to even; values beyond the
/// target's range become ±inf; subnormals are kept (no flush to zero); F64 → F16/BF16 rounds
/// through F32 as torch does. NaNs stay NaN with torch's bit patterns:
///   F32/F64 → BF16: 0xFFFF (the AVX2/AVX-512 kernels; torch's scalar kernel gives 0x7FC0)
///   F16 → BF16: 0x7FC0
///   F32 → F16 (and BF16/F64 → F16 through F32): sign | 0x7E00 | the top 10 mantissa bits
///   F16 → F32/F64: quiet NaN with the payload kept (torch itself is inconsistent here:
///   some vector lanes give 0x7FFFFFFF)
///   BF16 → F32: the bits shifted, unchanged; F32 ↔ F64: as the hardware converts.
void ConvertElements(DType from, DType to, const void* src, void* dst, uint64_t n);

/// Scalar conversions (exposed for tests).
uint16_t F32BitsToBF16(uint32_t f);
uint16_t F32BitsToF16(uint32_t f);
uint32_t F16BitsToF32(uint16_t h);
/// An F8_E4M3 (float8_e4m3fn: no infinities, 0x7F/0xFF NaN) element as float32 bits, exact,
/// as torch's Tensor.to(torch.float32): NaN becomes sign | 0x7FF00000.
uint32_t F8E4M3BitsToF32(uint8_t b);

}  // namespace reshard
