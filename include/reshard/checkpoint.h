// A Hugging Face checkpoint directory (or a single .safetensors file) as a list of tensors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/dtype.h"
#include "reshard/safetensors.h"

namespace reshard {

struct SourceFile {
  std::string name;  // file name relative to the checkpoint directory
  uint64_t size = 0;
  uint64_t header_xxh3 = 0;
  uint64_t sample_xxh3 = 0;  // first and last 4 KiB of each tensor (formats/rank-file.md)
};

/// Identity of a source checkpoint (formats/rank-file.md, `source`).
struct SourceFingerprint {
  std::vector<SourceFile> files;  // sorted by name
  uint64_t fingerprint = 0;

  static SourceFingerprint FromFiles(std::vector<SourceFile> files);
  bool operator==(const SourceFingerprint& other) const;
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
  std::vector<SafetensorsFile> files;  // sorted by name
  std::vector<SourceTensor> tensors;   // sorted by name
  SourceFingerprint fingerprint;
  std::string index_file;              // "model.safetensors.index.json" or empty
  std::vector<std::string> aux_files;  // config/tokenizer files present in dir

  const SourceTensor* Find(std::string_view name) const;
};

/// Opens a checkpoint: a directory with model.safetensors.index.json (sharded), or with
/// *.safetensors files (single), or one .safetensors file. Every header is validated;
/// index entries pointing at missing files or keys are errors. pytorch_model.bin checkpoints
/// are refused with kUnsupported (for now).
Checkpoint OpenCheckpoint(const std::filesystem::path& src);

/// Files copied beside the layouts so the output directory is self-contained.
const std::vector<std::string>& AuxFileNames();

}  // namespace reshard
