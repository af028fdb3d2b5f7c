// transformers' checkpoint conversions (renames, expert stacks, concatenations, splits) as
// plan-layer operations: the model's view of a checkpoint, and the byte map of a converted
// tensor in terms of the checkpoint's own tensors. Pure: reads no file.
//
// A conversion (reshard/format/model_manifest.h) names, for each model tensor whose checkpoint
// form differs, a tree of pure rearrangements of checkpoint tensors. Layouts are planned over
// ModelView (the model's names and shapes); each entry's byte map (reshard/plan/byte_map.h) is
// then expanded by ExpandConversion into runs of checkpoint elements, which FillEntry reads.
// Since every op only moves elements, a rank reads only the elements it owns.
#pragma once

#include <string>

#include "reshard/format/checkpoint.h"
#include "reshard/format/model_manifest.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/layout_tensors.h"

namespace reshard {

/// `ckpt` as the model sees it: the checkpoint tensors that no target uses, plus every
/// target (its name, shape and the dtype of its keys; file_index/offset: its first key's, for
/// ordering). Throws kMismatch naming `manifest_path` when a key is missing or its shape or
/// dtype is not what the capture recorded, or a target's keys differ in dtype.
Checkpoint ModelView(const Checkpoint& ckpt, const Conversion& conversion,
                     const std::string& manifest_path);

/// Rewrites every segment of `map` whose source is a target of `conversion` as the runs of
/// checkpoint elements it holds, in entry order; other segments are kept.
void ExpandConversion(EntryMap& map, const Conversion& conversion);

/// The elements [begin, begin + count) of `x` (row-major) as segments of its keys, appended
/// to `out` with entry elements from `entry_element` on; adjacent runs of one key are merged.
void ExprSegments(const ConversionExpr& x, uint64_t begin, uint64_t count, uint64_t entry_element,
                  std::vector<EntrySegment>& out);

/// A layout's tensors (DescribeLayoutTensors: the model's names) under the checkpoint's own
/// names, the inverse of the conversion: every tensor that is a target is replaced by the keys
/// its expression reads, each key's pieces the bytes of the targets that hold its elements
/// (the first target that holds an element wins where a key feeds two); other tensors are
/// kept. Keys come in the order of the targets that first read them, among the tensors kept.
/// Throws kUnsupported for a target of sub-byte elements and kMismatch (naming
/// `manifest_path`) when a key's elements are not all held by the layout's tensors.
std::vector<TensorLocation> HubNameLocations(const std::vector<TensorLocation>& tensors,
                                             const Conversion& conversion,
                                             const std::string& manifest_path);

}  // namespace reshard
