"""One rank of a DTensor job (torchrun, gloo, CPU) loading from what is there rather than from a
DTensor layout of its own (test_dtensor_anywhere.py): a Llama built by reshard.empty_model on
meta, tensor parallel over `tp` (the plan of test_dtensor_load.py), fully_shard over `dp_shard`
on every decoder layer and the root, to_empty, then reshard.load from each SOURCE in turn, the
parameters set to NaN before each. Reference: from_pretrained(SRC), bit for bit (full_tensor()
of every parameter, every buffer).

Arguments: SRC MESH RESULT SOURCE... ; a SOURCE is NAME=PATH, "{node}" in PATH standing for
rank // 2 (one OUT per node of two ranks). For NAME starting with "bad" the load must raise a
ReshardError (its text recorded). With NAME "partial", only the decoder layers
are fully_shard'ed (not the root): embed_tokens / lm_head / norm stay TP-only, which no parallel
plan can say next to fully_shard'ed layers -- the load must be refused naming the parameter.
With NAME "save_uncovered" (2x2 only), tensor parallel alone is applied (no fully_shard) and
reshard.save(model, PATH) must be refused: the parameters' mesh leaves out the dp_shard ranks.
With NAME "unsharded", the root's parameters are gathered first (model.unshard(), as after a
forward without backward): the load must be refused, then succeed after model.reshard(). Writes RESULT/rank-<r>.json."""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import reshard
from dtensor_common import apply_llama_tp, differences
from dist_util import worker_main



def build(like, mesh, root=True, fsdp=True):
    model = reshard.empty_model(like)
    apply_llama_tp(model, mesh["tp"])
    if fsdp and "dp_shard" in mesh.mesh_dim_names:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        if root:
            fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(math.nan)
    return model


def main():
    src, mesh_spec, result = sys.argv[1:4]
    sources = [a.split("=", 1) for a in sys.argv[4:]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    ref = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    want = dict(ref.named_parameters())
    rec = {"rank": rank, "loads": {}}
    for name, path in sources:
        path = path.replace("{node}", str(rank // 2))
        model = build(src, mesh, root=name != "partial", fsdp=name != "save_uncovered")
        entry = {}
        if name == "save_uncovered":
            # Tensor parallel alone on a 2x2 world: the parameters' mesh (tp, 2 ranks) leaves out
            # the dp_shard replicas, which would write the same rank files; refused.
            try:
                reshard.save(model, path)
                entry["error"] = "saved"
            except reshard.ReshardError as e:
                entry["error"] = f"{type(e).__name__}: {e}"
            entry["wrote"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
            rec["loads"][name] = entry
            continue
        if name == "unsharded":
            # The root's parameters gathered, as FSDP2 leaves them after a forward without
            # backward (it does not reshard the root after forward; this job's hand-written TP
            # plan gathers no activations, so unshard() stands in for the forward): a load into
            # them would be thrown away by the next reshard(). Refused; after model.reshard()
            # the load goes on.
            model.unshard()
            try:
                reshard.load(model, path)
                entry["gathered"] = "loaded"
            except reshard.ReshardError as e:
                entry["gathered"] = f"{type(e).__name__}: {e}"
            model.reshard()
        try:
            report = reshard.load(model, path)
            entry.update(source=report.source, layout=report.layout, bytes=report.bytes)
        except reshard.ReshardError as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            rec["loads"][name] = entry
            continue
        entry["differ"] = differences(model, ref)
        entry["params"] = len(want)
        rec["loads"][name] = entry
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
