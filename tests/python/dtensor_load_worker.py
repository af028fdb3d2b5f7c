"""One rank of DTensor jobs (torchrun, gloo, CPU), one per case of CASES.json, all on the mesh
MESH (e.g. "dp_shard=2,tp=2" or "tp=4"). Each case builds its model with reshard.empty_model
on the meta device, applies a tensor-parallel plan over mesh dim `tp` with torch's parallel
styles, fully_shard over `dp_shard` on every decoder layer and the root (when the mesh has it),
to_empty, then:

1. with "other": reshard.load of that OUT, which holds only a layout of another plan: planned
   for this job's placements over it, read, compared bit for bit with from_pretrained;
2. reshard.load of "out": every parameter's full_tensor() and every buffer bit-equal to
   from_pretrained("src") (the independent reference), and tied names still one parameter;
3. with "train": the logits of a fixed batch against from_pretrained's, and 10 AdamW steps.

Plans ("plan"), written here from the styles' definitions (not from reshard's helpers):
* "manual": every projection and the head column/row-wise, embeddings ColwiseParallel (S(1));
* "hf": transformers' own base_model_tp_plan / _tp_plan with torch's styles (colwise ->
  ColwiseParallel, rowwise -> RowwiseParallel, colwise_gather_output -> ColwiseParallel with
  replicated output, embedding_rowwise -> RowwiseParallel with replicated input and output);
  tied names tied again after parallelize_module;
* "hf-untied": as "hf" but the tie left as parallelize_module leaves it: must be refused;
* "hf-layers": transformers' plan of the decoder layers only: the tied embeddings / head stay
  plain tensors (to_empty unties them on a mesh without fully_shard; reshard.load ties them
  again);
* "torchtitan": torchtitan's Llama tensor + sequence parallel plan under the Hugging Face names
  (embeddings RowwiseParallel to sequence-sharded output, norms SequenceParallel, attention /
  MLP inputs gathered, o_proj / down_proj RowwiseParallel to sequence-sharded output, head
  ColwiseParallel from sequence-sharded input).

Writes RESULT/<case name>/rank-<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import reshard
from dtensor_common import apply_llama_tp, differences
from dist_util import worker_main


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def retie(model):
    """Every name transformers ties points at one parameter again (the last name's: lm_head's)."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        keep = model.get_parameter(target)
        owner, _, pname = source.rpartition(".")
        setattr(model.get_submodule(owner), pname, keep)


def apply_manual(model, tp):
    apply_llama_tp(model, tp)  # test_dtensor_load.py's PLAN (dtensor_common.llama_plan)


def apply_hf(model, tp, tie=True, layers_only=False):
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    plan = {f"model.{k}": styles[v]() for k, v in model.config.base_model_tp_plan.items()}
    plan.update({k: styles[v]() for k, v in type(model)._tp_plan.items()})
    if layers_only:
        plan = {k: v for k, v in plan.items() if k.startswith("model.layers.")}
    parallelize_module(model, tp, plan)
    if tie:
        retie(model)


def apply_torchtitan(model, tp):
    # torchtitan's apply_tp (llama3), module by module under the Hugging Face names.
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    retie(model)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(model, ref):
    """(names whose full tensor or buffer is not bit-equal to from_pretrained's, placements)."""
    placements = {reshard.model.clean_name(n): [str(x) for x in p.placements]
                  for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return differences(model, ref), placements


def run_case(case, mesh, rank):
    model = reshard.empty_model(case["out"])
    tp = mesh["tp"]
    plan = case["plan"]
    if plan == "manual":
        apply_manual(model, tp)
    elif plan in ("hf", "hf-untied"):
        apply_hf(model, tp, tie=plan == "hf")
    elif plan == "hf-layers":
        apply_hf(model, tp, tie=False, layers_only=True)
    elif plan == "torchtitan":
        apply_torchtitan(model, tp)
    else:
        raise ValueError(plan)
    if "dp_shard" in mesh.mesh_dim_names:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    rec = {"rank": rank}
    ref = transformers.AutoModelForCausalLM.from_pretrained(case["src"], dtype=torch.bfloat16)
    if case.get("other"):
        # OUT_OTHER holds only a layout of another plan: reshard.load plans this job's rank over
        # it (nothing stored); bit-exact too. Then every parameter is zeroed for the load of OUT.
        try:
            report = reshard.load(model, case["other"])
            rec["other"] = {"source": report.source, "layout": report.layout, "differ": compare(model, ref)[0]}
        except reshard.ReshardError as e:
            rec["other"] = {"error": f"{type(e).__name__}: {e}"}
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).zero_()
    try:
        report = reshard.load(model, case["out"])
    except reshard.ReshardError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["source"] = report.source
    rec["layout"] = report.layout
    rec["bytes"] = report.bytes
    want = dict(ref.named_parameters())
    differ, placements = compare(model, ref)
    rec["params"] = len(want)
    rec["checked"] = len(placements) + sum(1 for p in model.parameters() if not isinstance(p, DTensor))
    rec["differ"] = differ
    rec["placements"] = placements
    rec["tied"] = [[t, s, model.get_parameter(t) is model.get_parameter(s)]
                   for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()]
    if case.get("train"):
        # Logits of a fixed batch against the unsharded reference (TP sums partial products in
        # another order: compared within a tolerance), then 10 AdamW steps on it: the loss falls.
        ids = torch.arange(2 * 24).reshape(2, 24) % model.config.vocab_size
        with torch.no_grad():
            want_logits = ref(input_ids=ids, use_cache=False).logits.float()
            got_logits = full(model(input_ids=ids, use_cache=False).logits).float()
        rec["logits_max_abs_diff"] = float((got_logits - want_logits).abs().max())
        rec["logits_scale"] = float(want_logits.abs().max())
        rec["argmax_agree"] = float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(10):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(full(loss)))
        rec["losses"] = losses
        rec["tied_after_training"] = [model.get_parameter(t) is model.get_parameter(s)
                                      for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()]
    return rec


def main():
    cases_file, mesh_spec, result = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    with open(cases_file) as f:
        cases = json.load(f)
    for case in cases:
        rec = run_case(case, mesh, rank)
        d = os.path.join(result, case["name"])
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"rank-{rank}.json"), "w") as f:
            json.dump(rec, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
