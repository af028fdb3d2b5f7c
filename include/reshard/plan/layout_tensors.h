// Where every byte of each source tensor lives in one layout's rank files, described from the
// files' headers alone: the inverse of the plan, which Export (reshard/ops/export.h) streams
// from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/format/rank_file_format.h"

namespace reshard {

/// One contiguous piece of a source tensor: decoded bytes [src_offset, src_offset + length)
/// of tensor entry `entry` of the rank file of rank `rank` are bytes
/// [dst_offset, dst_offset + length) of the whole row-major tensor (in the rank files' dtype).
struct TensorPiece {
  uint32_t rank = 0;    // index into the headers given to DescribeLayoutTensors
  size_t entry = 0;     // index into that header's `tensors`
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

/// Where every byte of one source tensor lives in a layout's rank files.
struct TensorLocation {
  std::string name;
  DType dtype;                       // as stored in the rank files
  std::vector<uint64_t> shape;       // the source tensor's (global) shape
  uint64_t nbytes = 0;               // bytes of the whole tensor in `dtype`
  std::vector<TensorPiece> pieces;   // sorted by dst_offset, tiling [0, nbytes) exactly
};

/// Describes every source tensor of one layout from its rank files' headers (`headers[r]` is
/// rank r's, all of one layout; `paths[r]` names its file in errors), in the order rank 0's
/// header lists them, which is the source's order (file, then offset).
/// FSDP2: a tensor is one piece per rank holding rows, the byte range [start·R, end·R) of the
/// tensor (R = bytes of one dim-0 row); a 0-dim tensor is one piece of rank 0's copy.
/// Another layout kind (e.g. FSDP1 flat parameters, whose entries hold segments of several
/// source tensors) only adds its case here, turning its entries into pieces; pieces may start
/// and end anywhere inside an entry (chunks are decoded and checked whole, then cut), so
/// Export needs nothing else.
/// The description is checked whatever the layout kind: every rank lists the same tensors
/// with the same dtype and global shape, and the pieces tile each tensor with no gap, overlap
/// or byte outside their entry. Throws kMismatch (a rank lacks a tensor or disagrees) or
/// kDataLoss (pieces that do not tile the tensor), naming the file and the tensor.
std::vector<TensorLocation> DescribeLayoutTensors(const std::vector<const RankFileHeader*>& headers,
                                                  const std::vector<std::string>& paths);

/// Sorts `loc.pieces` by dst_offset and checks that they tile [0, loc.nbytes) exactly and lie
/// inside their entries (`headers[piece.rank]->tensors[piece.entry]`). Throws kDataLoss naming
/// the file and the tensor.
void CheckTensorPieces(TensorLocation& loc, const std::vector<const RankFileHeader*>& headers,
                       const std::vector<std::string>& paths);

}  // namespace reshard
