"""One rank of a DTensor job whose parameters are partly plain tensors, partly DTensors that
fully_shard did not make (test_dtensor_mixed.py): torchrun, gloo, CPU. Every load is compared
bit for bit against from_pretrained of the same checkpoint (full_tensor() of every parameter,
every buffer); the parameters are set to NaN before each load.

MODE "tp" (2 processes, mesh tp=2), arguments LLAMA MARIAN OTHER RESULT:
  head      a tiny Llama with only lm_head ColwiseParallel (S(0) over tp), nothing
            fully_shard'ed, the rest plain: loaded from the Hugging Face checkpoint, saved with
            reshard.save, loaded again from that save into a new job of the same arrangement;
  marian    a tiny Marian (never-saved sinusoidal embed_positions, tied shared / embed_tokens /
            lm_head, the final_logits_bias buffer) with fc1 ColwiseParallel and fc2
            RowwiseParallel in every layer: loaded from the checkpoint, saved, loaded again;
  other     the head job loaded from OUTHER, a checkpoint of another config: refused, the convert
            command it prints must not write into the checkpoint;
  partial   model.norm.weight a DTensor with a Partial placement: load and save refused naming
            the parameter and the mesh dim.
MODE "ep" (4 processes), arguments MIXTRAL RESULT: expert parallel without FSDP over the experts:
  ep1d      the fused experts Shard(0) over a 1-D ep=2 mesh, the dense parameters fully_shard'ed
            over fsdp=4: loaded from the checkpoint;
  ep2d      the experts (Replicate, Shard(0)) over efsdp=2 x ep=2: loaded, saved, loaded from the
            save.
Writes RESULT/<mode>-rank-<r>.json: {case: {layout, source, differ} or {error}}."""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import reshard
from dtensor_common import differences, refused
from dist_util import worker_main


def nan_filled(model):
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(math.nan)
    return model


def head_only(src, tp):
    model = reshard.empty_model(src)
    parallelize_module(model, tp, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return nan_filled(model)


def marian_tp(src, tp):
    model = reshard.empty_model(src)
    for stack in (model.model.encoder, model.model.decoder):
        for layer in stack.layers:
            parallelize_module(layer, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return nan_filled(model)


def loaded(build, path, ref) -> dict:
    """A new job from build() loaded from `path`: what the report says and what differs from `ref`."""
    model = build()
    try:
        r = reshard.load(model, path)
    except reshard.ReshardError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"layout": r.layout, "source": r.source, "differ": differences(model, ref)}


def round_trip(rec, name, build, src, ref, saved):
    """Loads from the checkpoint, saves, loads the save into a new job."""
    model = build()
    try:
        r = reshard.load(model, src)
        rec[name] = {"layout": r.layout, "source": r.source, "differ": differences(model, ref)}
        reshard.save(model, saved)
    except reshard.ReshardError as e:
        rec[name] = {"error": f"{type(e).__name__}: {e}"}
        return
    dist.barrier()
    with open(os.path.join(saved, "reshard.json")) as f:
        rec[name]["saved_layouts"] = sorted(json.load(f)["layouts"])
    rec[name + "_saved"] = loaded(build, saved, ref)


def main_tp(llama, marian, other, result, rec):
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref = transformers.LlamaForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    round_trip(rec, "head", lambda: head_only(llama, tp), llama, ref, os.path.join(result, "saved-head"))
    ref_m = transformers.MarianMTModel.from_pretrained(marian)
    round_trip(rec, "marian", lambda: marian_tp(marian, tp), marian, ref_m, os.path.join(result, "saved-marian"))
    rec["other"] = loaded(lambda: head_only(llama, tp), other, ref)

    # reshard.load of a submodule of a fully_shard'ed root: the root's unit holds the
    # submodule's own parameters (embeddings, final norm), an FSDP2 job all the same.
    fsdp = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    model = reshard.empty_model(llama)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    nan_filled(model)
    from reshard.load_dtensor import dtensor_job

    rec["submodule_job"] = repr(dtensor_job(model.model))
    try:
        r = reshard.load(model.model, llama)
        rec["submodule"] = {"layout": r.layout, "source": r.source, "differ": differences(model.model, ref.model)}
    except reshard.ReshardError as e:
        rec["submodule"] = {"error": f"{type(e).__name__}: {e}"}

    model = head_only(llama, tp)
    w = model.model.norm.weight
    model.model.norm.weight = nn.Parameter(DTensor.from_local(w.detach().clone(), tp, [Partial()], run_check=False))
    rec["partial"] = {"load": refused(lambda: reshard.load(model, llama)),
                      "save": refused(lambda: reshard.save(model, os.path.join(result, "saved-partial")))}


def mixtral_ep(src, dense, experts_mesh, placements):
    model = reshard.empty_model(src)
    placed = set()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for pname, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(pname, nn.Parameter(distribute_tensor(p, experts_mesh, placements)))
            placed.add(getattr(experts, pname))
    for layer in model.model.layers:  # the experts stay as placed: no FSDP over them
        fully_shard(layer, mesh=dense, ignored_params=placed)
    fully_shard(model, mesh=dense, ignored_params=placed)
    return nan_filled(model)


def main_ep(mixtral, result, rec):
    from reshard.ep import meshes

    dense, sparse = meshes("cpu", 4, 2)
    ref = transformers.MixtralForCausalLM.from_pretrained(mixtral, dtype=torch.bfloat16)
    rec["ep1d"] = loaded(lambda: mixtral_ep(mixtral, dense, sparse["ep"], [Shard(0)]), mixtral, ref)
    round_trip(rec, "ep2d", lambda: mixtral_ep(mixtral, dense, sparse, [Replicate(), Shard(0)]), mixtral, ref,
               os.path.join(result, "saved-ep"))


def main():
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = sys.argv[-1]
    rec = {}
    if mode == "tp":
        main_tp(*sys.argv[2:5], result, rec)
    else:
        main_ep(sys.argv[2], result, rec)
    with open(os.path.join(result, f"{mode}-rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
