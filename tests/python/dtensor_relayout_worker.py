"""One rank of a DTensor job around `reshard relayout --mesh` (torchrun, gloo, CPU, issues
22 + 23), built as dtensor_save_worker.build builds it (TP over `tp`, fully_shard over
`dp_shard` when the mesh has it). Two phases:

* `train OUT SAVED MESH RESULT STEPS`: reshard.load(OUT), STEPS AdamW steps on a fixed batch,
  reshard.save(SAVED, optimizer=opt); rank 0 writes RESULT/trained.pt (every parameter's and
  optimizer state's full tensor) and then runs 2 more steps (the uninterrupted job's losses).
* `resume OUT SAVED MESH RESULT`: on another mesh, reshard.load(SAVED) (the layout relayout
  made) and reshard.load_optimizer: every full tensor compared with trained.pt bit for bit;
  then the same 2 more steps.

Writes RESULT/<phase>-rank-<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist
from dtensor_save_worker import bits, build, full, state_of, train_step
from torch.distributed.device_mesh import init_device_mesh

import reshard
from reshard.model import clean_name
from dist_util import worker_main

LR = 1e-2


def main():
    phase, out, saved, mesh_spec, result = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    model = build(out, mesh)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    rec = {"rank": rank, "phase": phase}
    if phase == "train":
        steps = int(sys.argv[6])
        reshard.load(model, out)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rec["losses"] = [train_step(model, opt, ids) for _ in range(steps)]
        r = reshard.save(model, saved, optimizer=opt, step=steps)
        rec["layout"] = r.layout
        params = {clean_name(n): full(p) for n, p in model.named_parameters()}
        state = state_of(opt, model)
        if rank == 0:
            torch.save({"params": params, "state": state}, os.path.join(result, "trained.pt"))
        rec["next"] = [train_step(model, opt, ids) for _ in range(2)]
    else:
        ref = torch.load(os.path.join(result, "trained.pt"))
        rep = reshard.load(model, saved)
        rec["layout"] = rep.layout
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rec["restored"] = reshard.load_optimizer(opt, model, saved)
        differ = []
        for n, p in model.named_parameters():
            n = clean_name(n)
            got, want = full(p), ref["params"][n]
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(bits(got), bits(want)):
                differ.append(n)
        state = state_of(opt, model)
        if sorted(state) != sorted(ref["state"]):
            differ.append(f"optimizer state of {sorted(set(state) ^ set(ref['state']))}")
        for n, st in ref["state"].items():
            for k, v in st.items():
                w = state.get(n, {}).get(k)
                if w is None or w.dtype != v.dtype or w.shape != v.shape or not torch.equal(bits(w), bits(v)):
                    differ.append(f"optimizer {n}[{k}]")
        rec["differ"] = differ
        rec["compared"] = len(ref["params"]) + sum(len(st) for st in ref["state"].values())
        rec["next"] = [train_step(model, opt, ids) for _ in range(2)]
    with open(os.path.join(result, f"{phase}-rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
