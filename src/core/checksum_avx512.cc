// XXH3-64 compiled for AVX-512 (this file alone is built with -mavx512f); checksum.cc calls
// it only when the CPU supports AVX-512F. The loader hashes every chunk it reads, on every
// reader thread, so the hash's speed is part of a warm load's CPU cost (BENCHMARKS.md §7).
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace reshard::internal {
uint64_t Xxh3Avx512(const void* data, size_t size) { return XXH3_64bits(data, size); }
// The state's layout does not depend on the instruction set; only the accumulation differs.
void Xxh3Avx512Update(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
}  // namespace reshard::internal
