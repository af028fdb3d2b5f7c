// Checksums (XXH3-64, seed 0) and their text form (16 lower-case hex digits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace reshard {

uint64_t Xxh3(const void* data, size_t size);
inline uint64_t Xxh3(std::string_view s) { return Xxh3(s.data(), s.size()); }

/// The tensor checksum of formats/rank-file.md: XXH3-64 of the chunk checksums as u64 LE.
uint64_t CombineChunkChecksums(std::span<const uint64_t> chunk_checksums);

std::string Hex16(uint64_t value);
std::optional<uint64_t> ParseHex16(std::string_view text);

}  // namespace reshard
