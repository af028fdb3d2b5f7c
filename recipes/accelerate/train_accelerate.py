"""accelerate + FSDP (FSDP2 or FSDP1) + reshard: the model is built empty (no rank ever reads the whole
checkpoint), accelerate shards it, and every rank then reads only its own rank file.

    accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes N \
        recipes/accelerate/train_accelerate.py OUT [--steps 30] [--check-weights SRC] ...

OUT is what ``reshard convert SRC -o OUT --world-size N`` wrote. In every rank:

1. ``reshard.empty_model(OUT)``: parameters on the meta device, buffers real;
2. ``accelerator.prepare(model, optimizer)``: accelerate upcasts the trainable parameters to
   fp32 (mixed precision bf16) and applies ``fully_shard`` (decoder layers, embedding, the
   final norm + head, the root); the parameters stay on the meta device;
3. ``model.to_empty(device=accelerator.device)`` and ``reshard.load(model, OUT)``: the bf16
   file lands in the fp32 shards, converted exactly as ``Tensor.to()`` would;
4. a short AdamW run with ``accelerator.accumulate`` / ``backward`` / ``clip_grad_norm_`` on
   the corpus shipped with reshard (or ``--data``), tokenized as in ``python -m reshard.train``.

Two things accelerate 1.15 does not do for a meta-device model, handled here:

* the optimizer: ``prepare`` re-points the optimizer at the sharded parameters through a map
  keyed by ``data_ptr()``, which is 0 for every meta tensor, so every entry would end up on the
  same parameter; the optimizer's parameters are set again from the model, by name;
* CPU: accelerate enables FSDP only on accelerator devices (on CPU it sets up MULTI_CPU/gloo
  and ignores the FSDP plugin); FSDP2 itself runs on CPU with gloo, so without a GPU the recipe
  switches accelerate's state to FSDP2 itself. On GPUs nothing is patched.

LoRA (``--lora R [--lora-targets q_proj,v_proj]``, FSDP2): the model is built with
``reshard.empty_model(OUT, peft_config=LoraConfig(...))`` (PEFT wraps it on the meta device and
reshard keeps PEFT's initial adapter values), the optimizer holds the adapters only, and
``reshard.load`` fills the frozen base from the rank files and the adapters with those values.
``--save DIR`` saves the adapters after training (``reshard.save``; ``--save-base``: the base
too); ``reshard export DIR -o MERGED --merge`` writes the merged model.

FSDP1 (``recipes/accelerate/fsdp1.yaml``, ``fsdp_version: 1``): OUT needs an fsdp1 layout
matching the plugin (``reshard convert SRC -o OUT --world-size N --layout fsdp1 --dtype fp32``,
which captures the model manifest itself with ``python -m reshard.model_manifest``: accelerate keeps fp32
FlatParameters under bf16 mixed precision). The recipe sets the plugin's ``param_init_fn`` to
``reshard.fsdp1_param_init_fn`` (allocates each unit's parameters, keeps tied weights tied;
accelerate's own needs ``sync_module_states``, a broadcast from rank 0), prepares the model,
then builds and prepares the optimizer over the FlatParameters, and loads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import reshard
from reshard.examples.train import (DEFAULT_CORPUS, Batches, check_weights, current_rss_bytes, load_documents,
                           local_param_bytes, make_encoder, peak_rss_bytes, reference_class,
                           token_stream)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", help="reshard output directory (reshard convert ... --world-size N)")
    ap.add_argument("--data", default=None, help=".txt or .jsonl (field \"text\"); default: the shipped corpus")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--check-weights", metavar="SRC", default=None,
                    help="after the load, every parameter must equal from_pretrained(SRC) converted "
                         "to the live dtype (fp32 under mixed precision), bit for bit")
    ap.add_argument("--json-out", default=None, help="directory for rank-<r>.json")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R only (FSDP2)")
    ap.add_argument("--lora-targets", default=None, help="modules LoRA wraps (default: PEFT's for the model)")
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="after training, reshard.save the model into DIR (with --lora: the adapters; "
                         "`reshard export DIR -o MERGED --merge` then writes the merged model)")
    ap.add_argument("--save-base", action="store_true", help="with --lora --save: the base weights too")
    return ap.parse_args(argv)


def enable_fsdp2_on_cpu(accelerator, plugin) -> None:
    """accelerate 1.15 (state.py) turns FSDP on only for GPU-like devices; on CPU the state is
    MULTI_CPU with a gloo process group and the plugin is dropped. Switch it to FSDP2."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise SystemExit(f"accelerate set up {state.distributed_type}, not a process group on CPU: start "
                         "this script with `accelerate launch --config_file recipes/accelerate/fsdp2.yaml`")
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if plugin.fsdp_version == 1:
        # FSDP1 requires device_id (accelerate passes its device, "cpu:<local rank>" in this
        # state) to equal the compute device, plain "cpu" on CPU.
        PartialState._shared_state["device"] = torch.device("cpu")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    accelerator.print(f"note: accelerate enables FSDP only on GPUs; FSDP{plugin.fsdp_version} switched "
                      "on for CPU (gloo)")


