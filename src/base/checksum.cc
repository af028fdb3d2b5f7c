#include "reshard/base/checksum.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <new>
#include <span>
#include <string>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace reshard {

namespace {
using HashFn = uint64_t (*)(const void*, size_t);
using UpdateFn = void (*)(void*, const void*, size_t);  // state: XXH3_state_t
// XXH3 as this translation unit is compiled (SSE2 on x86-64; NEON or scalar elsewhere).
uint64_t Baseline(const void* data, size_t size) { return XXH3_64bits(data, size); }
void BaselineUpdate(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
struct Impl {
  const char* name;
  HashFn hash;
  UpdateFn update;
  bool supported;
};
}  // namespace

#if defined(__x86_64__) && defined(RESHARD_HAVE_AVX2_TU)
namespace internal {
uint64_t Xxh3Avx2(const void* data, size_t size);
void Xxh3Avx2Update(void* state, const void* data, size_t size);
}  // namespace internal
namespace {
// Best first. A plain array (nothing to destroy at exit: a hash from a thread still running
// then must not read freed memory).
std::span<const Impl> Impls() {
  static const Impl impls[] = {
      {"avx2", internal::Xxh3Avx2, internal::Xxh3Avx2Update, __builtin_cpu_supports("avx2") != 0},
      {"sse2", Baseline, BaselineUpdate, true}};
  return impls;
}
}  // namespace
#else
namespace {
std::span<const Impl> Impls() {  // whatever xxhash picks for this target (NEON, SSE2, scalar)
  static const Impl impls[] = {{"default", Baseline, BaselineUpdate, true}};
  return impls;
}
}  // namespace
#endif

namespace {
// The best the CPU supports, or RESHARD_XXH3=<name> (for measuring). A known name the CPU
// does not support falls back to the best; an unknown name is an error.
const Impl& Chosen() {
  static const Impl& chosen = []() -> const Impl& {
    const char* want = std::getenv("RESHARD_XXH3");
    if (want != nullptr && *want != '\0') {
      std::string known;
      bool is_known = false;
      for (const Impl& i : Impls()) {
        if (std::strcmp(want, i.name) == 0) {
          if (i.supported) return i;
          is_known = true;
        }
        known += std::string(known.empty() ? "" : ", ") + i.name;
      }
      if (!is_known) {
        throw std::invalid_argument(std::string("RESHARD_XXH3=\"") + want +
                                    "\": expected one of " + known);
      }
    }
    for (const Impl& i : Impls()) {
      if (i.supported) return i;
    }
    return Impls().back();
  }();
  return chosen;
}
}  // namespace

uint64_t Xxh3(const void* data, size_t size) { return Chosen().hash(data, size); }
void Xxh3Hasher::Update(const void* data, size_t size) { Chosen().update(state_, data, size); }
const char* Xxh3Implementation() { return Chosen().name; }

std::vector<std::string> Xxh3Implementations() {
  std::vector<std::string> out;
  for (const Impl& i : Impls()) {
    if (i.supported) out.push_back(i.name);
  }
  return out;
}

uint64_t Xxh3With(const std::string& implementation, const void* data, size_t size) {
  for (const Impl& i : Impls()) {
    if (i.supported && implementation == i.name) return i.hash(data, size);
  }
  throw std::invalid_argument("XXH3 implementation \"" + implementation + "\" is not available here");
}

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
