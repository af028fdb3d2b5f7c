"""One rank of an offline-reshard test (`reshard relayout`), run by torchrun (CPU/gloo).

--kind fsdp2 (fully_shard) or fsdp1 (FullyShardedDataParallel, --orig: use_orig_params).

Modes (--mode):
* save: build from --out (a conversion), load it, --steps AdamW steps on a fixed batch, then
  reshard.save(model, --save, optimizer, step). Rank 0 writes RESULT/ref.pt: every parameter's
  and every optimizer state tensor's full tensor, gathered by torch itself (full_tensor() of
  the DTensors; FSDP1: summon_full_params and FSDP.optim_state_dict, under use_orig_params the
  ranks' local state gathered), then --more steps of the
  uninterrupted run, whose losses go to RESULT/rank-0.json.
* resume: build from --save at this job's world size (a layout `reshard relayout` wrote),
  reshard.load + reshard.load_optimizer, gather the full tensors the same way and check them
  bit for bit against RESULT/ref.pt, then --more steps; losses to RESULT/rank-<r>.json.
* refused: reshard.load_optimizer must raise a ReshardError containing --expect.
Any failed check raises, so torchrun exits non-zero.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--mode", default="save")
    ap.add_argument("--kind", default="fsdp2")
    ap.add_argument("--orig", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--more", type=int, default=3)
    ap.add_argument("--expect", default="")
    args = ap.parse_args()

    import reshard
    from reshard.model import clean_name

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp1 = args.kind == "fsdp1"

    def build(directory):
        model = reshard.empty_model(directory, dtype=torch.float32)
        classes = {type(m) for m in model.modules()
                   if type(m).__name__ in set(getattr(model, "_no_split_modules", None) or [])}
        if fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(classes), use_orig_params=args.orig,
                        device_id=torch.device("cpu"), param_init_fn=reshard.fsdp1_param_init_fn("cpu"))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in list(model.modules()):
            if type(m) in classes:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        return model

    def full(model, opt):
        """name -> full tensor of every parameter, and "<name>#<key>" of every state tensor,
        gathered by torch (collective)."""
        out = {}
        if fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, writeback=False):
                for n, p in model.named_parameters():
                    out[clean_name(n)] = p.detach().cpu().clone()
            if args.orig:
                # Each rank's state of an original parameter is the parameter's elements in
                # its shard, in order: gathered and concatenated in rank order. (Not
                # FSDP.optim_state_dict: under use_orig_params, torch 2.11 returns exp_avg
                # aliasing exp_avg_sq's gathered buffer.)
                local = {}
                for n, p in model.named_parameters():
                    for k, v in opt.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            local[f"{clean_name(n)}#{k}"] = v.detach().cpu().clone()
                every = [None] * world
                dist.all_gather_object(every, local)
                names = sorted({k for d in every for k in d})
                for name in names:
                    parts = [d[name] for d in every if name in d]
                    if parts[0].dim() == 0:
                        out[name] = parts[0]
                    else:
                        full_shape = out[name.rsplit("#", 1)[0]].shape
                        out[name] = torch.cat([t.reshape(-1) for t in parts]).reshape(full_shape)
                return out
            osd = FSDP.optim_state_dict(model, opt)
            for n, st in osd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        out[f"{n}#{k}"] = v.detach().cpu().clone()
            return out
        for n, p in model.named_parameters():
            out[n] = p.full_tensor().detach().cpu().clone()
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    v = v.full_tensor() if hasattr(v, "full_tensor") else v
                    out[f"{names[id(p)]}#{k}"] = v.detach().cpu().clone()
        return out

    with open(os.path.join(args.out, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    # One global batch of 12 sequences, the same at every world size, each rank taking its
    # 12 / world rows: the gradient is the same mean at every world size, summed in another
    # order (per-rank means, then the reduce-scatter over the ranks).
    batch = torch.randint(0, vocab, (12, 16), generator=torch.Generator().manual_seed(1234))
    assert 12 % world == 0, world
    ids = batch[rank * 12 // world:(rank + 1) * 12 // world]

    def step(m, o):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world

    torch.manual_seed(0)
    result = {"rank": rank}
    if args.mode == "save":
        model = build(args.out)
        reshard.load(model, args.out)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        result["losses"] = [step(model, opt) for _ in range(args.steps)]
        reshard.save(model, args.save, optimizer=opt, step=args.steps, source=args.out)
        ref = full(model, opt)
        if rank == 0:
            torch.save(ref, os.path.join(args.result, "ref.pt"))
        result["more"] = [step(model, opt) for _ in range(args.more)]
    else:
        model = build(args.save)
        rep = reshard.load(model, args.save)
        opt = torch.optim.AdamW(model.parameters(), lr=123.0)
        if args.mode == "refused":
            try:
                reshard.load_optimizer(opt, model, args.save)
            except reshard.ReshardError as e:
                assert args.expect in str(e), f"expected {args.expect!r} in: {e}"
                result["error"] = str(e)
            else:
                raise AssertionError("load_optimizer accepted a missing layout")
        else:
            assert "resharded while reading" not in rep.source, rep.source  # the relayout's own files
            restored = reshard.load_optimizer(opt, model, args.save)
            assert opt.param_groups[0]["lr"] == 1e-2 and tuple(opt.param_groups[0]["betas"]) == (0.8, 0.95)
            got = full(model, opt)
            want = torch.load(os.path.join(args.result, "ref.pt"))
            assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
            for n in want:
                assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
                assert torch.equal(bits(got[n]), bits(want[n])), f"{n} differs after relayout + resume"
            result.update(restored=restored, checked=len(want), layout=rep.layout,
                          more=[step(model, opt) for _ in range(args.more)])
    with open(os.path.join(args.result, f"{args.mode}-{world}-rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    worker_main(main)
