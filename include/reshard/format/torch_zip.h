// Reading torch.save zip archives (pytorch_model.bin) as weight files: the central
// directory, the data.pkl record (through the restricted pickle reader), and the offset of
// every storage record; tensor data is never read here except for the fingerprint sample.
// Read from a file by ReadTorchZipFile (reshard/io/checkpoint.h).
#pragma once

#include "reshard/format/byte_source.h"
#include "reshard/format/checkpoint.h"
#include "reshard/format/zip_reader.h"

namespace reshard {

/// Validates the archive in `src` completely (fsdp-layouts.md R31-R33): a ZIP archive (ZIP64
/// allowed) of STORED records under one top-level prefix taken from the first entry;
/// `<prefix>/data.pkl` (CRC-32 checked) holding a state dict of tensors; `<prefix>/byteorder`
/// "little" when present; one `<prefix>/data/<key>` record of exactly the storage's size per
/// storage; every tensor contiguous and inside its storage. Tensors sharing a storage (tied
/// weights, views) are returned as overlapping byte ranges. Used by the file reader, tests and
/// the fuzz target.
///
/// header_xxh3 is XXH3-64 of the data.pkl record's bytes; sample_xxh3 is the data sample of
/// formats/rank-file.md over the tensors in (offset, nbytes, name) order.
///
/// Throws kUnsupported for a legacy (pre-zip) torch.save pickle, non-contiguous tensors,
/// big-endian archives and anything outside the pickle whitelist, kDataLoss for truncated or
/// malformed archives; messages name the file and what was found.
WeightFile ParseTorchZip(const ByteSource& src);

}  // namespace reshard
