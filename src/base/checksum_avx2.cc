// XXH3-64 compiled for AVX2 (this file alone is built with -mavx2); checksum.cc calls it
// only when the CPU supports AVX2. About twice the SSE2 baseline's speed, which matters on
// the loader's hot path where every chunk is hashed.
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace reshard::internal {
uint64_t Xxh3Avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }
}  // namespace reshard::internal

namespace reshard::internal {
// The state's layout does not depend on the instruction set (both translation units include
// the same xxhash.h); only the accumulation code differs.
void Xxh3Avx2Update(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
}  // namespace reshard::internal
