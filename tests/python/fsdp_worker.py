"""One rank of a multi-process load test, run by torchrun (CPU/gloo or CUDA/NCCL).

Builds the model empty from OUT, applies FSDP2 (fully_shard on each decoder layer, then the
root), loads the rank's shard with reshard.load, and checks it against from_pretrained:
every parameter's full_tensor() bit for bit, buffers, logits on a fixed batch, tied weights,
and that 20 AdamW steps on a fixed batch lower the loss. Any failed check raises, so torchrun
exits non-zero. Writes rank-<g>.json with the load report into --result.
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
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--hsdp", type=int, default=0, help="replicate degree (2-D mesh)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-drop", type=float, default=0.05, help="the loss must fall by more than this")
    ap.add_argument("--expect-error", default="", help="substring of an expected ReshardError")
    ap.add_argument("--out-override-ws", type=int, default=0)
    args = ap.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if args.hsdp:
        mesh = init_device_mesh(args.device, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(args.device, (world,))

    torch.manual_seed(0)
    model = reshard.empty_model(args.out)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if type(m).__name__ in no_split:
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)

    if args.expect_error:
        try:
            reshard.load(model, args.out)
        except reshard.ReshardError as e:
            assert args.expect_error in str(e), f"unexpected message: {e}"
            print(f"rank {rank}: refused as expected: {e}")
            dist.destroy_process_group()
            return
        raise AssertionError("reshard.load succeeded but should have failed")

    report = reshard.load(model, args.out)

    from transformers import AutoModelForCausalLM

    dtype = next(model.parameters()).dtype
    ref = AutoModelForCausalLM.from_pretrained(args.src, dtype=dtype).to(device)
    ref_params = dict(ref.named_parameters())
    n_checked = 0
    for name, p in model.named_parameters():
        full = p.full_tensor()
        want = ref_params[name]
        assert full.dtype == want.dtype and full.shape == want.shape, name
        assert torch.equal(bits(full), bits(want)), f"parameter {name} differs from from_pretrained"
        n_checked += 1
    assert n_checked == len(ref_params), (n_checked, len(ref_params))
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert b.dtype == ref_buffers[name].dtype, (name, b.dtype, ref_buffers[name].dtype)
        assert torch.equal(bits(b), bits(ref_buffers[name])), f"buffer {name} differs"
    if getattr(model.config, "tie_word_embeddings", False):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "tie lost"

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(device)
    with torch.no_grad():
        logits = model(ids).logits
        ref_logits = ref(ids).logits
    assert torch.equal(bits(logits), bits(ref_logits)), \
        f"logits differ: max abs {(logits.float() - ref_logits.float()).abs().max().item()}"

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if args.steps:
        assert losses[-1] < losses[0] - args.min_drop, f"loss did not fall: {losses}"

    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "file": report.file, "bytes": report.bytes,
                   "source": report.source, "layout": report.layout,
                   "params_checked": n_checked, "losses": losses,
                   "buffers_restored": report.buffers_restored}, f)
    trained = f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
    print(f"rank {rank}: OK {report.file} {report.bytes} bytes{trained}")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
