"""One rank of a PEFT (LoRA) load test under FSDP2, run by torchrun (CPU/gloo).

Builds the PEFT model empty with reshard.empty_model(OUT, peft_config=...) under a fixed seed,
applies fully_shard (each decoder layer, then the root), to_empty, reshard.load (adapters
initialised, or from --adapter DIR), and checks it against an independent reference built by
PEFT itself on an unsharded model: get_peft_model(from_pretrained(SRC), config) under the same
seed, or PeftModel.from_pretrained(from_pretrained(SRC), DIR). Every parameter's full_tensor()
and every buffer bit for bit, the tie, logits bit for bit; then 10 AdamW steps over the
trainable parameters lower the loss and change only the adapters. Any failed check raises."""

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


def full(p):
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--adapter", default=None, help="a PEFT adapter directory to load")
    ap.add_argument("--init", default="gaussian", help="init_lora_weights: true or gaussian")
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--lora-rank", "--r", dest="r", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ref-adapter", default=None,
                    help="the reference's adapter directory (default: --adapter)")
    ap.add_argument("--save", default=None, help="reshard.save the adapters and optimizer here after "
                                                  "--steps, then train --more steps")
    ap.add_argument("--more", type=int, default=3)
    ap.add_argument("--dump", default=None, help="rank 0 writes the trained adapters (full, live names) here")
    ap.add_argument("--resume", action="store_true", help="reshard.load_optimizer from --adapter "
                                                          "(a reshard.save), train --more steps")
    ap.add_argument("--alpha", type=int, default=8, help="lora_alpha")
    ap.add_argument("--save-base", action="store_true", help="--save with base=True")
    ap.add_argument("--no-base-record", action="store_true",
                    help="forget where the base came from before --save (a save that records no base)")
    ap.add_argument("--dump-all", default=None,
                    help="rank 0 writes every trained parameter (full, live names) here at --save")
    ap.add_argument("--expect", default=None,
                    help="after the load (from --out alone), every parameter must equal this "
                         "--dump-all file bit for bit; then stop")
    args = ap.parse_args()

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def config():
        init = True if args.init == "true" else args.init
        return LoraConfig(r=args.r, lora_alpha=args.alpha, target_modules=args.targets.split(","),
                          init_lora_weights=init)

    torch.manual_seed(args.seed)
    model = reshard.empty_model(args.out, peft_config=config())
    no_split = set(getattr(model.get_base_model(), "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if type(m).__name__ in no_split:
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    report = reshard.load(model, args.out, adapter=args.adapter)
    if args.expect:  # a save holding the base: base and adapters from OUT alone
        assert report.adapters["source"] == str(args.out), report.adapters
    elif args.adapter:
        assert report.adapters["source"] == str(args.adapter), report.adapters
    else:
        assert report.adapters["source"].startswith("initialised as PEFT"), report.adapters
    assert report.adapters["tensors"] > 0, report.adapters

    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_pretrained(args.src, dtype="auto")
    if args.adapter or args.ref_adapter:
        ref = PeftModel.from_pretrained(base, args.ref_adapter or args.adapter, is_trainable=True)
    else:
        ref = get_peft_model(base, config())
    ref_params = dict(ref.named_parameters())
    live = dict(model.named_parameters())
    assert set(live) == set(ref_params), sorted(set(live) ^ set(ref_params))[:6]
    for name, p in live.items():
        f, want = full(p), ref_params[name]
        assert f.dtype == want.dtype and f.shape == want.shape, (name, f.dtype, want.dtype)
        assert torch.equal(bits(f), bits(want)), f"parameter {name} differs from PEFT's"
        assert p.requires_grad == want.requires_grad, (name, p.requires_grad)
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert b.dtype == ref_buffers[name].dtype, name
        assert torch.equal(bits(b), bits(ref_buffers[name])), f"buffer {name} differs"
    assert set(dict(model.named_buffers())) == set(ref_buffers)
    inner = model.get_base_model()
    if getattr(inner.config, "tie_word_embeddings", False):
        assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight, "tie lost"
    adapters = [n for n in live if "lora_" in n]
    assert adapters and all(live[n].requires_grad for n in adapters)

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, inner.config.vocab_size, (2, 16), generator=g)
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    model.reshard()  # a forward without backward leaves the root unsharded (FSDP2)
    assert torch.equal(bits(logits), bits(ref_logits)), \
        f"logits differ: max abs {(logits.float() - ref_logits.float()).abs().max().item()}"

    if args.expect:
        from safetensors.torch import load_file

        expected = load_file(args.expect)
        assert set(expected) == set(live), sorted(set(expected) ^ set(live))[:6]
        for name, p in live.items():
            f = full(p)
            assert f.dtype == expected[name].dtype, (name, f.dtype, expected[name].dtype)
            assert torch.equal(bits(f), bits(expected[name])), f"parameter {name} differs from the trained model's"
        with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "adapters": report.adapters}, f)
        print(f"rank {rank}: loaded from {args.out} alone, every parameter as trained")
        dist.destroy_process_group()
        return

    before = {n: full(p).clone() for n, p in live.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)

    def train(n):
        got = []
        for _ in range(n):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            got.append(loss.item())
        return got

    if args.resume:
        restored = reshard.load_optimizer(opt, model, args.adapter)
        assert restored == len(adapters), (restored, len(adapters))
        losses = train(args.more)
        with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "adapters": report.adapters, "losses": losses}, f)
        print(f"rank {rank}: resumed, losses {losses}")
        dist.destroy_process_group()
        return
    losses = train(args.steps)
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    after = {n: full(p).clone() for n, p in live.items()}
    more = []
    if args.save:
        if args.dump and rank == 0:
            from safetensors.torch import save_file

            save_file({n: after[n].contiguous() for n in adapters}, args.dump)
        if args.dump_all and rank == 0:
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in after.items()}, args.dump_all)
        if args.no_base_record:
            del model._reshard_base
        saved = reshard.save(model, args.save, optimizer=opt, step=args.steps, base=args.save_base)
        assert saved.wrote and saved.bytes > 0, saved
        more = train(args.more)
    changed = sorted(n for n in live if not torch.equal(bits(before[n]), bits(after[n])))
    assert changed, "training changed nothing"
    assert all(n in adapters for n in changed), f"base parameters changed: {[n for n in changed if n not in adapters]}"

    with open(os.path.join(args.result, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "adapters": report.adapters, "losses": losses, "more": more,
                   "changed": len(changed), "adapter_params": len(adapters)}, f)
    print(f"rank {rank}: OK, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
