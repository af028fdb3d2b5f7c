// Reading a source checkpoint from disk: the weight files' headers, parsed and validated by
// reshard/format/ (safetensors.h, torch_zip.h, checkpoint.h), and the directory's choice of
// files and index.
#pragma once

#include <filesystem>
#include <string>

#include "reshard/format/checkpoint.h"
#include "reshard/format/safetensors.h"

namespace reshard {

/// Opens `path` and validates its header completely (R29): header length, JSON, dtypes,
/// shapes, offsets (in bounds, no overlap, no holes, size = numel × itemsize), duplicate keys
/// (ParseSafetensorsHeader), then reads the data sample. Throws kDataLoss naming the file and
/// the field, kNotFound when missing.
SafetensorsFile ReadSafetensorsHeader(const std::string& path);

/// Opens `path` and validates it as ParseTorchZip (reshard/format/torch_zip.h) does. Throws
/// kNotFound when missing, and what ParseTorchZip throws.
WeightFile ReadTorchZipFile(const std::string& path);

/// Opens a checkpoint. A directory is read, in this order of preference (as transformers
/// does): model.safetensors.index.json (sharded), model.safetensors, a single *.safetensors
/// file, pytorch_model.bin.index.json (sharded torch zip archives), pytorch_model.bin. A file
/// is read as safetensors when it ends in .safetensors and as a torch zip archive when it ends
/// in .bin, .pt or .pth. Every header (every data.pkl) is validated; index entries pointing at
/// missing files or keys are errors; only the index's weight_map is trusted.
Checkpoint OpenCheckpoint(const std::filesystem::path& src);

}  // namespace reshard
