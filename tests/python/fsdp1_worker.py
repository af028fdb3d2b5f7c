"""One rank of an FSDP1 (FullyShardedDataParallel) load check, run under torchrun on CPU/gloo
(or CUDA/NCCL with --device cuda).

Builds the same FSDP1 job twice: (a) from `from_pretrained` weights, FSDP1 flattening and
sharding them itself; (b) empty (meta) with reshard.empty_model, materialised by param_init_fn,
then reshard.load(OUT). Checks, per rank: every unit's local flat shard of (b) equals (a)'s bit
for bit, padding included; summon_full_params gives from_pretrained's weights bit for bit;
buffers equal; logits on a fixed batch equal (a)'s; a few AdamW steps lower the loss. Writes
a JSON result per rank."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from dist_util import worker_main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--wrap", default="", help="comma-separated class names; empty: default")
    ap.add_argument("--orig", action="store_true")
    ap.add_argument("--param-dtype", default="")
    ap.add_argument("--live-dtype", default="bf16")
    ap.add_argument("--strategy", default="FULL_SHARD")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--expect-error", default="")
    ap.add_argument("--plain-init", action="store_true", help="to_empty(recurse=False) as param_init_fn")
    args = ap.parse_args()

    import transformers
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import reshard
    from reshard.load_fsdp1 import fsdp1_units as _fsdp1_units
    from reshard.model import clean_name as _clean_name

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    live = dtypes[args.live_dtype]

    config = transformers.AutoConfig.from_pretrained(args.src)
    cls = getattr(transformers, config.architectures[0])

    def wrap_classes(model):
        if args.wrap == "root":  # one unit: the root alone
            return set()
        names = [c for c in args.wrap.split(",") if c] or list(getattr(model, "_no_split_modules", []) or [])
        return {type(m) for m in model.modules() if type(m).__name__ in names}

    mesh = None
    strategy = getattr(ShardingStrategy, args.strategy)
    if args.strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.replicas, ws // args.replicas),
                                mesh_dim_names=("replicate", "shard"))

    def fsdp_kwargs(model):
        kw = dict(auto_wrap_policy=ModuleWrapPolicy(wrap_classes(model)), use_orig_params=args.orig,
                  device_id=device, sharding_strategy=strategy)
        if args.param_dtype:
            kw["mixed_precision"] = MixedPrecision(param_dtype=dtypes[args.param_dtype])
        if mesh is not None:
            kw["device_mesh"] = mesh
        return kw

    full = cls.from_pretrained(args.src, dtype=live)
    expected = {n: p.detach().clone() for n, p in full.named_parameters()}
    expected_buffers = {n: b.detach().clone() for n, b in full.named_buffers()}

    ref_model = cls.from_pretrained(args.src, dtype=live)
    ref = FSDP(ref_model, **fsdp_kwargs(ref_model))
    ref_shards = {u: h.flat_param.data.detach().clone() for u, _, h in _fsdp1_units(ref)}

    model = reshard.empty_model(args.out, dtype=live)
    init = (lambda m: m.to_empty(device=device, recurse=False)) if args.plain_init else reshard.fsdp1_param_init_fn(device)
    loaded = FSDP(model, param_init_fn=init,
                  **fsdp_kwargs(model))
    result = {"rank": rank, "ok": True, "problems": []}

    def problem(msg):
        result["ok"] = False
        result["problems"].append(msg)

    try:
        report = reshard.load(loaded, args.out)
    except reshard.ReshardError as e:
        result["error"] = str(e)
        result["ok"] = bool(args.expect_error) and args.expect_error in str(e)
        with open(f"{args.result}.{rank}", "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return
    if args.expect_error:
        problem(f"expected an error containing {args.expect_error!r}, load succeeded")
    result["layout"] = report.layout
    result["source"] = report.source
    result["bytes"] = report.bytes
    result["units"] = []
    shards = {u: h for u, _, h in _fsdp1_units(loaded)}
    if set(shards) != set(ref_shards):
        problem(f"units {sorted(shards)} vs reference {sorted(ref_shards)}")
    for u, h in shards.items():
        got = h.flat_param.data
        want = ref_shards.get(u)
        result["units"].append({"unit": u, "numel": got.numel(), "dtype": str(got.dtype),
                                "padded": int(h.flat_param._shard_numel_padded)})
        if want is None or got.dtype != want.dtype or got.shape != want.shape:
            problem(f"unit {u}: {got.dtype} {tuple(got.shape)} vs reference "
                    f"{None if want is None else (want.dtype, tuple(want.shape))}")
            continue
        if not torch.equal(got.view(torch.uint8 if got.element_size() == 1 else
                                    {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]),
                           want.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()])):
            bad = (got != want).nonzero()
            problem(f"unit {u}: local flat shard differs from FSDP1's own at {bad[:5].flatten().tolist()}")
    with FSDP.summon_full_params(loaded, writeback=False):
        names = set()
        for n, p in loaded.named_parameters():
            n = _clean_name(n)
            names.add(n)
            want = expected.get(n)
            if want is None:
                problem(f"parameter {n} not in from_pretrained's model")
            elif p.shape != want.shape or p.dtype != want.dtype or not torch.equal(p.detach().cpu(), want):
                problem(f"parameter {n} differs from from_pretrained after summon_full_params")
        missing = set(expected) - names
        # Tied aliases are listed once by named_parameters().
        tied = {n for n in missing if any(expected[n] is expected[m] or torch.equal(expected[n], expected[m])
                                           for m in names if m in expected)}
        if missing - tied:
            problem(f"parameters missing after load: {sorted(missing - tied)}")
    for n, b in loaded.named_buffers():
        n = _clean_name(n)
        if n in expected_buffers and not torch.equal(b.cpu(), expected_buffers[n]):
            problem(f"buffer {n} differs")
    seq = min(9, getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 9))
    batch = torch.randint(3, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)
    ref.eval()
    loaded.eval()  # empty_model builds in training mode (from_config); from_pretrained in eval
    with torch.no_grad():
        a = ref(input_ids=batch).logits
        b = loaded(input_ids=batch).logits
    if not torch.equal(a, b):
        problem(f"logits differ from the reference FSDP1 model (max {float((a - b).abs().max())})")
    loaded.train()
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.steps):
        out = loaded(input_ids=batch, labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    result["losses"] = losses
    if args.steps and not losses[-1] < losses[0]:
        problem(f"loss did not fall: {losses}")
    with open(f"{args.result}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
