// Helpers for the core tests: a writer of valid safetensors files and checkpoints with hooks
// to break them, a brute-force model of the FSDP2 chunk rule, and a byte-level editor of rank
// files that keeps every checksum consistent except the one a test means to break.
//
// Everything here is written from the format descriptions (formats/*.md, fsdp-layouts.md R1,
// R29, R30), not from the library: where a test compares the library against these helpers,
// the two computations are independent.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "reshard/base/error.h"

namespace reshard::test {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

// ---- files and directories --------------------------------------------------------------

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

/// Sets (or, with no value, unsets) an environment variable for the scope, restoring what was
/// there on destruction.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value);
  ScopedEnv(const char* name, const char* value);  // nullptr: unset
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string ReadBytes(const fs::path& path);
/// Drops the file's pages from the page cache (fdatasync first: clean pages of a file the
/// test wrote); the kernel may keep some (tests check PageCacheResidency after).
void Evict(const fs::path& path);
void WriteBytes(const fs::path& path, std::string_view bytes);
/// Names of the regular files under `dir`, recursively, relative to it, sorted.
std::vector<std::string> ListFiles(const fs::path& dir);

/// Deterministic pseudo-random bytes (a 64-bit LCG), different for each seed.
std::string PatternBytes(size_t n, uint64_t seed);

uint64_t Le64(std::string_view bytes, size_t at);
void PutLe64(std::string& bytes, size_t at, uint64_t v);
uint32_t Le32(std::string_view bytes, size_t at);
void PutLe32(std::string& bytes, size_t at, uint32_t v);

/// XXH3-64 (seed 0) straight from xxhash.h, not through the library.
uint64_t RefXxh3(std::string_view bytes);
/// printf("%016llx").
std::string RefHex16(uint64_t v);
/// The tensor checksum by the spec: XXH3-64 of the chunk checksums as consecutive u64 LE.
uint64_t RefCombine(const std::vector<uint64_t>& chunk_checksums);
/// XXH3-64 of each `chunk_size` piece of `bytes` (the last one may be shorter).
std::vector<uint64_t> RefChunkHashes(std::string_view bytes, uint64_t chunk_size);

// ---- safetensors ------------------------------------------------------------------------

/// Bits per element by safetensors dtype name (an independent table; 0 for unknown names).
uint32_t DtypeBits(std::string_view dtype);

struct TensorSpec {
  std::string name;
  std::string dtype;             // as written in the header
  std::vector<uint64_t> shape;
  std::string data;              // the tensor's bytes, row-major

