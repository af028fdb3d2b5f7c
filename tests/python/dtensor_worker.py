"""One rank of test_dtensor_map's real-torch check, run by torchrun (gloo, CPU, 4 processes).

Records, for each case, what this rank's DTensor really holds: the global tensor is an arange
(element i holds i), so to_local() flattened is the list of global elements the local tensor
holds, in its order. Cases: distribute_tensor with every placement combination on meshes 2x2,
(4,), 1x4 and 4x1, uneven and empty shards included (src_data_rank=None, a local split through
the same _split_tensor, where a _StridedShard is involved: its scatter path asserts even
pieces); and FSDP2 fully_shard (over the
"dp_shard" dim) of parameters already sharded by tensor parallelism (distribute_tensor on the
"tp" dim), which gives _StridedShard from torch itself. Writes rank-<r>.json into --result;
the test compares it with reshard's map.
"""

import argparse
import itertools
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from dist_util import worker_main

SHAPES = [(5, 3), (7, 6), (2, 9), (1, 1)]  # uneven, and empty shards (1 row on 2 or 4 ranks)


def placement_str(p) -> str:
    if isinstance(p, _StridedShard):
        return f"_S({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    raise AssertionError(f"unexpected placement {p}")


def choices():
    return [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=2)]


def record(cases, kind, mesh_shape, shape, dt, fsdp_mesh_dim=-1):
    local = dt.to_local()
    cases.append({
        "kind": kind,
        "mesh_shape": list(mesh_shape),
        "coordinate": list(dt.device_mesh.get_coordinate()),
        "shape": list(shape),
        "placements": [placement_str(p) for p in dt.placements],
        "fsdp_mesh_dim": fsdp_mesh_dim,
        "local_shape": list(local.shape),
        "elements": [int(v) for v in local.reshape(-1).tolist()],
    })


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    cases = []
    for mesh_shape in [(2, 2), (4,), (1, 4), (4, 1)]:
        mesh = init_device_mesh("cpu", mesh_shape)
        for placements in itertools.product(choices(), repeat=len(mesh_shape)):
            for shape in SHAPES:
                g = torch.arange(shape[0] * shape[1], dtype=torch.int64).reshape(shape)
                # _StridedShard's scatter path asserts even pieces (_shard_tensor: "requires the
                # tensor dimension to be evenly divisible"); src_data_rank=None splits locally,
                # through the same _split_tensor, with no collective.
                strided = any(isinstance(p, _StridedShard) for p in placements)
                dt = distribute_tensor(g, mesh, list(placements), src_data_rank=None if strided else 0)
                record(cases, "distribute_tensor", mesh_shape, shape, dt)

    # FSDP2 over TP: a 2-D mesh (dp_shard, tp); TP shards each weight with distribute_tensor
    # on the tp sub-mesh (ColwiseParallel: Shard(0), RowwiseParallel: Shard(1)), then
    # fully_shard over dp_shard shards its local tensor on dim 0 (torch's default).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    tp = mesh["tp"]
    specs = {"col": ((7, 6), Shard(0)), "col_even": ((8, 4), Shard(0)), "row": ((5, 6), Shard(1)),
             "rep": ((3, 5), Replicate()), "col_tiny": ((3, 2), Shard(0))}
    model = nn.Module()
    for name, (shape, placement) in specs.items():
        g = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        model.register_parameter(name, nn.Parameter(distribute_tensor(g, tp, [placement])))
    fully_shard(model, mesh=mesh["dp_shard"])
    for name, (shape, _) in specs.items():
        p = getattr(model, name)
        assert tuple(p.device_mesh.mesh_dim_names) == ("dp_shard", "tp"), p.device_mesh
        record(cases, "fully_shard:" + name, (2, 2), shape, p, fsdp_mesh_dim=0)
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump(cases, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
