"""One rank of a DTensor job (torchrun, gloo, CPU): a Llama built by reshard.empty_model on the
meta device, tensor parallel over mesh dim `tp` (torch's ColwiseParallel / RowwiseParallel, the
plan of tests/python/test_dtensor_load.py's plan file), fully_shard over `dp_shard` on every
decoder layer and the root, to_empty, then:

With TP_PLAN "hf", the tensor parallelism is transformers' own base_model_tp_plan / _tp_plan
applied with torch's styles (colwise -> ColwiseParallel, rowwise -> RowwiseParallel).

1. reshard.load of OUT_OTHER, which holds only a layout of another plan: must be refused before
   any byte moves, naming the parameter, both placements and the convert command;
2. reshard.load of OUT: every parameter's full_tensor() and every buffer bit-equal to
   from_pretrained(SRC) (the independent reference);
3. with TP_PLAN "hf": the logits of a fixed batch against from_pretrained's, and 10 AdamW steps.

Writes RESULT/rank-<r>.json."""

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import reshard


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def main():
    src, out, out_other, mesh_spec, result = sys.argv[1:6]
    tp_plan = sys.argv[6] if len(sys.argv) > 6 else "manual"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = [kv.split("=") for kv in mesh_spec.split(",")]
    mesh = init_device_mesh("cpu", tuple(int(s) for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    model = reshard.empty_model(out)
    tp = mesh["tp"]
    if tp_plan == "hf":
        # What a user does with transformers' own plan: its styles as torch's parallel styles.
        styles = {"colwise": ColwiseParallel, "colwise_gather_output": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {f"model.{k}": styles[v]() for k, v in model.config.base_model_tp_plan.items()}
        # colwise_gather_output: the head's vocab-sharded output gathered (full logits).
        plan.update({k: ColwiseParallel(output_layouts=Replicate()) if v == "colwise_gather_output" else styles[v]()
                     for k, v in type(model)._tp_plan.items()})
        parallelize_module(model, tp, plan)
    else:
        parallelize_module(model, tp, {"model.embed_tokens": ColwiseParallel(), "lm_head": ColwiseParallel()})
        for layer in model.model.layers:
            parallelize_module(layer, tp, {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    if "dp_shard" in mesh.mesh_dim_names:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    model.to_empty(device="cpu")
    rec = {"rank": rank}
    try:
        reshard.load(model, out_other)
        rec["other"] = "loaded"
    except reshard.LayoutMismatchError as e:
        rec["other"] = str(e)
    report = reshard.load(model, out)
    rec["source"] = report.source
    rec["layout"] = report.layout
    rec["bytes"] = report.bytes
    ref = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    want = dict(ref.named_parameters())
    differ, placements = [], {}
    for name, p in model.named_parameters():
        name = reshard.model.clean_name(name)
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if isinstance(p, DTensor):
            placements[name] = [str(x) for x in p.placements]
        if full.shape != want[name].shape or not torch.equal(bits(full), bits(want[name])):
            differ.append(name)
    ref_b = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        name = reshard.model.clean_name(name)
        if b.dtype != ref_b[name].dtype or not torch.equal(bits(b), bits(ref_b[name])):
            differ.append("buffer " + name)
    rec["params"] = len(want)
    rec["differ"] = differ
    rec["placements"] = placements
    if tp_plan == "hf":
        # Logits of a fixed batch against the unsharded reference (the TP reductions sum in
        # another order: compared within a tolerance), then 10 AdamW steps on it: the loss falls.
        ids = torch.arange(2 * 24).reshape(2, 24) % model.config.vocab_size
        with torch.no_grad():
            want_logits = ref(input_ids=ids).logits.float()
            got_logits = model(input_ids=ids).logits
            got_logits = (got_logits.full_tensor() if isinstance(got_logits, DTensor) else got_logits).float()
        rec["logits_max_abs_diff"] = float((got_logits - want_logits).abs().max())
        rec["logits_scale"] = float(want_logits.abs().max())
        rec["argmax_agree"] = float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(10):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        rec["losses"] = losses
    with open(os.path.join(result, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
