"""One rank of an expert-parallel job whose experts torchtitan fully_shards on tensor dim 1 (4 gloo
ranks, ep=2, efsdp=2, a tiny Mixtral of 2 experts: efsdp x ep = 4 > 2, so reshard.ep.parallelize
passes shard_placement_fn=lambda p: Shard(1) for the experts, as torchtitan's apply_fsdp does):

    ep_dim1_worker.py RESULT SRC LABEL=PATH [LABEL=PATH ...] -- SAVE SAVE0

1. reshard.load of each LABEL=PATH into the same model (every local tensor NaN first): every
   parameter's full_tensor() and every buffer bit-equal to from_pretrained(SRC); the report's
   layout and source recorded, and the experts' placements;
2. 2 AdamW steps, reshard.save(model, SAVE, optimizer=opt, step=2); a fresh job's reshard.load
   + reshard.load_optimizer: every parameter and state tensor bit-equal to the saved job's;
3. a job with the experts on dim 0 (experts_fsdp_dim=0) loaded from SRC, one step, saved to
   SAVE0 with its optimizer; the dim-1 job's reshard.load and reshard.load_optimizer of SAVE0
   refused (the messages recorded), the optimizer state untouched.

Writes RESULT/rank-<r>.json."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

import reshard
import reshard.ep
from dtensor_common import differences, refused
from dist_util import worker_main
from ep_save_worker import adamw, differ, params_of, state_of, step


def build(path, dense, sparse, experts_fsdp_dim=None):
    model = reshard.empty_model(path)
    reshard.ep.parallelize(model, dense, sparse, experts_fsdp_dim=experts_fsdp_dim)
    model.to_empty(device="cpu")
    return model


def nan_fill(model):
    with torch.no_grad():  # a tensor the load misses cannot pass
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))


def main():
    result, src = sys.argv[1:3]
    sep = sys.argv.index("--")
    sources = sys.argv[3:sep]
    save, save0 = sys.argv[sep + 1:sep + 3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    dense, sparse = reshard.ep.meshes("cpu", 4, 2)  # fsdp=4; efsdp=2 x ep=2
    rec = {"rank": rank, "loads": {}}
    ids = torch.arange(2 * 16).reshape(2, 16) * 7 % 37

    model = build(src, dense, sparse)
    ref = transformers.MixtralForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    for spec in sources:
        label, path = spec.split("=", 1)
        nan_fill(model)
        report = reshard.load(model, path)
        rec["loads"][label] = {"layout": report.layout, "source": report.source, "differ": differences(model, ref)}
    rec["placements"] = {reshard.model.clean_name(n): [str(x) for x in p.placements]
                         for n, p in model.named_parameters() if isinstance(p, DTensor)}
    rec["local_shapes"] = {reshard.model.clean_name(n): list(p.to_local().shape)
                           for n, p in model.named_parameters() if "experts" in n}

    # Save with the optimizer, load into a fresh job: bit for bit.
    opt = adamw(model)
    rec["losses"] = [step(model, opt, ids) for _ in range(2)]
    r = reshard.save(model, save, optimizer=opt, step=2)
    rec["save"] = {"layout": r.layout}
    saved_params, saved_state = params_of(model), state_of(model, opt)
    model2 = build(save, dense, sparse)
    nan_fill(model2)
    lr = reshard.load(model2, save)
    rec["reload"] = {"layout": lr.layout, "source": lr.source}
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0, foreach=False)
    rec["restored"] = reshard.load_optimizer(opt2, model2, save)
    rec["param_differ"] = differ(saved_params, params_of(model2))
    rec["state_differ"] = differ(saved_state, state_of(model2, opt2))
    rec["state_params"] = len(saved_state)

    # A job with the experts on dim 0, saved; the dim-1 job cannot take its files.
    model0 = build(src, dense, sparse, experts_fsdp_dim=0)
    reshard.load(model0, src)
    opt0 = adamw(model0)
    step(model0, opt0, ids)
    reshard.save(model0, save0, optimizer=opt0, step=1)
    rec["placements0"] = [str(x) for x in model0.model.layers[0].mlp.experts.gate_up_proj.placements]
    model3 = build(save0, dense, sparse)
    rec["dim0_load"] = refused(lambda: reshard.load(model3, save0))
    opt3 = adamw(model3)
    rec["dim0_optim"] = refused(lambda: reshard.load_optimizer(opt3, model3, save0))
    rec["dim0_optim_state"] = len(opt3.state)
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
