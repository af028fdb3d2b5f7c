"""One rank of an asynchronous-save test, run by torchrun (CPU/gloo).

A small MLP (uneven shapes, a persistent buffer) under FSDP2, AdamW, a fixed batch per step
(seeded by the step), so that every run of the same steps computes the same values.

Modes (--mode):
* train: steps --first..--steps, after each one reshard.save(..., blocking=False) into
  --save-dir/step-<8 digits> (unless --no-save); with --dump, right after each save call
  returns (while its files are being written) rank 0 writes the full model state
  (parameters, the buffer) and optimizer state at that step to --dump/step-<s>.safetensors,
  and the training then changes every parameter at once. With --resume, it starts from the
  newest committed checkpoint of --save-dir (reshard.load, reshard.load_optimizer). Each
  step's loss is appended to --result/losses-<rank>.jsonl; with --expect (a losses file of
  an uninterrupted run) every loss must equal the expected one, else it writes
  --result/FAIL-<rank> and exits 1. Writes --result/pid-<rank> once it is ready to train.
* resume_all: for every committed checkpoint of --save-dir, a fresh model and optimizer
  loaded from it, trained to --steps: the losses must be --expect's.
* diskfull: rank 1's files are limited to --fsize bytes (RLIMIT_FSIZE, SIGXFSZ ignored: the
  writes fail with EFBIG, as on a full disk) while asynchronous saves run in the background:
  the error reaches wait() on every rank, and the next save when nothing waited for it.
"""

import argparse
import json
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import reshard
from dist_util import worker_main


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(7, 13)
        self.down = nn.Linear(13, 5, bias=False)
        self.head = nn.Linear(5, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.tanh(self.up(x))))) * self.scale


def build(mesh):
    torch.manual_seed(0)
    model = MLP()
    for m in (model.up, model.down):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)


def train_step(model, opt, step):
    x, y = batch(step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item()


def full_state(model, opt):
    """name -> full tensor: parameters, the buffer, optimizer state as "<param>#<key>"."""
    out = {}
    for name, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[name] = v.detach().cpu().contiguous().clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{names[id(p)]}#{k}"] = v.detach().cpu().contiguous().clone()
    return out


def committed(save_dir):
    steps = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        if name.startswith("step-") and os.path.exists(os.path.join(save_dir, name, "reshard.json")):
            steps.append(int(name[5:]))
    return sorted(steps)


def load_into(model, opt, ckpt):
    reshard.load(model, ckpt)
    reshard.load_optimizer(opt, model, ckpt)
    with open(os.path.join(ckpt, "reshard.json")) as f:
        return int(json.load(f)["source"]["saved"]["step"])


def new_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)


def expected_losses(path):
    if not path:
        return None
    with open(path) as f:
        return {int(k): v for k, v in json.load(f).items()}


def fail(args, rank, msg):
    with open(os.path.join(args.result, f"FAIL-{rank}"), "w") as f:
        f.write(msg)
    print(f"rank {rank}: FAIL {msg}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(1)


def run_train(args, rank, mesh):
    model = build(mesh)
    opt = new_opt(model)
    first = 1
    if args.resume:
        steps = committed(args.save_dir)
        if steps:
            first = load_into(model, opt, os.path.join(args.save_dir, f"step-{steps[-1]:08d}")) + 1
    expect = expected_losses(args.expect)
    with open(os.path.join(args.result, f"start-{rank}"), "w") as f:
        f.write(str(first))
    with open(os.path.join(args.result, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    log = open(os.path.join(args.result, f"losses-{rank}.jsonl"), "a")
    pending_seen = 0
    for s in range(first, args.steps + 1):
        loss = train_step(model, opt, s)
        log.write(json.dumps({"step": s, "loss": loss}) + "\n")
        log.flush()
        if expect is not None and expect.get(s) != loss:
            fail(args, rank, f"step {s}: loss {loss!r}, the uninterrupted run's {expect.get(s)!r}")
        if not args.no_save:
            h = reshard.save(model, os.path.join(args.save_dir, f"step-{s:08d}"), optimizer=opt, step=s,
                             blocking=False)
            pending_seen += not h.done()
        if args.dump:
            state = full_state(model, opt)  # collective
            if rank == 0:
                from safetensors.torch import save_file

                save_file(state, os.path.join(args.dump, f"step-{s}.safetensors"))
    report = reshard.wait_pending()
    result = {"rank": rank, "first": first, "pending_after_return": pending_seen,
              "last_stall": report.stall_seconds if report else None,
              "last_durable": report.durable_seconds if report else None,
              "last_snapshot": report.snapshot if report else None}
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)


def run_resume_all(args, rank, mesh):
    expect = expected_losses(args.expect)
    checked = []
    for s in committed(args.save_dir):
        model = build(mesh)
        opt = new_opt(model)
        first = load_into(model, opt, os.path.join(args.save_dir, f"step-{s:08d}")) + 1
        assert first == s + 1, (first, s)
        for t in range(first, args.steps + 1):
            loss = train_step(model, opt, t)
            assert loss == expect[t], f"resumed from step {s}: step {t} loss {loss!r}, uninterrupted {expect[t]!r}"
        checked.append(s)
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "resumed_from": checked}, f)


def run_diskfull(args, rank, mesh):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    model = build(mesh)
    opt = new_opt(model)
    train_step(model, opt, 1)
    d = args.save_dir
    outcome = {}

    def limit(on):
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize if on else soft, hard))

    # a. The error reaches wait(), on every rank; nothing is committed.
    limit(True)
    h = reshard.save(model, os.path.join(d, "a"), optimizer=opt, step=1, blocking=False)
    try:
        h.wait()
        outcome["a"] = "no error"
    except reshard.ReshardError as e:
        outcome["a"] = f"{type(e).__name__}: {e}"
    # b. Nothing waits for it: the next save raises it.
    h = reshard.save(model, os.path.join(d, "b"), optimizer=opt, step=1, blocking=False)
    while not h.done():
        time.sleep(0.01)
    limit(False)
    try:
        reshard.save(model, os.path.join(d, "c"), optimizer=opt, step=1)
        outcome["b"] = "no error"
    except reshard.ReshardError as e:
        outcome["b"] = f"{type(e).__name__}: {e}"
    # c. After that the saves work again, and a reported error is not raised twice.
    train_step(model, opt, 2)
    h = reshard.save(model, os.path.join(d, "c"), optimizer=opt, step=2, blocking=False)
    outcome["c_stall"] = h.stall_seconds
    outcome["c"] = h.wait().file
    state = full_state(model, opt)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(state, os.path.join(args.result, "c.safetensors"))
    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump(outcome, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="train")
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dump", default="")
    ap.add_argument("--expect", default="")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--fsize", type=int, default=4096)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    {"train": run_train, "resume_all": run_resume_all, "diskfull": run_diskfull}[args.mode](args, rank, mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
