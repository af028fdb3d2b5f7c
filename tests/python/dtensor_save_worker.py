"""One rank of a DTensor job that saves (torchrun, gloo, CPU, issue 22): a Llama built by
reshard.empty_model on the meta device, tensor parallel over mesh dim `tp` (torch's
ColwiseParallel / RowwiseParallel, the plan of tests/python/test_dtensor_save.py), fully_shard
over `dp_shard` when the mesh has it, to_empty, then:

1. reshard.load(model, OUT), reshard.save(model, SAVED0, blocking=False) right away (no
   optimizer; an asynchronous save, waited for);
2. STEPS AdamW steps on a fixed batch, reshard.save(model, SAVED, optimizer=opt, step=STEPS);
   rank 0 writes every parameter's full_tensor() and every optimizer state's to
   RESULT/trained.pt (the reference for export);
3. a fresh model (built the same way) reshard.load(SAVED) and a fresh AdamW
   reshard.load_optimizer(SAVED): every parameter's full_tensor(), buffer and optimizer state
   bit-equal to the trained model's; one more step on both models: the same loss and the same
   parameters, bit for bit;
4. 2x2 only: a job that fully_shards the decoder layers but not the root (embeddings, norm and
   head not sharded over dp_shard): no parallel plan says it; reshard.save refuses by name and
   commits nothing;
5. rank 0 copies SAVED to SAVED_BAD and flips one byte of the first tensor of rank 1's file:
   reshard.load of it fails on rank 1 (a chunk checksum), loads on the others.

Writes RESULT/rank-<r>.json."""

import json
import os
import shutil
import struct
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import reshard
from dtensor_common import apply_llama_tp, full, train_step
from reshard.model import clean_name
from dist_util import worker_main


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def build(out, mesh, fsdp_root=True):
    model = reshard.empty_model(out)
    apply_llama_tp(model, mesh["tp"], row_embeddings=True)
    if "dp_shard" in mesh.mesh_dim_names:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        if fsdp_root:
            fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    return model


def state_of(opt, model):
    """{parameter name: {state key: full tensor}}."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return {names[id(p)]: {k: full(v) for k, v in st.items()} for p, st in opt.state.items()}


def main():
    src, out, saved0, saved, saved_bad, mesh_spec, result, steps = sys.argv[1:9]
    steps = int(steps)
    del src
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    rec = {"rank": rank}

    model = build(out, mesh)
    reshard.load(model, out)
    r0 = reshard.save(model, saved0, blocking=False).wait()  # asynchronous: snapshot, background commit
    rec["layout0"] = r0.layout
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec["losses"] = [train_step(model, opt, ids) for _ in range(steps)]
    r = reshard.save(model, saved, optimizer=opt, step=steps)
    rec["layout"] = r.layout
    rec["wrote"] = r.wrote
    rec["plan"] = r.plan
    params = {clean_name(n): full(p) for n, p in model.named_parameters()}
    buffers = {clean_name(n): b.detach().clone() for n, b in model.named_buffers()}
    state = state_of(opt, model)
    if rank == 0:
        torch.save({"params": params, "state": state}, os.path.join(result, "trained.pt"))

    # 3. A fresh job from the save: the same weights, buffers and optimizer state, bit for bit.
    model2 = build(out, mesh)
    rep = reshard.load(model2, saved)
    rec["loaded_layout"] = rep.layout
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    rec["restored"] = reshard.load_optimizer(opt2, model2, saved)
    differ = []
    placements = {}
    for n, p in model2.named_parameters():
        n = clean_name(n)
        if isinstance(p, DTensor):
            placements[n] = [str(x) for x in p.placements]
        got = full(p)
        if got.dtype != params[n].dtype or got.shape != params[n].shape or not torch.equal(bits(got), bits(params[n])):
            differ.append(n)
    for n, b in model2.named_buffers():
        n = clean_name(n)
        if b.dtype != buffers[n].dtype or not torch.equal(bits(b), bits(buffers[n])):
            differ.append("buffer " + n)
    state2 = state_of(opt2, model2)
    if sorted(state2) != sorted(state):
        differ.append(f"optimizer state of {sorted(set(state) ^ set(state2))}")
    for n, st in state.items():
        for k, v in st.items():
            w = state2.get(n, {}).get(k)
            if w is None or w.dtype != v.dtype or w.shape != v.shape or not torch.equal(bits(w), bits(v)):
                differ.append(f"optimizer {n}[{k}]")
    rec["differ"] = differ
    rec["placements"] = placements
    rec["state_keys"] = sorted({k for st in state.values() for k in st})
    # One more step on both: the same loss and parameters.
    rec["next_loss"] = [train_step(model, opt, ids), train_step(model2, opt2, ids)]
    rec["next_differ"] = [n for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters())
                          if not torch.equal(bits(full(p)), bits(full(q)))]

    # 4. fully_shard of the layers only: the embeddings, norm and head are not sharded over
    # dp_shard while the layers' parameters are; no plan says that, and the save says why.
    if "dp_shard" in mesh.mesh_dim_names:
        partial = build(out, mesh, fsdp_root=False)
        try:
            reshard.save(partial, saved_bad + "-partial")
            rec["partial"] = "saved"
        except reshard.ReshardError as e:
            rec["partial"] = f"{type(e).__name__}: {e}"
        rec["partial_written"] = os.path.exists(os.path.join(saved_bad + "-partial", "reshard.json"))

    # 5. A corrupted rank file of the save: its rank's load fails, naming the file.
    if rank == 0:
        shutil.copytree(saved, saved_bad)
        manifest = json.load(open(os.path.join(saved_bad, "reshard.json")))
        key = r.layout
        name = next(x["file"] for x in manifest["layouts"][key]["ranks"] if x["rank"] == 1)
        path = os.path.join(saved_bad, key, name)
        with open(path, "r+b") as fh:  # the header by the preamble (formats/rank-file.md)
            header_offset, header_size = struct.unpack_from("<QQ", fh.read(64), 32)
            fh.seek(header_offset)
            t = next(t for t in json.loads(fh.read(header_size))["tensors"] if t["nbytes"] > 0)
            fh.seek(4096 + t["offset"] + t["nbytes"] // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x40]))
        rec["corrupted"] = [path, t["name"]]
    dist.barrier()
    model3 = build(out, mesh)
    try:
        reshard.load(model3, saved_bad)
        rec["bad_load"] = "loaded"
    except reshard.ReshardError as e:
        rec["bad_load"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
