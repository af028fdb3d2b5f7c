// Export of one layout of a reshard output directory back into an ordinary Hugging Face
// checkpoint directory (sharded safetensors + index, config and tokenizer files). Where each
// tensor's bytes lie in the rank files: DescribeLayoutTensors (reshard/plan/layout_tensors.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/dtype.h"

namespace reshard {

// ---- the Hugging Face side ------------------------------------------------------------------

/// "5GB", "500MB", "10KB", "1TB", "1.5GB" (powers of 1000, as huggingface_hub's
/// parse_size_to_int: the unit is the last two characters, any case, the value a decimal
/// number, truncated to whole bytes) or a plain byte count "1048576". nullopt for anything
/// else and for 0.
std::optional<uint64_t> ParseMaxShardSize(std::string_view text);

/// Groups tensors of sizes `sizes` (in write order) into shards as huggingface_hub's
/// split_torch_state_dict_into_shards does for transformers' save_pretrained: greedily in
/// order; a shard is closed when the next tensor would take it past `max_shard_size`; a tensor
/// larger than `max_shard_size` gets a shard of its own, placed before the shard being filled.
/// Returns the indices of each shard, in shard order. No tensors give no shard.
std::vector<std::vector<size_t>> SplitIntoShards(const std::vector<uint64_t>& sizes,
                                                 uint64_t max_shard_size);

/// The order in which safetensors (0.8.0, `serialize`/`save_file`) writes tensors: dtypes by
/// descending alignment rank (U64, I64, F64, C64, F32, U32, I32, BF16, F16, U16, I16, F8_E8M0,
/// F8_E4M3, F8_E5M2, I8, U8, F6_E3M2, F6_E2M3, F4, BOOL), then names in byte order.
bool SafetensorsWriteOrder(DType a_dtype, std::string_view a_name, DType b_dtype,
                           std::string_view b_name);

// ---- export ------------------------------------------------------------------------------

struct ExportOptions {
  std::filesystem::path out;      // a reshard output directory (holds reshard.json)
  std::filesystem::path hf_dir;   // the Hugging Face checkpoint directory to write
  std::string layout;             // layout key; empty: the only layout of OUT
  uint64_t max_shard_size = 5'000'000'000;  // bytes; "5GB" as save_pretrained's default
  std::string dtype = "keep";     // keep, bf16, fp16, fp32: applied to the rank files' dtype
  unsigned threads = 0;           // 0: hardware concurrency
  bool force = false;             // replace a non-empty hf_dir
  bool hub_names = false;         // the checkpoint's names (OUT/reshard-model.json's conversion inverted)
  bool adapter = false;           // a save of a PEFT model's adapters: a PEFT adapter directory
  /// Called now and then with (bytes written, bytes total) from a worker thread; calls are
  /// serialized and the values never decrease. An exception thrown here aborts the export
  /// (nothing is left behind).
  std::function<void(uint64_t, uint64_t)> progress;
};

struct ExportResult {
  std::string layout_key;
  std::filesystem::path hf_dir;
  std::vector<std::string> weight_files;  // in shard order
  std::vector<std::string> aux_files;     // copied from OUT
  bool sharded = false;                   // wrote model.safetensors.index.json
  bool hub_names = false;                 // names inverted through a conversion
  uint64_t tensors = 0;
  uint64_t total_size = 0;                // tensor bytes written (index metadata.total_size)
  uint64_t bytes_read = 0;                // decoded rank-file bytes read (checksums checked)
  std::string config_dtype;               // set when config.json's dtype was rewritten to it
  bool config_dequantized = false;        // config.json's fp8 quantization_config removed (no FP8 weight)
  double seconds = 0;
};

/// Writes layout `options.layout` of `options.out` as a Hugging Face checkpoint into
/// `options.hf_dir`: model.safetensors, or model-0000i-of-0000N.safetensors +
/// model.safetensors.index.json when the tensors (after `dtype`) exceed max_shard_size, plus
/// the manifest's aux files (config.json, tokenizer files, ...; config.json's top-level
/// "dtype"/"torch_dtype" is set to the exported weights' floating dtype when it names another). Files are byte for byte what
/// safetensors.torch.save_file(..., metadata={"format": "pt"}) writes for the same tensors,
/// grouped as save_pretrained groups them (SplitIntoShards, in the source's tensor order); the
/// index is json.dumps(index, indent=2, sort_keys=True) + "\n" as transformers writes it.
///
/// Tensors stream from the rank files chunk by chunk (every chunk's checksum checked, zstd
/// frames decoded) straight to their place in the output: memory is a few chunk buffers per
/// thread, whatever the model size. Everything is written into a hidden staging directory
/// beside hf_dir (`.<name>.export-tmp-<host>-<pid>`), each file fsynced, the index last, then
/// renamed to hf_dir (exchanged with it under `force`, the old contents then removed): an
/// interrupted export leaves no hf_dir, only a staging directory that the next export to the
/// same hf_dir removes. Throws kNotFound (no manifest, no such layout), kInvalidArgument (bad
/// options, several layouts and none chosen, hf_dir not empty without force), kMismatch
/// (incomplete layout, rank files of another source or layout), kDataLoss (corrupt rank file).
ExportResult Export(const ExportOptions& options);

}  // namespace reshard
