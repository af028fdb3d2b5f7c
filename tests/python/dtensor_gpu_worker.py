"""One mesh coordinate of a DTensor job on CUDA, in one process (GPU tests, test_gpu.py): the
rank `RANK` of a fake process group of `WORLD` ranks (torch's FakeStore: collectives do nothing,
placements, mesh coordinates and local shapes are torch's own), so each coordinate of a 2x2 job
is loaded on the one GPU in turn. reshard.load needs no collective; nothing here uses one.

A Llama built by reshard.empty_model on meta, tensor parallel over `tp` (ColwiseParallel /
RowwiseParallel as tests/python/test_dtensor_load.py's plan), fully_shard over `dp_shard` on every
decoder layer and the root, to_empty on CUDA, reshard.load(OUT). Reference, independent of
reshard: from_pretrained(SRC)'s full tensors split by torch's own functions as this coordinate
holds them (TP: Shard._split_tensor per mesh dim; then FSDP2's _chunk_with_empty over dp_shard,
as FSDPParam does). Every parameter's to_local() (on CUDA) and every buffer must equal it bit for
bit. Prints one JSON line."""

import json
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

import reshard
from dtensor_common import apply_llama_tp
from dist_util import worker_main


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def expected_local(full, placements, mesh_shape, coord, fsdp_dim):
    """What this coordinate holds of `full`, by torch's split functions: the placements of the
    mesh dims other than fsdp_dim in mesh-dim order, then FSDP2's chunk on fsdp_dim."""
    local = full
    for m, p in enumerate(placements):
        if m == fsdp_dim or isinstance(p, Replicate):
            continue
        pieces, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=True)
        local = pieces[coord[m]]
    if fsdp_dim is not None:
        p = placements[fsdp_dim]
        if not isinstance(p, Replicate):
            local = _chunk_with_empty(local, mesh_shape[fsdp_dim], dim=p.dim)[coord[fsdp_dim]]
    return local


def main():
    src, out, mesh_spec, rank, device = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    shape = tuple(int(s) for _, s in dims)
    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh(device, shape, mesh_dim_names=tuple(n for n, _ in dims))
    model = reshard.empty_model(out)
    apply_llama_tp(model, mesh["tp"])
    fsdp = "dp_shard" in mesh.mesh_dim_names
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():  # NaN everywhere first: a byte reshard missed shows
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
    report = reshard.load(model, out)
    torch.cuda.synchronize() if device == "cuda" else None
    ref = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    want = dict(ref.named_parameters())
    coord = mesh.get_coordinate()
    fsdp_dim = mesh.mesh_dim_names.index("dp_shard") if fsdp else None
    differ, placements, on_device, local_bytes = [], {}, set(), 0
    for name, p in model.named_parameters():
        name = reshard.model.clean_name(name)
        if isinstance(p, DTensor):
            local = p.to_local()
            placements[name] = [str(x) for x in p.placements]
            # fully_shard of the root covers every parameter: TP's mesh dims first, FSDP2's
            # chunk last. Without fully_shard (tp alone) the norms are plain tensors, whole.
            exp = expected_local(want[name].detach(), p.placements, tuple(mesh.shape), coord, fsdp_dim)
        else:
            assert not fsdp, f"{name}: a plain tensor under fully_shard"
            local, exp = p.detach(), want[name].detach()
        on_device.add(local.device.type)
        local_bytes += local.numel() * local.element_size()
        if tuple(local.shape) != tuple(exp.shape) or not torch.equal(bits(local.cpu()), bits(exp)):
            differ.append(name)
    ref_b = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        name = reshard.model.clean_name(name)
        on_device.add(b.device.type)
        if b.dtype != ref_b[name].dtype or not torch.equal(bits(b.cpu()), bits(ref_b[name])):
            differ.append("buffer " + name)
    print(json.dumps({"rank": rank, "coordinate": list(coord), "layout": report.layout, "bytes": report.bytes,
                      "local_bytes": local_bytes, "params": len(want), "differ": differ,
                      "placements": placements, "devices": sorted(on_device)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
