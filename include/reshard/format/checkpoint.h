// A Hugging Face checkpoint directory (or a single weight file) as a list of tensors, each a
// byte range of a safetensors file or of a torch.save zip archive (pytorch_model.bin).
// Opened from disk by OpenCheckpoint (reshard/io/checkpoint.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/format/source.h"

namespace reshard {

enum class WeightFormat { kSafetensors, kTorchZip };

/// One tensor of a weight file: `nbytes` row-major little-endian bytes at `offset`.
struct WeightTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  uint64_t offset = 0;  // absolute byte offset in the file
  uint64_t nbytes = 0;
};

/// A validated weight file. In a torch zip archive several tensors may share bytes (tied
/// weights saved twice on one storage, views).
struct WeightFile {
  std::string path;
  WeightFormat format = WeightFormat::kSafetensors;
  uint64_t file_size = 0;
  uint64_t header_xxh3 = 0;  // formats/rank-file.md `source.files[].header_xxh3`
  uint64_t sample_xxh3 = 0;  // formats/rank-file.md `source.files[].sample_xxh3`
  std::vector<WeightTensor> tensors;  // sorted by (offset, nbytes, name)
};

struct SourceTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  size_t file_index = 0;  // into Checkpoint::files
  uint64_t offset = 0;    // absolute byte offset in that file
  uint64_t nbytes = 0;
};

struct Checkpoint {
  std::filesystem::path dir;           // directory holding the weight files
  WeightFormat format = WeightFormat::kSafetensors;
  std::vector<WeightFile> files;       // sorted by name
  std::vector<SourceTensor> tensors;   // sorted by name
  SourceFingerprint fingerprint;
  std::string index_file;              // "model.safetensors.index.json",
                                       // "pytorch_model.bin.index.json" or empty
  std::vector<std::string> aux_files;  // config/tokenizer files present in dir

  const SourceTensor* Find(std::string_view name) const;
};

/// Parses the text of an index file (model.safetensors.index.json,
/// pytorch_model.bin.index.json): its weight_map, tensor name -> file name in the checkpoint
/// directory (a plain name, no '/'); every other member is ignored. Throws kDataLoss naming
/// `path` and the field (not JSON, no weight_map, a value that is not a string or not a plain
/// file name, an empty map, duplicate keys).
std::map<std::string, std::string> ParseWeightMap(std::string_view text, const std::string& path);

/// Files copied beside the layouts so the output directory is self-contained.
const std::vector<std::string>& AuxFileNames();

}  // namespace reshard