def repoint_optimizer(optimizer, model, names_per_group) -> None:
    """Sets the optimizer's parameters to the model's (sharded) trainable parameters, by name."""
    params = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, names_per_group):
        group["params"] = [params[n] for n in names]
    seen = [id(p) for g in optimizer.param_groups for p in g["params"]]
    if len(set(seen)) != len(seen) or set(seen) != {id(p) for p in model.parameters() if p.requires_grad}:
        raise RuntimeError("optimizer parameters do not match the model's after prepare")


def main(argv=None) -> int:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    args = parse_args(argv)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        raise SystemExit("start this script with `accelerate launch --config_file "
                         "recipes/accelerate/fsdp2.yaml --num_processes N ...` (without --cpu: that "
                         "starts one process without FSDP; the script picks CPU itself when there is no GPU)")
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment
    if plugin.cpu_ram_efficient_loading or plugin.sync_module_states:
        raise SystemExit("set fsdp_cpu_ram_efficient_loading: false and fsdp_sync_module_states: false: "
                         "reshard.load does the loading (no broadcast from rank 0)")
    cpu = not torch.cuda.is_available()
    fsdp1 = plugin.fsdp_version == 1
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=plugin, gradient_accumulation_steps=args.grad_accum)
    if cpu:
        enable_fsdp2_on_cpu(accelerator, plugin)
    if fsdp1:  # used by prepare(); FSDP1 checks it allocates on FSDP's device_id, accelerator.device
        accelerator.state.fsdp_plugin.param_init_fn = reshard.fsdp1_param_init_fn(accelerator.device)
    assert accelerator.is_fsdp2 != fsdp1, accelerator.distributed_type
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(args.seed)

    # 1. Empty model (meta parameters) and its optimizer.
    if args.lora and fsdp1:
        raise SystemExit("--lora runs under FSDP2 (recipes/accelerate/fsdp2.yaml)")
    if args.lora and args.check_weights:
        raise SystemExit("--check-weights compares with from_pretrained; not with --lora")
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora,
                                 target_modules=args.lora_targets.split(",") if args.lora_targets else None)
    model = reshard.empty_model(args.out, peft_config=peft_config)
    cls = reference_class(model.get_base_model() if args.lora else model)
    file_dtype = next(model.parameters()).dtype
    if fsdp1:
        # 2'. FSDP1: prepare the model (units materialised by param_init_fn, fp32 upcast under
        # mixed precision), then the optimizer over its FlatParameters.
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=args.lr))
        still_meta = False
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        name_of = {id(p): n for n, p in model.named_parameters()}
        names_per_group = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]

        # 2. accelerate shards it (fp32 upcast under mixed precision); still on meta.
        model, optimizer = accelerator.prepare(model, optimizer)
        still_meta = all(p.device.type == "meta" for p in model.parameters())
    live_dtype = next(model.parameters()).dtype
    accelerator.print(f"prepared: {type(model).__name__}, parameters {live_dtype} on "
                      f"{'meta' if still_meta else next(model.parameters()).device}, mixed precision "
                      f"{accelerator.mixed_precision}, {world} process(es)")

    # 3. Materialize the shards and read this rank's file into them.
    if not fsdp1:
        model.to_empty(device=accelerator.device)
        repoint_optimizer(optimizer, model, names_per_group)
    rss_before = current_rss_bytes()
    report = reshard.load(model, args.out)
    peak_after = peak_rss_bytes()
    accelerator.print(f"load: rank 0 loaded {reshard.format_bytes(report.bytes)} from {report.source} in "
                      f"{report.seconds:.3f} s ({reshard.format_rate(report.gbps * 1e9)}), "
                      f"{report.converted_tensors} tensor(s) converted to {live_dtype}")
    result = {"rank": rank, "world_size": world, "param_dtype": str(live_dtype), "file_dtype": str(file_dtype),
              "fsdp_version": plugin.fsdp_version, "layout": report.layout,
              "mixed_precision": accelerator.mixed_precision, "prepared_on_meta": still_meta,
              "local_param_bytes": local_param_bytes(model),
              "optimizer_params": len({id(p) for g in optimizer.param_groups for p in g["params"]}),
              "adapters": report.adapters,
              "load": {"file": report.file, "bytes": report.bytes, "seconds": report.seconds,
                       "gbps": report.gbps, "converted_tensors": report.converted_tensors,
                       "buffers_restored": report.buffers_restored},
              "rss": {"before_load": rss_before, "peak_after_load": peak_after}}
    if args.check_weights:
        result["params_checked"] = check_weights(model, args.check_weights, cls, accelerator.print)

    # 4. Train.
    docs = load_documents(args.data)
    encode, eos_id, tok_desc = make_encoder(args.out, model.config.vocab_size)
    stream = token_stream(docs, encode, eos_id, model.config.vocab_size)
    batches = Batches(stream, args.batch_size, args.seq_len, args.seed, rank)
    accelerator.print(f"data: {args.data or DEFAULT_CORPUS}: {stream.numel()} tokens; tokenizer: {tok_desc}")
    losses, tokens_per_step = [], args.batch_size * args.seq_len * args.grad_accum * world
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=accelerator.device)
        for _ in range(args.grad_accum):
            with accelerator.accumulate(model):
                ids = batches.next().to(accelerator.device)
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                loss_sum += loss.detach().float()
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
        dist.all_reduce(loss_sum)
        step_loss = loss_sum.item() / (args.grad_accum * world)
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"step {step + 1}: loss is {step_loss}")
        losses.append(step_loss)
        dt = time.perf_counter() - t0
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            accelerator.print(f"step {step + 1}/{args.steps} loss {step_loss:.4f} "
                              f"tokens/s {tokens_per_step / dt:.0f} ({dt:.2f} s)")
    result["losses"] = losses
    result["rss"]["peak_final"] = peak_rss_bytes()
    if accelerator.device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(accelerator.device)
    print(f"rank {rank}/{world}: loaded {report.bytes / 1e6:.2f} MB from {os.path.relpath(report.file, args.out)} "
          f"in {report.seconds:.3f} s ({report.gbps:.2f} GB/s); peak RSS {peak_after / 2**20:.0f} MiB after "
          f"load, {result['rss']['peak_final'] / 2**20:.0f} MiB at the end"
          + (f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""), flush=True)
    if args.save:
        saved = reshard.save(model, args.save, step=args.steps, base=args.save_base)
        accelerator.print(f"save: {args.save} ({saved.layout}, rank 0 wrote {saved.bytes} bytes)")
        result["saved"] = args.save
    if args.json_out:
        os.makedirs(args.json_out, exist_ok=True)
        with open(os.path.join(args.json_out, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # Tear the process group down before interpreter exit: left to the destructors, gloo can
    # abort at shutdown ("terminate called without an active exception").
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: on CPU/gloo one run in a few aborted in a C++
    # destructor at exit ("terminate called without an active exception") after all work,
    # output and the process-group teardown had completed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
