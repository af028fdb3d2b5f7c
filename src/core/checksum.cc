#include "reshard/checksum.h"

#include <cstdio>
#include <new>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace reshard {

#if defined(__x86_64__) && defined(RESHARD_HAVE_AVX2_TU)
namespace internal {
uint64_t Xxh3Avx2(const void* data, size_t size);
void Xxh3Avx2Update(void* state, const void* data, size_t size);  // state: XXH3_state_t
}
namespace {
const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
}
uint64_t Xxh3(const void* data, size_t size) {
  return kHaveAvx2 ? internal::Xxh3Avx2(data, size) : XXH3_64bits(data, size);
}
void Xxh3Hasher::Update(const void* data, size_t size) {
  if (kHaveAvx2) {
    internal::Xxh3Avx2Update(state_, data, size);
  } else {
    XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
  }
}
#else
uint64_t Xxh3(const void* data, size_t size) { return XXH3_64bits(data, size); }
void Xxh3Hasher::Update(const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
#endif

Xxh3Hasher::Xxh3Hasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  Reset();
}
Xxh3Hasher::~Xxh3Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Hasher::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
uint64_t Xxh3Hasher::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

uint64_t CombineChunkChecksums(std::span<const uint64_t> chunk_checksums) {
  std::vector<unsigned char> bytes(chunk_checksums.size() * 8);
  for (size_t i = 0; i < chunk_checksums.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = (chunk_checksums[i] >> (8 * b)) & 0xff;
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string Hex16(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(value));
  return std::string(buf, 16);
}

std::optional<uint64_t> ParseHex16(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : text) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return std::nullopt;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

}  // namespace reshard
