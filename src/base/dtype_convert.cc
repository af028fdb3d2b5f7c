#include "reshard/base/dtype_convert.h"

#include <cstring>
#include <string>

#include "reshard/base/error.h"

namespace reshard {

std::optional<DTypePolicy> ParseDTypePolicy(std::string_view name) {
  if (name == "keep") return DTypePolicy::kKeep;
  if (name == "bf16") return DTypePolicy::kBF16;
  if (name == "fp16") return DTypePolicy::kFP16;
  if (name == "fp32") return DTypePolicy::kFP32;
  return std::nullopt;
}

std::string_view PolicyName(DTypePolicy policy) {
  switch (policy) {
    case DTypePolicy::kKeep: return "keep";
    case DTypePolicy::kBF16: return "bf16";
    case DTypePolicy::kFP16: return "fp16";
    case DTypePolicy::kFP32: return "fp32";
  }
  return "keep";
}

bool IsConvertibleFloat(DType d) {
  return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32 || d == DType::kF64;
}

DType StoredDType(DType source, DTypePolicy policy) {
  if (!IsConvertibleFloat(source)) return source;
  switch (policy) {
    case DTypePolicy::kKeep: return source;
    case DTypePolicy::kBF16: return DType::kBF16;
    case DTypePolicy::kFP16: return DType::kF16;
    case DTypePolicy::kFP32: return DType::kF32;
  }
  return source;
}

namespace {

inline bool IsNanF32(uint32_t f) { return (f & 0x7FFFFFFFu) > 0x7F800000u; }

inline uint32_t FloatBits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
inline float BitsFloat(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// Round to nearest even of a non-NaN float to bf16: overflow reaches the infinity pattern.
inline uint16_t RneBF16(uint32_t f) {
  return static_cast<uint16_t>((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

template <typename From, typename To, typename Fn>
void Loop(const void* src, void* dst, uint64_t n, Fn fn) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (uint64_t i = 0; i < n; ++i) {
    From x;
    std::memcpy(&x, s + i * sizeof(From), sizeof(From));
    const To y = fn(x);
    std::memcpy(d + i * sizeof(To), &y, sizeof(To));
  }
}

}  // namespace

uint16_t F32BitsToBF16(uint32_t f) {
  return IsNanF32(f) ? uint16_t{0xFFFF} : RneBF16(f);
}

uint16_t F32BitsToF16(uint32_t f) {
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // ≥ 65520: ±inf
  if (a >= 0x38800000u) {  // a normal half (≥ 2^-14): rebias the exponent, round at bit 13
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 (a tie at 2^-25: to 0)
  // A subnormal half: the value in units of 2^-24 is m · 2^(e − 126), e ≤ 112.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14 … 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

uint32_t F16BitsToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u);  // quiet NaN
  if (e != 0) return sign | ((e + 112) << 23) | (m << 13);
  if (m == 0) return sign;
  const int p = 31 - __builtin_clz(m);  // top bit of the subnormal's mantissa, 0 … 9
  return sign | (static_cast<uint32_t>(p + 103) << 23) | ((m << (23 - p)) & 0x7FFFFFu);
}

uint32_t F8E4M3BitsToF32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu;
  const uint32_t m = b & 0x7u;
  if (e == 0xF && m == 0x7) return sign | 0x7FF00000u;  // NaN, as torch gives it
  if (e != 0) return sign | ((e + 120) << 23) | (m << 20);  // bias 7 -> 127
  if (m == 0) return sign;
  const int p = 31 - __builtin_clz(m);  // subnormal m·2^-9: top bit 0 … 2
  return sign | (static_cast<uint32_t>(p + 118) << 23) | ((m << (23 - p)) & 0x7FFFFFu);
}

void ConvertElements(DType from, DType to, const void* src, void* dst, uint64_t n) {
  if (!IsConvertibleFloat(from) || !IsConvertibleFloat(to)) {
    Fail(ErrorCode::kInvalidArgument, "cannot convert " + std::string(Name(from)) + " to " +
                                          std::string(Name(to)) +
                                          ": only F16, BF16, F32 and F64 are converted");
  }
  if (from == to) {
    std::memcpy(dst, src, n * (Info(from).bits / 8));
    return;
  }
  auto f16_to_f32 = [](uint16_t h) { return BitsFloat(F16BitsToF32(h)); };
  auto bf16_to_f32 = [](uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); };
  switch (from) {
    case DType::kF32:
      if (to == DType::kBF16) {
        Loop<uint32_t, uint16_t>(src, dst, n, [](uint32_t f) { return F32BitsToBF16(f); });
      } else if (to == DType::kF16) {
        Loop<uint32_t, uint16_t>(src, dst, n, [](uint32_t f) { return F32BitsToF16(f); });
      } else {
        Loop<float, double>(src, dst, n, [](float f) { return static_cast<double>(f); });
      }
      return;
    case DType::kF64:
      if (to == DType::kF32) {
        Loop<double, float>(src, dst, n, [](double v) { return static_cast<float>(v); });
      } else if (to == DType::kBF16) {
        Loop<double, uint16_t>(src, dst, n, [](double v) {
          return F32BitsToBF16(FloatBits(static_cast<float>(v)));
        });
      } else {
        Loop<double, uint16_t>(src, dst, n, [](double v) {
          return F32BitsToF16(FloatBits(static_cast<float>(v)));
        });
      }
      return;
    case DType::kF16:
      if (to == DType::kF32) {
        Loop<uint16_t, uint32_t>(src, dst, n, [](uint16_t h) { return F16BitsToF32(h); });
      } else if (to == DType::kF64) {
        Loop<uint16_t, double>(src, dst, n,
                               [&](uint16_t h) { return static_cast<double>(f16_to_f32(h)); });
      } else {  // BF16: torch takes the scalar path here, so NaN is 0x7FC0
        Loop<uint16_t, uint16_t>(src, dst, n, [](uint16_t h) {
          const uint32_t f = F16BitsToF32(h);
          return IsNanF32(f) ? uint16_t{0x7FC0} : RneBF16(f);
        });
      }
      return;
    case DType::kBF16:
      if (to == DType::kF32) {
        Loop<uint16_t, uint32_t>(src, dst, n,
                                 [](uint16_t h) { return static_cast<uint32_t>(h) << 16; });
      } else if (to == DType::kF64) {
        Loop<uint16_t, double>(src, dst, n,
                               [&](uint16_t h) { return static_cast<double>(bf16_to_f32(h)); });
      } else {
        Loop<uint16_t, uint16_t>(src, dst, n, [](uint16_t h) {
          return F32BitsToF16(static_cast<uint32_t>(h) << 16);
        });
      }
      return;
    default:
      return;
  }
}

}  // namespace reshard
