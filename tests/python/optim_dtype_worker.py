"""One rank of the optimizer-dtype test (torchrun, 2 gloo processes on CPU; test_save.py runs
it): reshard.load_optimizer into a job of another dtype than the save's casts the state as
torch's Optimizer.load_state_dict does.

For each job (FSDP2 over both ranks, from OUT_FSDP; tensor parallel tp=2 with row-wise
embeddings, from OUT_TP) and each direction (a bf16 job's save into an fp32 job, an fp32 job's
into a bf16 job): a job of the saving dtype loads OUT, takes 2 AdamW steps and reshard.save's
itself with the optimizer; a job of the other dtype reshard.load's the save and
reshard.load_optimizer's it: every state tensor but `step` has the parameter's dtype, device and
(DTensor) placements and equals `saved.to(that dtype)` bit for bit (full tensors); `step` is as
saved (dtype, CPU, value); one optimizer.step() runs and leaves the state in the parameter's
dtype. Any failed check raises, so torchrun exits non-zero; rank r writes RESULT/rank-<r>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import reshard
from dist_util import worker_main
from dtensor_common import apply_llama_tp, bits, full, train_step
from reshard.model import clean_name


def build(out, kind, mesh, dtype):
    model = reshard.empty_model(out, dtype=dtype)
    if kind == "tp":
        apply_llama_tp(model, mesh, row_embeddings=True)
    else:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    reshard.load(model, out)
    return model


def state_of(opt, model):
    """{parameter name: {state key: (full tensor, the tensor as the optimizer holds it)}}."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return {names[id(p)]: {k: (full(v), v) for k, v in st.items()} for p, st in opt.state.items()}


def cross(out, kind, mesh, save_dtype, load_dtype, saved) -> dict:
    model = build(out, kind, mesh, save_dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        train_step(model, opt, ids)
    reshard.save(model, saved, optimizer=opt, step=2)
    want = state_of(opt, model)
    assert want and all(v.dtype == save_dtype for st in want.values() for k, (v, _) in st.items() if k != "step")

    model2 = build(out, kind, mesh, load_dtype)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    restored = reshard.load_optimizer(opt2, model2, saved)
    assert restored == len(want), (restored, len(want))
    params = {clean_name(n): p for n, p in model2.named_parameters()}
    got = state_of(opt2, model2)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    checked = 0
    for name, st in want.items():
        p = params[name]
        assert sorted(got[name]) == sorted(st) == ["exp_avg", "exp_avg_sq", "step"], (name, sorted(got[name]))
        for k, (v, _) in st.items():
            w, held = got[name][k]
            if k == "step":  # as saved: torch does not cast it (no fused / capturable here)
                assert w.dtype == v.dtype and w.device.type == "cpu" and torch.equal(w, v), (name, k, w, v)
                continue
            assert w.dtype == p.dtype == load_dtype and w.device == p.device, (name, k, w.dtype, p.dtype)
            assert isinstance(held, DTensor) == isinstance(p, DTensor), (name, k)
            if isinstance(p, DTensor):
                assert held.placements == p.placements, (name, k, held.placements, p.placements)
            ref = v.to(load_dtype)  # what torch's load_state_dict makes of the saved state
            assert w.shape == ref.shape and torch.equal(bits(w), bits(ref)), f"state {name}[{k}] is not saved.to()"
            checked += 1
    loss = train_step(model2, opt2, ids)  # the first step of the resumed job runs
    assert loss == loss and abs(loss) != float("inf"), loss
    for p, st in opt2.state.items():
        for k, v in st.items():
            assert k == "step" or v.dtype == p.dtype, (k, v.dtype, p.dtype)
    return {"checked": checked, "loss": loss}


def main():
    out_fsdp, out_tp, work, result = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = {"rank": rank}
    for kind, out in (("fsdp2", out_fsdp), ("tp", out_tp)):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(kind,))
        for save_dtype, load_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
            tag = f"{kind}-{str(save_dtype)[6:]}-to-{str(load_dtype)[6:]}"
            rec[tag] = cross(out, kind, mesh, save_dtype, load_dtype, os.path.join(work, tag))
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
