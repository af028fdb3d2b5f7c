// Optimizer state of a saved checkpoint (formats/manifest.md, "Saved checkpoints": OUT/KEY/
// optim/) as a virtual checkpoint of whole tensors, and planned again for another layout: the
// byte map of `reshard reshard`. Pure: headers in, pieces, entries and maps out.
//
// State tensors are named `<parameter>#<state key>`. Each kind of state maps to whole tensors:
// * FSDP2 `sharded` state is sharded exactly like its parameter, and 0-dim `whole` state is
//   on every rank: the optimizer rank files are a layout of their own
//   (DescribeLayoutTensors);
// * FSDP1 `local` state of a flat shard (no use_orig_params: `<unit>._flat_param#k`) is rank
//   r's shard [r·c, (r+1)·c) of a flat parameter laid out exactly as the unit's (its `flat`
//   object, in the state's dtype): the pieces of each original parameter are
//   `<parameter key>#k`, shaped like the parameter; 0-dim state keeps its name
//   (`<unit>._flat_param#step`);
// * FSDP1 `local` state under use_orig_params (`<parameter>#k`, the parameter being
//   `<unit>.<fqn>`) is the parameter's elements inside rank r's shard, in order: one piece of
//   `<parameter>#k`, shaped like the parameter.
// The target side is the inverse: FSDP2 state is planned like any tensor (PlanRank); FSDP1
// flat-shard state is the unit's flat shard in the state's dtype (padding zero), original-
// parameter state the parameter's elements inside the rank's shard (1-D; the parameter's shape
// at world size 1).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "reshard/format/checkpoint.h"
#include "reshard/format/layout.h"
#include "reshard/format/rank_file_format.h"
#include "reshard/plan/byte_map.h"
#include "reshard/plan/layout_tensors.h"

namespace reshard {

/// The separator of `<parameter>#<state key>`.
inline constexpr char kOptimSep = '#';

/// Every state tensor of a saved optimizer as whole tensors, from the optimizer rank files'
/// headers (`optim[r]`: rank r's, `paths[r]` naming it) and the model layout's rank-0 header
/// `model0` (its kind and, for FSDP1, the units' flat objects). Pieces are checked to tile
/// every tensor exactly (no gap, no byte twice, none outside its entry). Throws kMismatch /
/// kDataLoss naming the file and the tensor: a state tensor of no parameter, a local state
/// whose size is not its parameter's part of the rank's shard, ranks disagreeing on a state
/// tensor's dtype, a parameter whose elements are held by no rank.
std::vector<TensorLocation> DescribeOptimizerTensors(const RankFileHeader& model0,
                                                     const std::vector<const RankFileHeader*>& optim,
                                                     const std::vector<std::string>& paths);

/// One state tensor of a planned optimizer rank file: its entry (shapes, rows, flat; no
/// sizes are laid out but `nbytes`) and its map; `param` and `key` split its name, `kind` is
/// optimizer.json's: "sharded", "whole" or "local".
struct PlannedState {
  TensorEntry entry;
  EntryMap map;
  std::string param, key, kind;
};

/// Plans rank `rank` of `layout`'s optimizer file over `view` (the virtual checkpoint of
/// DescribeOptimizerTensors' tensors). FSDP2: `model_rank` is unused. FSDP1: `model_rank` is
/// the planned model rank file of the same rank (its flat entries give the units). `path`
/// names the file in errors. Throws kMismatch naming the parameter and the state key when
/// the view lacks a state tensor a unit needs (a flat parameter's state must cover every
/// parameter of the unit) or two parameters' state of one unit differ in dtype.
std::vector<PlannedState> PlanOptimizerRank(const Checkpoint& view, const LayoutSpec& layout,
                                            uint32_t rank, const RankFileHeader& model_rank,
                                            const std::string& path);

}  // namespace reshard
