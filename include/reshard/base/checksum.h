// Checksums (XXH3-64, seed 0) and their text form (16 lower-case hex digits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace reshard {

uint64_t Xxh3(const void* data, size_t size);
inline uint64_t Xxh3(std::string_view s) { return Xxh3(s.data(), s.size()); }

/// XXH3-64 of data given in pieces: Digest() equals Xxh3 of the pieces concatenated. Lets a
/// reader hash each piece right after reading it, while it is still in the core's cache.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(const Xxh3Hasher&) = delete;
  Xxh3Hasher& operator=(const Xxh3Hasher&) = delete;
  void Reset();
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t
};

/// The instruction set Xxh3 and Xxh3Hasher use: the best this CPU supports ("avx2", "sse2";
/// "default" off x86-64: whatever xxhash picks there), or RESHARD_XXH3 when it names a
/// supported one (for measuring; a name this build does not know throws
/// std::invalid_argument from the first hash).
const char* Xxh3Implementation();
/// Every implementation this CPU supports, best first; Xxh3With hashes with one of them
/// (throws std::invalid_argument for another name). For tests and benchmarks.
std::vector<std::string> Xxh3Implementations();
uint64_t Xxh3With(const std::string& implementation, const void* data, size_t size);

/// The tensor checksum of formats/rank-file.md: XXH3-64 of the chunk checksums as u64 LE.
uint64_t CombineChunkChecksums(std::span<const uint64_t> chunk_checksums);

std::string Hex16(uint64_t value);
std::optional<uint64_t> ParseHex16(std::string_view text);

}  // namespace reshard