  uint64_t Numel() const;
  /// Bytes of one dim-0 row (shape[0] > 0 or not); the whole tensor for 0-dim.
  uint64_t RowBytes() const;
};

/// A tensor filled with PatternBytes of the right size for its dtype and shape.
TensorSpec MakeTensor(std::string name, std::string dtype, std::vector<uint64_t> shape,
                      uint64_t seed);

/// The header of a valid safetensors file holding `tensors` packed in this order (so
/// data_offsets are consecutive), plus `__metadata__` when `metadata` is set.
ojson SafetensorsHeader(const std::vector<TensorSpec>& tensors,
                        const std::optional<std::map<std::string, std::string>>& metadata =
                            std::nullopt);
/// The concatenated data of `tensors`, in order.
std::string SafetensorsData(const std::vector<TensorSpec>& tensors);

/// Assembles a file: u64 LE header length, header text, data. `length` overrides the length
/// field (for broken variants); otherwise it is the text's size.
std::string AssembleSafetensors(std::string_view header_text, std::string_view data,
                                std::optional<uint64_t> length = std::nullopt);

/// A whole valid file. `mutate` may edit the header before it is written (to break it);
/// the header text is space-padded to a multiple of 8 bytes as the Python writer does.
std::string SafetensorsBytes(const std::vector<TensorSpec>& tensors,
                             const std::function<void(ojson&)>& mutate = nullptr);

// ---- checkpoints ------------------------------------------------------------------------

/// The tensors of a generated checkpoint, by name, for brute-force comparison.
using TensorMap = std::map<std::string, TensorSpec>;

/// Writes a sharded checkpoint: files[i] goes to model-0000{i+1}-of-0000{n}.safetensors and
/// model.safetensors.index.json maps every tensor to its file. Returns the tensors by name.
TensorMap WriteShardedCheckpoint(const fs::path& dir,
                                 const std::vector<std::vector<TensorSpec>>& files);

/// A small multi-file checkpoint with awkward shapes: rows not divisible by common world
/// sizes, fewer rows than ranks, 0-dim tensors, empty tensors, several dtypes, and tensors
/// larger than one 4096-byte chunk. `seed` changes every byte.
std::vector<std::vector<TensorSpec>> AwkwardCheckpointFiles(uint64_t seed);

// ---- the FSDP2 chunk rule, brute force --------------------------------------------------

/// Rows of rank `rank` found by handing out rows one rank at a time: the chunk size is the
/// smallest c with c·W ≥ n, and each rank in turn takes min(c, rows left).
std::pair<uint64_t, uint64_t> BruteRows(uint64_t n, uint64_t world_size, uint64_t rank);

/// The bytes rank `rank` of `world_size` must hold for tensor `t` (R1 + rank-file.md).
std::string BruteSlice(const TensorSpec& t, uint64_t world_size, uint64_t rank);

// ---- rank files -------------------------------------------------------------------------

/// The pieces of a rank file decoded from bytes by the test (not by the library).
struct RawRankFile {
  std::string bytes;
  uint32_t format_version = 0;
  uint32_t flags = 0;
  uint64_t data_offset = 0;
  uint64_t data_size = 0;
  uint64_t header_offset = 0;
  uint64_t header_size = 0;
  uint64_t header_xxh3 = 0;
  ojson header;

  static RawRankFile Read(const fs::path& path);
};

/// A preamble built by the test from the spec's table, with a correct preamble_xxh3.
std::string RefPreamble(uint32_t format_version, uint32_t flags, uint64_t data_offset,
                        uint64_t data_size, uint64_t header_offset, uint64_t header_size,
                        uint64_t header_xxh3);

/// Rewrites the rank file at `path`: `mutate` edits the header JSON; the header is then
/// re-serialized and written after the (unchanged) data region, and the preamble's
/// header_size, header_xxh3 and preamble_xxh3 are recomputed, so that only the invariant the
/// mutation breaks fails.
void EditRankHeader(const fs::path& path, const std::function<void(ojson&)>& mutate);

/// Reads tensor `name` of a raw-codec rank file with the test's own decoder (header JSON,
/// offset relative to data_offset); checks nothing.
std::string RawTensorBytes(const RawRankFile& f, const std::string& name);

/// Equal byte strings; on a difference, says where (instead of printing both strings).
::testing::AssertionResult SameBytes(std::string_view got, std::string_view expected);

// ---- errors -----------------------------------------------------------------------------

/// Runs `fn`, expecting a reshard::Error with `code` whose message contains every one of
/// `needles`. Returns the message (empty after a failure).
template <typename Fn>
::testing::AssertionResult ThrowsError(Fn&& fn, ErrorCode code,
                                       std::initializer_list<std::string_view> needles,
                                       std::string* message = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string m = e.what();
    if (message) *message = m;
    if (e.code() != code) {
      return ::testing::AssertionFailure()
             << "error code " << ErrorCodeName(e.code()) << ", expected " << ErrorCodeName(code)
             << "; message: " << m;
    }
    for (auto n : needles) {
      if (m.find(n) == std::string::npos) {
        return ::testing::AssertionFailure()
               << "message lacks \"" << n << "\"; message: " << m;
      }
    }
    return ::testing::AssertionSuccess() << m;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-reshard exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace reshard::test
