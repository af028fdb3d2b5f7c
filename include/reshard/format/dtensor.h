// DTensor layouts: a device mesh and, per tensor, one placement per mesh dim; and the element
// map that follows from them: which elements of the global tensor the local tensor
// (DTensor.to_local()) of one mesh coordinate holds, in its row-major order. Pure, like the
// FSDP2 chunk rule (ChunkRows, reshard/format/layout.h), of which it is the generalization;
// the byte map of rank-file entries (reshard/plan/byte_map.h) is built on it.
//
// Semantics (torch 2.11, torch/distributed/tensor/placement_types.py and _api.py):
//  * distribute_tensor applies the placements in mesh-dim order, each to the local tensor the
//    previous ones left: Shard(d) on a mesh dim of size k keeps torch.chunk(local, k, d)[i]
//    (c = ceil(n / k), piece i = [min(i·c, n), min((i+1)·c, n)), possibly empty; to_local()
//    is unpadded); Replicate keeps everything; _StridedShard(d, sf) (its _split_tensor) chunks
//    the local dim into sf pieces, each piece into k, and keeps the concatenation of the i-th
//    sub-piece of every piece.
//  * fully_shard over a parameter that is already a DTensor (TP/EP) shards the TP-local tensor
//    with torch.chunk on its shard dim (_fsdp_param.py, FSDPParam._init_sharded_param) and
//    records _StridedShard(d, split_factor = shards of d by the TP placements) on its mesh dim.
//    Its local tensor is therefore the TP placements applied first, FSDP's chunk last
//    ("right-to-left"): `fsdp_mesh_dim` says so. This holds the same elements as the
//    left-to-right meaning of the recorded placements whenever the shards are even, and on a
//    dp mesh dim of size 2 always, but not in general (e.g. 7 rows, dp 3 × tp 2: coordinate
//    (2, 0) holds row 6 by _StridedShard and nothing under fully_shard); and an FSDP2 local
//    tensor of no elements has size 0 on the shard dim (FSDPParam.sharded_size).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace reshard {

/// One DTensor placement on one mesh dim.
struct Placement {
  enum class Kind : uint8_t { kReplicate, kShard, kStridedShard };
  Kind kind = Kind::kReplicate;
  uint32_t dim = 0;           // kShard, kStridedShard: the tensor dim
  uint64_t split_factor = 1;  // kStridedShard: torch's split_factor (1 to 2^20, the mesh size limit)

  static Placement Replicate() { return {}; }
  static Placement Shard(uint32_t d) { return {Kind::kShard, d, 1}; }
  static Placement StridedShard(uint32_t d, uint64_t sf) { return {Kind::kStridedShard, d, sf}; }
  bool IsShard() const { return kind != Kind::kReplicate; }
  /// torch's short form (Placement.__str__): "R", "S(0)", "_S(0,2)" (no space).
  std::string ToString() const;
  bool operator==(const Placement&) const = default;
};

/// Parses ToString()'s forms; also accepts torch's with a space ("_S(0, 2)"). nullopt when
/// not one of them.
std::optional<Placement> ParsePlacement(std::string_view text);

/// A device mesh: dim names and sizes; ranks are its coordinates in row-major order (as
/// DeviceMesh numbers torch.arange(world).view(shape)).
struct MeshSpec {
  std::vector<std::string> names;  // unique, [A-Za-z_][A-Za-z0-9_]*
  std::vector<uint32_t> shape;     // each ≥ 1

  size_t ndim() const { return shape.size(); }
  uint64_t Size() const;  // the world size
  /// "dp_shard=2,tp=2" (the --mesh flag)
  std::string Flag() const;
  /// "dp_shard2.tp2" (the layout key's part)
  std::string KeyPart() const;
  /// The coordinate of `rank` (< Size()), row-major.
  std::vector<uint32_t> Coordinate(uint64_t rank) const;
  /// Index of the dim called `name`, or -1.
  int Find(std::string_view name) const;
  /// Throws kInvalidArgument naming `what` unless names and shape are valid (1 to 8 dims,
  /// world size ≤ 2^20).
  void Check(const std::string& what) const;
  bool operator==(const MeshSpec&) const = default;
};

/// Parses "--mesh dp_shard=2,tp=2". Throws kInvalidArgument.
MeshSpec ParseMeshFlag(std::string_view text);

/// How one tensor is laid out on the mesh.
struct DTensorSharding {
  std::vector<Placement> placements;  // one per mesh dim, as the DTensor reports them
  /// ≥ 0: the mesh dim of fully_shard over a TP/EP DTensor (its placement is Shard(d) or
  /// _StridedShard(d, sf)): applied after all other mesh dims as torch.chunk of dim d, and a
  /// local tensor of no elements has size 0 on dim d (FSDPParam.sharded_size). -1:
  /// every placement in mesh-dim order (distribute_tensor).
  int32_t fsdp_mesh_dim = -1;
  /// The layout's mesh shape, kept with each entry in memory so that an entry alone maps
  /// (rank files write it once, as layout.mesh); empty where the caller passes it.
  std::vector<uint32_t> mesh_shape;
  bool operator==(const DTensorSharding&) const = default;
};

/// `length` consecutive indices of one tensor dim from `start` on.
struct IndexRun {
  uint64_t start = 0;
  uint64_t length = 0;
  bool operator==(const IndexRun&) const = default;
};

/// The ordered indices of one tensor dim that a local tensor holds, as runs (empty runs never
/// appear). A dim no placement shards is one run [0, n); Shard gives one run; _StridedShard
/// up to split_factor runs.
using IndexRuns = std::vector<IndexRun>;

/// The elements of the global tensor (shape `global_shape`) that the local tensor of mesh
/// coordinate `coordinate` holds: per tensor dim its indices, in order; the local tensor is
/// their cartesian product in row-major order (local_shape[d] = the count of dims[d]).
/// Throws kInvalidArgument (naming `what`) when the sharding does not fit: placements not one
/// per mesh dim, a dim past the tensor's, split_factor 0, an fsdp_mesh_dim whose placement is
/// not a shard or whose split_factor is not the other dims' shard count of its tensor dim.
std::vector<IndexRuns> DTensorLocalIndices(const std::vector<uint64_t>& global_shape,
                                           const DTensorSharding& sharding,
                                           const std::vector<uint32_t>& mesh_shape,
                                           const std::vector<uint32_t>& coordinate,
                                           const std::string& what);

/// The local tensor's shape alone (the counts of DTensorLocalIndices), in O(mesh dims): what
/// a header parser checks local_shape against without building index lists.
std::vector<uint64_t> DTensorLocalShape(const std::vector<uint64_t>& global_shape,
                                        const DTensorSharding& sharding,
                                        const std::vector<uint32_t>& mesh_shape,
                                        const std::vector<uint32_t>& coordinate,
                                        const std::string& what);

/// Number of indices of `runs`.
uint64_t CountOf(const IndexRuns& runs);

}  // namespace reshard
