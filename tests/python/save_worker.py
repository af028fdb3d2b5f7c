"""One rank of a multi-process save test, run by torchrun (CPU/gloo).

Modes (--mode):
* roundtrip: empty_model(OUT) → FSDP2 → load → --steps AdamW steps on a fixed batch → save
  into --save (with the optimizer when --steps > 0) → a fresh model (and a fresh optimizer)
  loaded from --save → every full_tensor() equal bit for bit to the trained one, every
  optimizer state tensor too, and one more step of both gives the same loss.
* interrupted: like roundtrip with 0 steps, but writes its pid into --result and the save is
  slowed by RESHARD_TEST_SAVE_PAUSE so that the test can SIGKILL a rank mid-write.
Any failed check raises, so torchrun exits non-zero.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import reshard
from dist_util import worker_main


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def build(out, mesh, dtype):
    model = reshard.empty_model(out, dtype=dtype)
    for m in list(model.modules()):
        if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or []):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--mode", default="roundtrip")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--hsdp", type=int, default=0)
    ap.add_argument("--dump", default="", help="rank 0 writes the trained model's full state_dict "
                    "(parameters and persistent buffers) here, as safetensors")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.hsdp:
        mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build(args.out, mesh, dtype)
    reshard.load(model, args.out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    losses = [step(model, opt, ids) for _ in range(args.steps)]

    if args.dump:
        from safetensors.torch import save_file

        full = {}
        for name, v in model.state_dict().items():  # collective: every rank gathers
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            full[name] = v.detach().cpu().contiguous().clone()
        if rank == 0:
            save_file(full, args.dump)
        dist.barrier()

    if args.mode == "interrupted":
        with open(os.path.join(args.result, f"pid-{rank}"), "w") as f:
            f.write(str(os.getpid()))
    report = reshard.save(model, args.save, optimizer=opt if args.steps else None, step=args.steps,
                          source=args.out)

    # A fresh model (and optimizer) from the saved checkpoint.
    fresh = build(args.save, mesh, dtype)
    rep2 = reshard.load(fresh, args.save)
    assert rep2.layout == report.layout, (rep2.layout, report.layout)
    live = dict(model.named_parameters())
    n = 0
    for name, p in fresh.named_parameters():
        a, b = p.full_tensor(), live[name].full_tensor()
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), f"{name} differs after save/load"
        n += 1
    result = {"rank": rank, "params_checked": n, "losses": losses, "file": report.file,
              "wrote": report.wrote, "optimizer_file": report.optimizer_file}
    if args.steps:
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=123.0)
        restored = reshard.load_optimizer(opt2, fresh, args.save)
        assert restored == len(opt.state), (restored, len(opt.state))
        assert opt2.param_groups[0]["lr"] == 1e-2 and tuple(opt2.param_groups[0]["betas"]) == (0.8, 0.95)
        assert opt2.param_groups[0]["weight_decay"] == 0.1
        fresh_params = dict(fresh.named_parameters())
        for name, p in live.items():
            s1, s2 = opt.state[p], opt2.state[fresh_params[name]]
            assert sorted(s1) == sorted(s2), (name, sorted(s1), sorted(s2))
            for k in s1:
                a = s1[k].full_tensor() if hasattr(s1[k], "full_tensor") else s1[k]
                b = s2[k].full_tensor() if hasattr(s2[k], "full_tensor") else s2[k]
                assert type(s1[k]) is type(s2[k]) and a.device == b.device, (name, k)
                assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), f"state {name}[{k}] differs"
        # One more step of each: the same loss and the same parameters afterwards.
        l1, l2 = step(model, opt, ids), step(fresh, opt2, ids)
        assert l1 == l2, (l1, l2)
        for name, p in fresh.named_parameters():
            assert torch.equal(bits(p.full_tensor()), bits(live[name].full_tensor())), \
                f"{name} differs one step after the resume"
        result["next_loss"] = l1
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank}: OK saved {report.file} ({report.bytes} bytes), {n} parameters equal")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
