"""One rank of an FSDP1 (FullyShardedDataParallel) save test, run by torchrun (CPU/gloo, or
CUDA/NCCL with --device cuda).

Builds the FSDP1 job empty (reshard.empty_model(OUT), reshard.fsdp1_param_init_fn), loads OUT,
runs --steps AdamW steps on a fixed batch, then reshard.save(model, --save, optimizer, step).

Modes (--mode):
* roundtrip: after the save, a fresh FSDP1 model (and a fresh optimizer) built from --save and
  loaded from it must equal the trained one: every unit's local flat shard bit for bit (padding
  included), every parameter under summon_full_params, every optimizer state tensor; one more
  step of both gives the same loss and the same shards. Rank 0 writes the trained model's full
  parameters (summon_full_params) to RESULT/full.safetensors for the export comparison.
* interrupted: 0 steps; writes its pid into RESULT and the save is slowed by
  RESHARD_TEST_SAVE_PAUSE so that the test can SIGKILL a rank mid-write.
* expect-error: the save must raise a ReshardError containing --expect-error.
* optim-refused: no save; reshard.load_optimizer(opt, model, --save) must raise a ReshardError
  containing --expect-error (--save holds the optimizer state of another layout).
Any failed check raises, so torchrun exits non-zero. Every rank writes RESULT/rank-<r>.json.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from dist_util import worker_main


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--mode", default="roundtrip")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--live-dtype", default="fp32")
    ap.add_argument("--orig", action="store_true")
    ap.add_argument("--param-dtype", default="")
    ap.add_argument("--strategy", default="FULL_SHARD")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--expect-error", default="")
    ap.add_argument("--no-source", action="store_true", help="reshard.save(..., source=None)")
    ap.add_argument("--no-load", action="store_true", help="do not load OUT (refusal tests)")
    args = ap.parse_args()

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import reshard
    from reshard.load_fsdp1 import fsdp1_units as _fsdp1_units
    from reshard.model import clean_name as _clean_name

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    live = DTYPES[args.live_dtype]
    mesh = None
    if args.strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas),
                                mesh_dim_names=("replicate", "shard"))

    def build(directory):
        model = reshard.empty_model(directory, dtype=live)
        classes = {type(m) for m in model.modules()
                   if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or [])}
        kw = dict(auto_wrap_policy=ModuleWrapPolicy(classes), use_orig_params=args.orig,
                  device_id=device, sharding_strategy=getattr(ShardingStrategy, args.strategy),
                  param_init_fn=reshard.fsdp1_param_init_fn(device))
        if args.param_dtype:
            kw["mixed_precision"] = MixedPrecision(param_dtype=DTYPES[args.param_dtype])
        if mesh is not None:
            kw["device_mesh"] = mesh
        return FSDP(model, **kw)

    def shards(model):
        out = {}
        for u, _, h in _fsdp1_units(model):
            fp = h.flat_param
            t = getattr(fp, "_local_shard", None)
            out[u] = (t if t is not None and t.numel() == fp.numel() else fp.data).detach().clone()
        return out

    torch.manual_seed(0)
    model = build(args.out)
    if not args.no_load:
        reshard.load(model, args.out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1234)).to(device)

    def step(m, o):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(model, opt) for _ in range(args.steps)]
    result = {"rank": rank, "losses": losses}
    if args.mode == "optim-refused":  # --save holds optimizer state of another job's layout
        try:
            reshard.load_optimizer(opt, model, args.save)
        except reshard.ReshardError as e:
            assert args.expect_error in str(e), f"expected {args.expect_error!r} in: {e}"
            result["error"] = str(e)
        else:
            raise AssertionError("load_optimizer accepted another layout's optimizer state")
        with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return 0
    if args.mode == "interrupted":
        with open(os.path.join(args.result, f"pid-{rank}"), "w") as f:
            f.write(str(os.getpid()))
    try:
        report = reshard.save(model, args.save, optimizer=opt if args.steps else None,
                              step=args.steps, source=None if args.no_source else args.out)
    except reshard.ReshardError as e:
        if args.mode != "expect-error":
            raise
        assert args.expect_error in str(e), f"expected {args.expect_error!r} in: {e}"
        result["error"] = str(e)
        with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return 0
    assert args.mode != "expect-error", "the save succeeded"
    result.update({"file": report.file, "wrote": report.wrote, "layout": report.layout,
                   "optimizer_file": report.optimizer_file, "coord": report.rank})

    # A fresh model (and optimizer) from the saved checkpoint.
    fresh = build(args.save)
    rep2 = reshard.load(fresh, args.save)
    assert rep2.layout == report.layout, (rep2.layout, report.layout)
    a, b = shards(model), shards(fresh)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for u in a:
        assert a[u].dtype == b[u].dtype and torch.equal(bits(a[u]), bits(b[u])), \
            f"unit {u or '(root)'}: local flat shard differs after save/load"
    result["units"] = len(a)
    with FSDP.summon_full_params(model, writeback=False), FSDP.summon_full_params(fresh, writeback=False):
        got = {_clean_name(n): p.detach().cpu().clone() for n, p in fresh.named_parameters()}
        want = {_clean_name(n): p.detach().cpu().clone() for n, p in model.named_parameters()}
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for n in want:
        assert torch.equal(bits(got[n]), bits(want[n])), f"{n} differs after save/load (full)"
    if rank == 0:
        from safetensors.torch import save_file

        save_file(want, os.path.join(args.result, "full.safetensors"))
    result["params_checked"] = len(want)

    if args.steps:
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=123.0)
        restored = reshard.load_optimizer(opt2, fresh, args.save)
        assert restored == len(opt.state), (restored, len(opt.state))
        assert opt2.param_groups[0]["lr"] == 1e-2 and tuple(opt2.param_groups[0]["betas"]) == (0.8, 0.95)
        live_params = dict(model.named_parameters())
        fresh_params = dict(fresh.named_parameters())
        n_state = 0
        for name, p in live_params.items():
            s1, s2 = opt.state.get(p, {}), opt2.state.get(fresh_params[name], {})
            assert sorted(s1) == sorted(s2), (name, sorted(s1), sorted(s2))
            for k in s1:
                x, y = s1[k], s2[k]
                assert type(x) is type(y) and x.device == y.device and x.shape == y.shape, (name, k)
                assert x.dtype == y.dtype and torch.equal(bits(x), bits(y)), f"state {name}[{k}] differs"
                n_state += 1
        result["state_tensors"] = n_state
        l1, l2 = step(model, opt), step(fresh, opt2)
        assert l1 == l2, (l1, l2)
        a, b = shards(model), shards(fresh)
        for u in a:
            assert torch.equal(bits(a[u]), bits(b[u])), f"unit {u or '(root)'} differs one step after the resume"
        result["next_loss"] = l1
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank}: OK saved {report.file} ({report.bytes} bytes)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    worker_main(main)
