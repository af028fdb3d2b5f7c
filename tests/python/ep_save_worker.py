"""One rank of an expert-parallel job (torchtitan's arrangement on torch 2.11, 4 gloo ranks,
experts Shard(0) over ep=2 and fully_shard'ed over efsdp=2, the rest fully_shard'ed over a 1-D
fsdp=4 mesh of the same ranks: dtensor_moe_worker.build) saved with its optimizer and resumed:

    ep_save_worker.py RESULT SRC SAVE

1. reshard.load(SRC) (the Hugging Face checkpoint), 3 AdamW steps with reshard.ep's forward
   (each rank runs its experts, the shares summed over ep), reshard.save(model, SAVE,
   optimizer=opt, step=3); every parameter's full_tensor() and every optimizer state tensor
   (full) recorded, then one more step: the uninterrupted loss and parameters;
2. a fresh job: reshard.load(SAVE) + reshard.load_optimizer: every parameter and state tensor
   bit-equal to the saved job's, the step count and hyper-parameters restored; one more step:
   the loss and the parameters after it bit-equal to the uninterrupted job's; the rotary
   inv_freq, made a persistent buffer and changed before the save, restored from SAVE;
3. a job whose experts are placed otherwise (Shard(1) over ep): load_optimizer refused before
   any state is replaced, naming the parameter.

Writes RESULT/rank-<r>.json; rank 0 also RESULT/saved.pt (the saved job's full parameters)."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import reshard
import reshard.ep
from dtensor_common import bits
from dtensor_moe_worker import build
from dist_util import worker_main

clean = reshard.model.clean_name


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def params_of(model):
    return {clean(n): full(p).clone() for n, p in model.named_parameters()}


def state_of(model, opt):
    names = {id(p): clean(n) for n, p in model.named_parameters()}
    return {names[id(p)]: {k: full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for p, st in opt.state.items()}


def differ(a, b):
    """Names (name or name#key) whose tensors are not bit-equal (or missing on one side)."""
    out = []
    for n in sorted(set(a) | set(b)):
        x, y = a.get(n), b.get(n)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{n}#{k}" for k in differ(x, y)]
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
                out.append(n)
        elif x != y:
            out.append(n)
    return out


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)


def build_shard1(out, dense, sparse):
    """The experts Shard(1) over ep instead (another placement than the saved one)."""
    model = reshard.empty_model(out)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for pname, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(pname, nn.Parameter(distribute_tensor(p, sparse["ep"], [Shard(1)])))
        fully_shard(experts, mesh=sparse["efsdp"])
        fully_shard(layer, mesh=dense)
    fully_shard(model, mesh=dense)
    model.to_empty(device="cpu")
    return model


def persistent_rope(model):
    """The rotary inv_freq made a persistent buffer (Mixtral has none): saved once, whole, in the
    FSDP2 layout of the dense parameters, and read back from there."""
    model.model.rotary_emb._non_persistent_buffers_set.discard("inv_freq")
    return model


def main():
    result, src, save = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    dense, sparse = reshard.ep.meshes("cpu", 4, 2)  # fsdp=4; efsdp=2 x ep=2
    rec = {"rank": rank}
    ids = torch.arange(2 * 24).reshape(2, 24) * 7 % 37

    model = persistent_rope(build(src, dense, sparse))
    reshard.load(model, src)
    with torch.no_grad():  # a value of its own: what the fresh job gets is the saved one
        model.model.rotary_emb.inv_freq.mul_(1.5)
    opt = adamw(model)
    rec["losses"] = [step(model, opt, ids) for _ in range(3)]
    r = reshard.save(model, save, optimizer=opt, step=3)
    rec["save"] = {"layout": r.layout, "files": [os.path.relpath(f, save) for f in r.files], "bytes": r.bytes,
                   "save_id": r.save_id}
    saved_params, saved_state = params_of(model), state_of(model, opt)
    saved_rope = model.model.rotary_emb.inv_freq.clone()
    if rank == 0:
        torch.save(saved_params, os.path.join(result, "saved.pt"))
    rec["uninterrupted"] = step(model, opt, ids)
    after = params_of(model)

    model2 = persistent_rope(build(save, dense, sparse))
    with torch.no_grad():  # NaN first: a tensor the load misses cannot pass
        for p in model2.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
    lr = reshard.load(model2, save)
    rec["load"] = {"layout": lr.layout, "source": lr.source}
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0, foreach=False)  # hyper-parameters come from SAVE
    rec["restored"] = reshard.load_optimizer(opt2, model2, save)
    rec["param_differ"] = differ(saved_params, params_of(model2))
    rec["buffer_differ"] = differ({"inv_freq": saved_rope}, {"inv_freq": model2.model.rotary_emb.inv_freq})
    rec["state_differ"] = differ(saved_state, state_of(model2, opt2))
    rec["state_params"] = len(saved_state)
    rec["lr"] = opt2.param_groups[0]["lr"]
    rec["resumed"] = step(model2, opt2, ids)
    rec["after_differ"] = differ(after, params_of(model2))

    model3 = build_shard1(save, dense, sparse)
    opt3 = adamw(model3)
    try:
        reshard.load_optimizer(opt3, model3, save)
        rec["shard1"] = "loaded"
    except reshard.ReshardError as e:
        rec["shard1"] = f"{type(e).__name__}: {e}"
    rec["shard1_state"] = len(opt3.state)
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
