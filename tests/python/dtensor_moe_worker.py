"""One rank of an expert-parallel job (torchrun, gloo, CPU, 4 ranks) arranged as torchtitan
arranges it on torch 2.11: the world mesh unflattened into a dense mesh `fsdp=4` and a sparse
one `efsdp=2 x ep=2` over the same ranks; a Mixtral built by reshard.empty_model on the meta
device; each layer's fused experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]) distributed `Shard(0)` over `ep` and fully_shard'ed over `efsdp` (their own FSDP
unit), every decoder layer and the root fully_shard'ed over `fsdp`; to_empty, then:

    dtensor_moe_worker.py RESULT SRC LABEL=OUT [LABEL=PATH ...]

1. a job whose dense parameters are fully_shard'ed over two meshes (the embeddings over
   another 1-D mesh `dp`): refused before any byte moves, naming both parameters;
2. reshard.load of each LABEL=PATH in turn into the same model (every local tensor NaN first):
   every parameter's full_tensor() and every buffer bit-equal to from_pretrained(SRC), the
   independent reference; the report's layout and source recorded;
3. when every rank loaded every source exactly: the logits of a fixed batch against
   from_pretrained's, with the experts run as transformers' expert parallel runs them (every
   rank of an ep group sees the same tokens, computes its own experts' share, the shares summed
   over `ep`), and 8 AdamW steps.

Writes RESULT/rank-<r>.json."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import reshard
import reshard.ep
from dtensor_common import differences
from dist_util import worker_main


def build(out, dense, sparse, split_dense=None):
    """The job (reshard.ep.parallelize, the arrangement reshard.train --ep runs): experts Shard(0)
    over ep (torchtitan's ExpertParallel), fully_shard'ed over efsdp in their own unit, run by
    reshard.ep's expert-parallel forward; each decoder layer and the root over fsdp
    (`split_dense`: the embeddings over that mesh instead, a job reshard refuses)."""
    model = reshard.empty_model(out)
    if split_dense is not None:
        fully_shard(model.model.embed_tokens, mesh=split_dense)
    reshard.ep.parallelize(model, dense, sparse)
    model.to_empty(device="cpu")
    return model


def main():
    result, src = sys.argv[1:3]
    sources = sys.argv[3:]  # label=path, loaded in this order, each checked
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))  # a hang fails, fast
    rank = dist.get_rank()
    # torchtitan's ParallelDims (torch 2.11 era): one world mesh unflattened twice.
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (4,), ("fsdp",))
    sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
    out = sources[0].split("=", 1)[1]
    rec = {"rank": rank, "loads": {}}
    # Refused before any byte moves: the dense parameters fully_shard'ed over two meshes.
    other_dp = world._unflatten(0, (4,), ("dp",))
    try:
        reshard.load(build(out, dense["fsdp"], sparse, split_dense=other_dp["dp"]), out)
        rec["split"] = "loaded"
    except reshard.ReshardError as e:
        rec["split"] = f"{type(e).__name__}: {e}"
    model = build(out, dense["fsdp"], sparse)
    ref = transformers.MixtralForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    bad = 0
    for spec in sources:
        label, path = spec.split("=", 1)
        with torch.no_grad():  # NaN everywhere first: a tensor the load misses cannot pass
            for p in model.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
        report = reshard.load(model, path)
        differ = differences(model, ref)
        bad += len(differ)
        rec["loads"][label] = {"layout": report.layout, "source": report.source, "bytes": report.bytes,
                               "differ": differ}
    rec["params"] = len(dict(ref.named_parameters()))
    rec["placements"] = {reshard.model.clean_name(n): [str(x) for x in p.placements]
                         for n, p in model.named_parameters() if isinstance(p, DTensor)}
    rec["meshes"] = {reshard.model.clean_name(n): list(p.device_mesh.mesh_dim_names)
                     for n, p in model.named_parameters() if isinstance(p, DTensor)}
    rec["local_rows"] = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()
                         if n in ("model.embed_tokens.weight", "model.layers.0.mlp.experts.gate_up_proj")}
    # Forward and training only when every rank loaded exactly (garbage weights could send the
    # ranks down different paths): the flag is agreed on by all of them.
    flag = torch.tensor([bad])
    dist.all_reduce(flag)
    if int(flag) == 0:
        forward_and_train(model, ref, rec)
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


def forward_and_train(model, ref, rec):
    """The experts as transformers' expert parallel runs them (reshard.ep's forward, set by build)."""
    ids = torch.arange(2 * 24).reshape(2, 24) * 7 % model.config.vocab_size
    with torch.no_grad():
        want_logits = ref(input_ids=ids).logits.float()
        got_logits = model(input_ids=ids).logits.float()
    rec["logits_max_abs_diff"] = float((got_logits - want_logits).abs().max())
    rec["logits_scale"] = float(want_logits.abs().max())
    rec["argmax_agree"] = float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean())
    for m in model.modules():  # the forward above had no backward: reshard before training
        if isinstance(m, FSDPModule):
            m.reshard()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    rec["losses"] = losses


if __name__ == "__main__":
    worker_main(main)
