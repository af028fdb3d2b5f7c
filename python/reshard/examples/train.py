"""A small FSDP2 causal-LM trainer on top of reshard: every rank builds the model empty,
shards it, reads only its own rank file, and trains.

    torchrun --standalone --nproc-per-node N -m reshard.train OUT [options]
    python -m reshard.train OUT [options]          # one process (world size 1)

OUT is what ``reshard convert SRC -o OUT --world-size N`` wrote (N = number of processes).
Steps, in every rank:

1. ``reshard.empty_model(OUT)``: parameters on the meta device, buffers real;
2. FSDP2: ``fully_shard`` on every module whose class is in ``model._no_split_modules``,
   then on the root, with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
   under ``--bf16`` (the default); master weights are fp32 unless ``--param-dtype`` says
   otherwise (``reshard.load`` converts the file's dtype exactly as ``Tensor.to()``);
3. ``model.to_empty(device)`` and ``reshard.load(model, OUT)``;
4. AdamW on a text corpus (the one shipped in ``reshard/examples/data/corpus.txt`` by default, or
   ``--data FILE``: ``.txt``, or ``.jsonl`` with a ``"text"`` field per line), with gradient
   accumulation and clipping.

Tokens come from ``AutoTokenizer.from_pretrained(OUT)`` when OUT holds a tokenizer, else from
a deterministic byte-level fallback (each UTF-8 byte modulo the vocabulary size).

Rank 0 prints one line per step; every rank prints a summary at the end (load time and
bandwidth, peak host RSS, peak CUDA memory). ``--json-out DIR`` writes ``rank-<r>.json``.
``--check-weights SRC`` and ``--check-generate SRC`` compare the freshly loaded model with
``from_pretrained(SRC)`` (every parameter bit for bit; greedy generation) and raise on any
difference. ``--dry-baseline`` stops before the load: its peak RSS is the baseline of a run.

Checkpoints: ``--save-dir DIR --save-every N`` saves model and optimizer with
``reshard.save`` every N steps (and after the last step) into ``DIR/step-<8 digits>/``, with
each rank's data-order and RNG state in ``trainer/rank-<5 digits>.json``. ``--resume DIR``
(a save directory: its complete checkpoint of the highest step; or one checkpoint)
continues from there with the same data order,
step count and RNG state: the losses are those of an uninterrupted run. ``--steps`` counts
all steps, including those before the checkpoint. Saves are asynchronous
(``reshard.save(..., blocking=False)``): training stops only while the shards are copied
into a snapshot (printed as the stall of each save), the files are written meanwhile, and a
save is committed before the next one starts and before the job ends; ``--save-blocking``
waits for each. ``--keep K`` keeps the K newest committed checkpoints of ``--save-dir``,
deleting older ones only once a newer one is committed.

With ``--lora R`` only LoRA adapters of rank R train (PEFT): the model is built with
``reshard.empty_model(OUT, peft_config=LoraConfig(...))`` (``--lora-targets``, default PEFT's
targets for the model type; ``--lora-alpha``, default 2R), the base loads from OUT frozen, the
adapters start as PEFT initialises them, the optimizer holds the adapters only, and checkpoints
hold the adapters (``reshard export CKPT -o DIR --adapter`` gives a PEFT adapter directory,
``reshard export CKPT -o DIR --merge`` the model with the adapters merged, as PEFT's
``merge_and_unload()``, the base read from OUT); ``--save-base`` puts the base in every
checkpoint too, so that it alone exports and resumes; ``--resume`` loads the base from OUT and
the adapters from the checkpoint.

With ``--tp N`` the job is tensor parallel over N ranks and FSDP2 over the rest: a device mesh
``dp_shard x tp`` (dp_shard = world size / N, mesh dim names ``dp_shard`` and ``tp``);
transformers' own tp plan of the model is applied with torch's parallel styles
(``reshard.parallel_plan.parallelize``: colwise -> ColwiseParallel, rowwise -> RowwiseParallel,
the head's colwise_gather_output -> ColwiseParallel with replicated logits, embedding_rowwise ->
a vocab-parallel embedding; tied embeddings stay one parameter), then ``fully_shard`` over
``dp_shard`` as above, and ``reshard.load`` reads the DTensor layout of OUT for that mesh and
plan, one file per rank, made by (SRC: the checkpoint OUT comes from):

    python -m reshard.parallel_plan SRC -o PLAN.json --fsdp dp_shard
    reshard convert SRC -o OUT --mesh dp_shard=D,tp=N --plan PLAN.json

Without it (OUT holds another layout, or is the Hugging Face checkpoint itself) each rank's part
is planned while loading and read from what is there, nothing stored; the trainer says so and
prints those two commands for the job's mesh. Ranks of one tp group train on the same batches
(drawn by their dp_shard index); gradients are clipped by the norm over all shards. Checkpoints
(--save-dir, --resume) are reshard.save's DTensor layouts of the job. Not with --fsdp1 or --lora.

With ``--ep N`` a mixture-of-experts model (fused experts: transformers' ``MixtralExperts`` and
its kind, ``gate_up_proj`` / ``down_proj``) is expert parallel over N ranks as torchtitan arranges
it (``reshard.ep.parallelize``): each layer's experts ``Shard(0)`` over mesh dim ``ep`` and
``fully_shard``'ed over ``efsdp`` (mesh ``efsdp x ep``, efsdp = world size / N; on tensor dim 1
when efsdp x N exceeds the number of experts, as torchtitan does, else dim 0), every other
parameter ``fully_shard``'ed over a 1-D mesh ``fsdp`` of all ranks; each rank runs its own experts
on the tokens routed to them, the shares summed over ``ep``, so the ranks of one ep group train on
the same batches (drawn by their efsdp index). ``reshard.load`` reads the experts from OUT's
DTensor layout of that mesh and the rest from ``fsdp2-wsW``, made by

    python -m reshard.ep SRC -o PLAN.json --world-size W --ep N
    reshard convert SRC -o OUT --mesh efsdp=D,ep=N --plan PLAN.json
    reshard convert SRC -o OUT --world-size W

or, without them, from what OUT holds (another layout, or the Hugging Face checkpoint), planned
while loading; the trainer prints these commands. Checkpoints are reshard.save's two layouts of
the job (the experts' DTensor layout, the rest fsdp2-wsW). Refused: a model without fused
experts, a number of experts N does not divide; not with --tp, --fsdp1 or --lora.

With ``--fsdp1`` the model is FSDP1 (``FullyShardedDataParallel``) instead, loaded from an
fsdp1 layout of OUT (``reshard convert --layout fsdp1``); checkpoints are then saved in the
fsdp1 layout of the job and resumed from it the same way.

CPU (gloo) when there is no GPU, CUDA (NCCL) otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

import reshard
import reshard.ep
import reshard.errors
from reshard.check import bits, check_weights, full_tensor  # noqa: F401 (re-exported for recipes)
from reshard.model import reference_class  # noqa: F401
from reshard import format_bytes, format_rate

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_CORPUS = os.path.join(DATA_DIR, "corpus.txt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "spiece.model", "vocab.txt")
DEFAULT_PROMPT = "Once there was a baker called"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------
# Small utilities shared with the recipes
# ---------------------------------------------------------------------------------------

def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size of this process now (/proc/self/statm), or the peak elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards in their live dtype (shared parameters once)."""
    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())


def global_param_bytes(model: nn.Module) -> int:
    # An FSDP1 FlatParameter (use_orig_params=False) is the local shard; its unsharded size
    # (padding included) is recorded on it.
    return sum((p._unpadded_unsharded_size.numel() if hasattr(p, "_unpadded_unsharded_size")
                else p.numel()) * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------

def load_documents(path: Optional[str]) -> List[str]:
    """Texts of a .txt file (one document) or a .jsonl file (one document per line, field
    "text"). None: the corpus shipped with reshard."""
    path = path or DEFAULT_CORPUS
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise ValueError(f"{path}:{lineno}: expected an object with a string field \"text\"")
                docs.append(rec["text"])
        if not docs:
            raise ValueError(f"{path}: no documents")
        return docs
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text:
        raise ValueError(f"{path}: empty file")
    return [text]


def has_tokenizer(out: str) -> bool:
    return any(os.path.exists(os.path.join(out, n)) for n in TOKENIZER_FILES)


def make_encoder(out: str, vocab_size: int) -> Tuple[Callable[[str], List[int]], Optional[int], str]:
    """(encode, eos id or None, description). AutoTokenizer when OUT holds a tokenizer,
    otherwise bytes modulo the vocabulary size."""
    if has_tokenizer(out):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)

        def encode(text: str) -> List[int]:
            return tok(text, add_special_tokens=False)["input_ids"]

        return encode, tok.eos_token_id, f"AutoTokenizer({type(tok).__name__}) from {out}"

    def encode_bytes(text: str) -> List[int]:
        raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        return (raw.to(torch.int64) % vocab_size).tolist()

    return (encode_bytes, None,
            f"byte-level fallback (UTF-8 bytes mod vocab_size={vocab_size}): {out} has no tokenizer")


def token_stream(docs: List[str], encode: Callable[[str], List[int]], eos_id: Optional[int],
                 vocab_size: int) -> torch.Tensor:
    """All documents tokenized and concatenated (EOS between documents when known)."""
    ids: List[int] = []
    for i, doc in enumerate(docs):
        if i and eos_id is not None:
            ids.append(eos_id)
        # Long texts in pieces, so fast tokenizers never see one huge string.
        start = 0
        while start < len(doc):
            end = doc.find("\n\n", start + 65536)
            end = len(doc) if end < 0 else end + 2
            ids.extend(encode(doc[start:end]))
            start = end
    stream = torch.tensor(ids, dtype=torch.int64)
    if stream.numel() and int(stream.max()) >= vocab_size:
        raise ValueError(f"token id {int(stream.max())} >= vocab_size {vocab_size}: the tokenizer "
                         "does not match the model")
    return stream


class Batches:
    """Random windows of `seq_len` tokens from the stream; each rank draws its own, seeded by
    (seed, rank), so a run is reproducible and ranks see different data."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int):
        if stream.numel() < seq_len + 1:
            raise ValueError(f"the data has {stream.numel()} tokens; --seq-len {seq_len} needs more")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def get_state(self) -> str:
        return bytes(self.gen.get_state().tolist()).hex()

    def set_state(self, state: str) -> None:
        self.gen.set_state(torch.tensor(list(bytes.fromhex(state)), dtype=torch.uint8))

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - self.seq_len, (self.batch_size,), generator=self.gen)
        return torch.stack([self.stream[s:s + self.seq_len] for s in starts.tolist()])


# ---------------------------------------------------------------------------------------
# Checks against from_pretrained
# ---------------------------------------------------------------------------------------

def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def reshard_all(model: nn.Module) -> None:
    """Frees every FSDP2 unit's gathered parameters. Needed after forwards without backward
    (evaluation, generation): FSDP2 keeps the root unit's parameters gathered after its
    forward, and later forwards would reuse those stale copies instead of gathering the
    updated shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _greedy(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding without a KV cache: each step runs model(ids) on the whole sequence."""
    for _ in range(new_tokens):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def check_generate(model: nn.Module, src: str, prompt_ids: torch.Tensor, compute_dtype: torch.dtype,
                   new_tokens: int = 12, model_class=None, log=print) -> Dict[str, object]:
    """Greedy generation of the sharded model (FSDP2 gathers parameters in each forward; all
    ranks step together with synced_gpus) equals from_pretrained(SRC, dtype=compute_dtype)'s
    greedy generation. Raises otherwise. Collective: call it on every rank. SRC may be a model
    id in the local Hugging Face cache (reshard.resolve_source)."""
    src = reshard.resolve_source(src)
    cls = model_class or reference_class(model)
    device = next(local_tensor(p) for p in model.parameters()).device
    ids = prompt_ids.reshape(1, -1).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  num_beams=1, pad_token_id=getattr(model.config, "pad_token_id", None) or 0,
                  attention_mask=torch.ones_like(ids))
    world = dist.get_world_size() if dist.is_initialized() else 1
    was_training = model.training
    model.eval()
    fsdp1 = is_fsdp1(model)
    if fsdp1:
        # FSDP1's root forward must run (generate() on the wrapped module would skip it): a
        # plain greedy loop through model(...), the reference below doing the same.
        with torch.no_grad():
            logits = model(ids).logits.float().cpu()
            got = _greedy(model, ids, new_tokens).cpu()
    else:
        with torch.no_grad():
            logits = model(ids).logits.float().cpu()
            got = model.generate(ids, synced_gpus=world > 1, **kwargs).cpu()
    reshard_all(model)
    model.train(was_training)
    _quiet_transformers()
    # The reference runs whole on the same device (same kernels), one copy per rank.
    ref = cls.from_pretrained(src, dtype=compute_dtype).to(device).eval()
    with torch.no_grad():
        ref_logits = ref(ids).logits.float().cpu()
        want = (_greedy(ref, ids, new_tokens) if fsdp1 else ref.generate(ids, **kwargs)).cpu()
    del ref
    gc.collect()
    max_diff = (logits - ref_logits).abs().max().item()
    if not torch.equal(got, want):
        raise AssertionError(f"greedy generation differs from from_pretrained({src}) in {compute_dtype}: "
                             f"got {got.tolist()}, expected {want.tolist()} "
                             f"(prompt logits max abs diff {max_diff:.3g})")
    log(f"check-generate: greedy continuation of {ids.shape[1]} prompt tokens equals "
        f"from_pretrained({src}) in {compute_dtype}: {got[0, ids.shape[1]:].tolist()} "
        f"(prompt logits max abs diff {max_diff:.3g})")
    return {"prompt": ids[0].tolist(), "generated": got[0].tolist(), "logits_max_abs_diff": max_diff}


# ---------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m reshard.train", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", help="a reshard output directory (reshard convert ... -o OUT --world-size N)")
    ap.add_argument("--data", default=None, help=".txt or .jsonl (field \"text\"); default: the shipped corpus")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", dest="bf16", action="store_true", default=True,
                    help="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="compute in the parameter dtype")
    ap.add_argument("--param-dtype", choices=["fp32", "bf16", "checkpoint"], default="fp32",
                    help="dtype of the sharded (master) parameters; 'checkpoint' keeps the file's")
    ap.add_argument("--fsdp1", action="store_true",
                    help="FSDP1 (FullyShardedDataParallel, FlatParameters, units = the model's "
                         "_no_split_modules) instead of FSDP2; OUT needs a matching fsdp1 layout "
                         "(reshard convert --layout fsdp1 ...)")
    ap.add_argument("--use-orig-params", action="store_true", help="FSDP1 use_orig_params=True")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor parallel over N ranks with transformers' tp plan of the model, FSDP2 over "
                         "the rest (mesh dp_shard x tp, dp_shard = world size / N); loads fastest from OUT's "
                         "DTensor layout of that mesh: python -m reshard.parallel_plan SRC -o PLAN.json "
                         "--fsdp dp_shard; reshard convert SRC -o OUT --mesh dp_shard=D,tp=N --plan PLAN.json "
                         "(without it, from what OUT holds)")
    ap.add_argument("--ep", type=int, default=1, metavar="N",
                    help="expert parallel over N ranks for a mixture-of-experts model (reshard.ep): the fused "
                         "experts Shard(0) over ep and fully_shard'ed over efsdp (mesh efsdp x ep, efsdp = "
                         "world size / N; on tensor dim 1 when efsdp x N > the number of experts, as "
                         "torchtitan), every other parameter fully_shard'ed over all ranks (mesh fsdp); "
                         "loads from what OUT holds, fastest from its layouts for that job: python -m "
                         "reshard.ep SRC -o PLAN.json --world-size W --ep N; reshard convert SRC -o OUT --mesh "
                         "efsdp=D,ep=N --plan PLAN.json; reshard convert SRC -o OUT --world-size W")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--threads", type=int, default=None, help="reshard.load reader threads")
    ap.add_argument("--json-out", default=None, help="directory for rank-<r>.json")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--check-weights", metavar="SRC", default=None,
                    help="after the load, compare every parameter with from_pretrained(SRC) bit for bit "
                         "(SRC: a checkpoint directory, or a model id in the local Hugging Face cache)")
    ap.add_argument("--check-generate", metavar="SRC", default=None,
                    help="after the load, compare greedy generation with from_pretrained(SRC) (SRC as "
                         "for --check-weights)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of --check-generate")
    ap.add_argument("--dry-baseline", action="store_true",
                    help="build, shard and to_empty, then report RSS and stop (no load, no training)")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train LoRA adapters of rank R only (PEFT), the base model frozen")
    ap.add_argument("--lora-targets", default=None, metavar="M1,M2",
                    help="module names LoRA wraps (default: PEFT's for the model type)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2R)")
    ap.add_argument("--save-base", action="store_true",
                    help="with --lora: each checkpoint holds the base weights too (reshard.save(..., "
                         "base=True)), so that it alone loads, resumes and exports (--merge)")
    ap.add_argument("--save-dir", default=None,
                    help="save model and optimizer with reshard.save into DIR/step-NNNNNNNN/")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save every N steps (0: only after the last step) when --save-dir is given")
    ap.add_argument("--save-blocking", action="store_true",
                    help="wait for each save to be written (default: asynchronous, training goes on)")
    ap.add_argument("--keep", type=int, default=0, metavar="K",
                    help="keep the K newest committed checkpoints of --save-dir (0: all)")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="continue from a checkpoint: a --save-dir (its complete step-* of the highest step) or one checkpoint")
    args = ap.parse_args(argv)
    if args.lora < 0:
        ap.error("--lora must be at least 0")
    if args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.tp > 1:
        for flag, on in (("--fsdp1", args.fsdp1), ("--lora", args.lora)):
            if on:
                ap.error(f"--tp {args.tp} with {flag}: the tensor-parallel trainer runs FSDP2 (fully_shard) "
                         "without adapters")
    if args.ep < 1:
        ap.error("--ep must be at least 1")
    if args.ep > 1:
        for flag, on in (("--tp", args.tp > 1), ("--fsdp1", args.fsdp1), ("--lora", args.lora)):
            if on:
                ap.error(f"--ep {args.ep} with {flag}: the expert-parallel trainer runs FSDP2 (fully_shard) "
                         "without tensor parallel or adapters")
    if args.lora and args.fsdp1:
        ap.error("--lora runs under FSDP2 (reshard loads PEFT models under fully_shard), not --fsdp1")
    if args.lora and (args.check_weights or args.check_generate):
        ap.error("--check-weights / --check-generate compare a model with from_pretrained; not with --lora")
    if (args.lora_targets or args.lora_alpha) and not args.lora:
        ap.error("--lora-targets / --lora-alpha need --lora R")
    if args.save_every < 0:
        ap.error("--save-every must be at least 0")
    if args.keep < 0:
        ap.error("--keep must be at least 0")
    if args.save_base and not (args.lora and args.save_dir):
        ap.error("--save-base needs --lora R and --save-dir")
    if (args.keep or args.save_blocking) and not args.save_dir:
        ap.error("--keep / --save-blocking need --save-dir")
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        least = 0 if name == "steps" else 1
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}")
    return args


def init_distributed(device_arg: str) -> Tuple[int, int, torch.device]:
    """Process group from torchrun's environment (or a single-process group without it):
    NCCL on CUDA, gloo on CPU."""
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but CUDA is not available")
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cpu")
    kwargs = {}
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        kwargs["device_id"] = device  # binds NCCL to this rank's GPU
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **kwargs)
        else:  # plain `python -m reshard.train`: a process group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def require_causal_lm(cls, out: str) -> None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return
    names = {v for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(v, str)}
    if cls.__name__ not in names:
        raise SystemExit(f"{out}: the model is a {cls.__name__}, not a causal language model; "
                         "reshard.train trains causal LMs only")


def shard_model(model: nn.Module, mesh, mp_policy) -> int:
    """fully_shard every module whose class is in model._no_split_modules, then the root.
    Returns the number of FSDP units."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    units = 0
    for m in list(model.modules()):
        if m is not model and type(m).__name__ in no_split:
            fully_shard(m, **kwargs)
            units += 1
    fully_shard(model, **kwargs)
    return units + 1


def tp_commands(out: str, mesh_flag: str, model_type: str) -> Tuple[str, str]:
    """The two commands that give OUT the DTensor layout a --tp job loads (SRC: the checkpoint
    OUT was converted from)."""
    import shlex

    plan = f"{model_type or 'model'}_tp.json"
    return (f"python -m reshard.parallel_plan SRC -o {plan} --fsdp dp_shard",
            f"reshard convert SRC -o {shlex.quote(out)} --mesh {mesh_flag} --plan {plan}")


def tensor_parallel(model: nn.Module, mesh, out: str, log0) -> str:
    """Applies transformers' tp plan of `model` over mesh dim tp (reshard.parallel_plan.parallelize).
    When OUT has no DTensor layout of this mesh, says so with the commands that store one
    (reshard.load then plans each rank over what OUT holds, nothing stored). Returns the mesh as
    --mesh spells it."""
    from reshard.layout import read_manifest
    from reshard.parallel_plan import parallelize

    names, shape = list(mesh.mesh_dim_names), list(mesh.shape)
    flag = ",".join(f"{n}={s}" for n, s in zip(names, shape))
    manifest = (read_manifest(out) if os.path.isdir(out) else None) or {}
    have = [k for k, v in manifest.get("layouts", {}).items()
            if v.get("kind") == "dtensor" and v.get("complete") and v.get("mesh") == {"names": names, "shape": shape}]
    if not have:
        capture, convert = tp_commands(out, flag, getattr(model.config, "model_type", ""))
        log0(f"tp: {out} has no DTensor layout of the mesh {flag}: each rank reads its part of what is there "
             f"(planned while loading, nothing stored). To store this job's layout (one file per rank, the "
             f"fastest load), from the checkpoint OUT comes from (SRC): {capture} && {convert}")
    try:
        parallelize(model, mesh["tp"])
    except ValueError as e:
        raise reshard.UnsupportedError(f"--tp: {e}") from None
    return flag


def ep_commands(out: str, world: int, ep: int, config) -> List[str]:
    """The commands that give OUT the layouts an --ep job reads as stored (SRC: the checkpoint
    OUT was converted from): the experts' DTensor layout of mesh efsdp x ep and the FSDP2 layout
    of the rest."""
    import shlex

    plan = f"{getattr(config, 'model_type', None) or 'model'}_ep.json"
    # The job's sizes: the plan's experts on the tensor dim parallelize shards them on
    # (torchtitan's rule: dim 1 when efsdp x ep > the number of experts).
    return [f"python -m reshard.ep SRC -o {plan} --world-size {world} --ep {ep}",
            f"reshard convert SRC -o {shlex.quote(out)} --mesh efsdp={world // ep},ep={ep} --plan {plan}",
            f"reshard convert SRC -o {shlex.quote(out)} --world-size {world}"]


def expert_parallel(model: nn.Module, dense, sparse, mp_policy, out: str, log0) -> int:
    """reshard.ep.parallelize: the fused experts Shard(0) over sparse's ep and fully_shard'ed over
    its efsdp, the rest fully_shard'ed over `dense`; refuses (UnsupportedError) a model without
    fused experts, or whose experts ep does not divide. When OUT lacks the layouts of this job,
    says so with the commands that store them (reshard.load then reads each rank's part of what
    OUT holds). Returns the number of FSDP2 units."""
    from reshard.layout import read_manifest

    world, ep = dense.size(), sparse["ep"].size()
    names, shape = list(sparse.mesh_dim_names), list(sparse.shape)
    manifest = (read_manifest(out) if os.path.isdir(out) else None) or {}
    layouts = manifest.get("layouts", {})
    dtensor = any(v.get("kind") == "dtensor" and v.get("complete") and v.get("mesh") == {"names": names, "shape": shape}
                  for v in layouts.values())
    fsdp2 = (layouts.get(f"fsdp2-ws{world}") or {}).get("complete")
    units = reshard.ep.parallelize(model, dense, sparse, mp_policy)
    if not (dtensor and fsdp2):
        lacks = [what for what, have in ((f"DTensor layout of the mesh efsdp={world // ep},ep={ep}", dtensor),
                                         (f"FSDP2 layout of {world} ranks (fsdp2-ws{world})", fsdp2)) if not have]
        log0(f"ep: {out} has no {' and no '.join(lacks)}: each rank reads its part of what is there (planned "
             f"while loading, nothing stored). To store this job's layouts (one file per rank each, the fastest load), from the checkpoint OUT comes from (SRC): "
             f"{' && '.join(ep_commands(out, world, ep, model.config))}")
    return units


def experts_fsdp_dim_of(model: nn.Module) -> Optional[int]:
    """The tensor dim fully_shard sharded the fused experts on over efsdp (mesh dim 0 of their
    mesh): 1 when parallelize followed torchtitan's rule for efsdp x ep > experts, else 0."""
    for _, m in reshard.ep.fused_experts(model):
        pl = m.gate_up_proj.placements[0]
        return pl.dim if pl.is_shard() else None
    return None


def clip_grad_norm_dtensor(params: List[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over gradients that are DTensors of different meshes (a --tp job:
    TP'd parameters on dp_shard x tp, the others on dp_shard alone; an --ep job: the experts on
    efsdp x ep, the others on fsdp): the norm of each mesh's
    gradients in full, combined, then every gradient scaled as clip_grad_norm_ scales them.
    Returns the total norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: Dict[object, List[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32)
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm(group, 2.0)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        total_sq = total_sq + n.detach().float().cpu() ** 2
    total = total_sq.sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return total


def is_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP)


def shard_model_fsdp1(model: nn.Module, device: torch.device, mixed_precision: bool,
                      use_orig_params: bool) -> Tuple[nn.Module, int]:
    """FullyShardedDataParallel over the meta model: units = model._no_split_modules (as
    accelerate wraps), parameters allocated per unit on `device` keeping ties
    (reshard.fsdp1_param_init_fn). Returns (FSDP root, number of units with parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    no_split = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in no_split}
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy(classes), device_id=device,
                  param_init_fn=reshard.fsdp1_param_init_fn(device), use_orig_params=use_orig_params)
    if mixed_precision:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    wrapped = FSDP(model, **kwargs)
    units = sum(1 for m in FSDP.fsdp_modules(wrapped) if m._handle is not None)
    return wrapped, units


def mixed_precision_policy(enabled: bool, device: torch.device, log) -> Optional[object]:
    if not enabled:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        log("bf16: this GPU does not support bf16; training without mixed precision")
        return None
    if device.type == "cpu":
        try:  # bf16 matmul must exist on this CPU build
            torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
        except RuntimeError as e:
            log(f"bf16: not usable on this CPU ({e}); training without mixed precision")
            return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------

def _rng_hex(state: torch.Tensor) -> str:
    return bytes(state.tolist()).hex()


def _rng_tensor(text: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory (holding reshard.json) from --resume: the directory itself, or
    the complete step-* directory of the highest step in a --save-dir. A save that did not
    finish has no reshard.json (rank 0 writes it last), so it is never picked."""
    if os.path.exists(os.path.join(path, "reshard.json")):
        return path
    steps = committed_steps(path)
    if not steps:
        raise SystemExit(f"--resume {path}: neither a checkpoint (reshard.json) nor a --save-dir "
                         "holding a complete step-* checkpoint")
    return os.path.join(path, steps[-1][1])


def committed_steps(save_dir: str) -> List[Tuple[int, str]]:
    """(step, directory name) of the committed (reshard.json) step-* checkpoints of a save
    directory, ascending."""
    steps = []
    if os.path.isdir(save_dir):
        for name in os.listdir(save_dir):
            if name.startswith("step-") and name[5:].isdigit() and \
                    os.path.exists(os.path.join(save_dir, name, "reshard.json")):
                steps.append((int(name[5:]), name))
    return sorted(steps)


def prune_checkpoints(save_dir: str, keep: int, log0) -> None:
    """Rank 0: deletes the step-* directories older than the K newest committed checkpoints
    (committed or not: an older unfinished one is garbage too). A newer directory, such as
    the save in flight, is never touched."""
    steps = committed_steps(save_dir)
    if keep <= 0 or len(steps) <= keep:
        return
    cutoff = steps[-keep][0]
    for name in sorted(os.listdir(save_dir)):
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) < cutoff:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            log0(f"save: removed {os.path.join(save_dir, name)} (--keep {keep})")


class Checkpoints:
    """The trainer's saves: each rank's trainer state, then reshard.save (asynchronous unless
    --save-blocking); a save's commit is logged once known (at the next save, or at the end),
    and --keep prunes after each commit."""

    def __init__(self, args, rank: int, source: str, log0):
        self.args, self.rank, self.source, self.log0 = args, rank, source, log0
        self.pending = None  # (step, handle)
        self.stalls: List[float] = []

    def _committed(self, step: int, report) -> None:
        self.log0(f"save: step {step} committed, durable {report.durable_seconds:.3f} s after the call "
                  f"(rank 0 wrote {format_bytes(report.bytes)})")
        # The next save copies its config and tokenizer files from this checkpoint (the same
        # files): the one the job started from may be pruned by --keep.
        self.source = report.out
        if self.rank == 0 and self.args.keep:
            prune_checkpoints(self.args.save_dir, self.args.keep, self.log0)

    def finish(self) -> None:
        """Collective: waits for the save in flight (raising what it met)."""
        if self.pending is not None:
            step, handle = self.pending
            self.pending = None
            self._committed(step, handle.wait())

    def save(self, model, opt, batches: "Batches", step: int) -> str:
        """Collective. Writes DIR/step-<step>/: each rank's trainer state first, then
        reshard.save, whose manifest (written last, by rank 0) is the commit point."""
        args = self.args
        self.finish()  # reshard.save would wait for it too; this logs it and prunes
        name = f"step-{step:08d}"
        ckpt = os.path.join(args.save_dir, name)
        tdir = os.path.join(ckpt, "trainer")
        os.makedirs(tdir, exist_ok=True)
        state = {"step": step, "batches": batches.get_state(), "torch_rng": _rng_hex(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng"] = _rng_hex(torch.cuda.get_rng_state())
        tmp = os.path.join(tdir, f".rank-{self.rank:05d}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(tdir, f"rank-{self.rank:05d}.json"))
        fd = os.open(tdir, os.O_RDONLY)  # the rename is durable before the manifest commits it
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        if args.save_blocking:
            report = reshard.save(model, ckpt, optimizer=opt, step=step, source=self.source,
                                  base=args.save_base)
            stall = time.perf_counter() - t0
            self.stalls.append(stall)
            self.log0(f"save: step {step} -> {ckpt}, blocking: stall {stall:.3f} s")
            self._committed(step, report)
        else:
            handle = reshard.save(model, ckpt, optimizer=opt, step=step, source=self.source, blocking=False,
                                  base=args.save_base)
            stall = time.perf_counter() - t0
            self.stalls.append(stall)
            where = {"device": "GPU memory", "host": "host memory"}.get(handle.snapshot)
            self.log0(f"save: step {step} -> {ckpt}, asynchronous: stall {stall:.3f} s " +
                      (f"(snapshot of {format_bytes(handle.snapshot_bytes)} in {where}), writing" if where
                       else "(no room for a snapshot: written before returning)"))
            self.pending = (step, handle)
        return ckpt


def run(args: argparse.Namespace) -> Dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    t_job = time.perf_counter()
    rank, world, device = init_distributed(args.device)
    if device.type == "cuda":  # the copy engine is set up in the background meanwhile
        reshard.prepare(device, threads=args.threads)

    def log0(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(args.seed)
    tp_mesh, mesh_flag = None, None  # --tp: the job's mesh dp_shard x tp, as --mesh spells it
    ep_mesh = None  # --ep: the experts' mesh efsdp x ep (`mesh`: the 1-D fsdp mesh of the rest)
    dp_rank, dp_world = rank, world  # which batches a rank draws; how many distinct ones a step has
    if args.tp > 1:
        if world % args.tp:
            raise reshard.InvalidArgumentError(f"--tp {args.tp}: the world size {world} is not a multiple of it")
        tp_mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
        mesh = tp_mesh["dp_shard"]
        dp_rank, dp_world = mesh.get_local_rank(), world // args.tp
    elif args.ep > 1:
        if world % args.ep:
            raise reshard.InvalidArgumentError(f"--ep {args.ep}: the world size {world} is not a multiple of it")
        mesh, ep_mesh = reshard.ep.meshes(device.type, world, args.ep)
        # Ranks of one ep group run the same tokens (each its own experts): one batch stream each.
        dp_rank, dp_world = ep_mesh["efsdp"].get_local_rank(), world // args.ep
        mesh_flag = f"efsdp={world // args.ep},ep={args.ep}"
    else:
        mesh = init_device_mesh(device.type, (world,))
    mp = mixed_precision_policy(args.bf16, device, log0)
    resume = resolve_checkpoint(args.resume) if args.resume else None
    # Where the model is loaded from; with --lora the base from OUT, the adapters from `resume`.
    weights = args.out if args.lora else (resume or args.out)
    build = {} if args.param_dtype == "checkpoint" else {"dtype": _DTYPES[args.param_dtype]}
    if args.lora:
        from peft import LoraConfig

        build["peft_config"] = LoraConfig(
            r=args.lora, lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora,
            target_modules=args.lora_targets.split(",") if args.lora_targets else None)
    model = reshard.empty_model(weights, **build)
    hf_model = model.get_base_model() if args.lora else model
    cls = reference_class(hf_model)
    require_causal_lm(cls, args.out)
    if args.fsdp1:
        model, units = shard_model_fsdp1(model, device, mp is not None, args.use_orig_params)
    else:
        try:
            if tp_mesh is not None:
                mesh_flag = tensor_parallel(model, tp_mesh, weights, log0)
            if ep_mesh is not None:
                units = expert_parallel(model, mesh, ep_mesh, mp, weights, log0)
        except reshard.ReshardError as e:  # the same on every rank
            if rank == 0:
                print(f"reshard.train: {e}", file=sys.stderr, flush=True)
            dist.barrier()  # no rank exits (and gets the others killed) before rank 0 has said why
            raise JobError(e, 0, world, printed=True) from None
        if ep_mesh is None:
            units = shard_model(model, mesh, mp)
        model.to_empty(device=device)
    live_dtype = next(model.parameters()).dtype
    compute_dtype = torch.bfloat16 if mp is not None else live_dtype
    experts_dim = experts_fsdp_dim_of(model) if ep_mesh else None
    # Whole parameters: a DTensor's numel is its global one; an FSDP1 FlatParameter's local shard
    # is not, its original parameters' numels are (_numels).
    n_params = sum(sum(p._numels) if hasattr(p, "_numels") else p.numel() for p in model.parameters())
    log0(f"model {cls.__name__}: {n_params / 1e6:.2f} M parameters, "
         f"{units} {'FSDP1' if args.fsdp1 else 'FSDP2'} units on {world} rank(s)"
         f"{f' (mesh {mesh_flag}, tensor parallel: transformers tp plan)' if tp_mesh is not None else ''}"
         f"{f' (expert parallel: experts on mesh {mesh_flag}, the rest on fsdp={world}; experts fully_shard on tensor dim {experts_dim})' if ep_mesh else ''}, "
         f"{device.type}/{dist.get_backend()}, parameters "
         f"{live_dtype}, compute {compute_dtype}{' (mixed precision bf16/fp32)' if mp else ''}")

    result: Dict[str, object] = {
        "rank": rank, "world_size": world, "device": str(device), "backend": dist.get_backend(),
        "model_class": cls.__name__, "param_dtype": str(live_dtype), "compute_dtype": str(compute_dtype),
        "mixed_precision": mp is not None, "fsdp_units": units, "fsdp": 1 if args.fsdp1 else 2,
        "local_param_bytes": local_param_bytes(model), "model_param_bytes": global_param_bytes(model),
        "tp": args.tp, "ep": args.ep, "mesh": mesh_flag, "experts_fsdp_dim": experts_dim,
    }
    rss_before = current_rss_bytes()
    peak_before = peak_rss_bytes()
    result["rss"] = {"before_load": rss_before, "peak_before_load": peak_before}

    if args.dry_baseline:
        result["dry_baseline"] = True
        result["rss"]["peak_final"] = peak_rss_bytes()
        print(f"rank {rank}/{world}: dry baseline (built, sharded, to_empty; not loaded): RSS "
              f"{format_bytes(rss_before)}, peak RSS {format_bytes(result['rss']['peak_final'])}", flush=True)
        return result

    # --- load this rank's shard ---
    dist.barrier()
    report, err = None, None
    try:
        report = reshard.load(model, weights, threads=args.threads,
                              progress=rank == 0 and sys.stderr.isatty(),
                              **({"adapter": resume} if args.lora and resume else {}))
    except reshard.ReshardError as e:
        err = (e.code, str(e))
        if tp_mesh is not None and isinstance(e, reshard.LayoutMismatchError):
            capture, convert = tp_commands(weights, mesh_flag, getattr(model.config, "model_type", ""))
            err = (e.code, f"{e} (this trainer applies transformers' tp plan of the model: {capture} && {convert})")
        if ep_mesh is not None and isinstance(e, reshard.LayoutMismatchError):
            err = (e.code, f"{e} (this trainer places the experts with reshard.ep: "
                           f"{' && '.join(ep_commands(weights, world, args.ep, model.config))})")
    # Every rank learns at once whether any rank's load was refused (a rank that went on alone
    # would wait in the first collective until the job's timeout).
    errs: List[Optional[Tuple[str, str]]] = [None] * world
    dist.all_gather_object(errs, err)
    failed = [r for r, e in enumerate(errs) if e]
    if failed:
        code, text = errs[failed[0]]
        raise JobError(reshard.errors.error_class(code)(text), failed[0], len(failed))
    peak_after = peak_rss_bytes()
    result["rss"]["peak_after_load"] = peak_after
    if device.type == "cuda":
        result["cuda_after_load_bytes"] = torch.cuda.memory_allocated(device)
        result["cuda_peak_after_load_bytes"] = torch.cuda.max_memory_allocated(device)
    result["load_wall_s"] = time.perf_counter() - t_job
    result["rss"]["load_increment"] = peak_after - rss_before
    result["load"] = {"file": report.file, "layout": report.layout, "bytes": report.bytes,
                      "seconds": report.seconds, "gbps": report.gbps, "tensors": report.tensors,
                      "converted_tensors": report.converted_tensors, "direct_io": report.direct_io,
                      "staging_bytes": report.staging_bytes, "threads": report.threads}
    result["load"]["source"] = report.source
    where = os.path.relpath(report.file, weights) if report.source == "rank file" else report.source
    log0(f"load: rank 0 loaded {format_bytes(report.bytes)} from {where} "
         f"in {report.seconds:.3f} s ({format_rate(report.gbps * 1e9)}), {report.converted_tensors} tensor(s) "
         f"converted to {live_dtype}")

    # --- optional checks, right after the load and before any update ---
    if args.check_weights:
        result["params_checked"] = check_weights(model, args.check_weights, cls, log0)

    docs = load_documents(args.data)
    encode, eos_id, tok_desc = make_encoder(args.out, model.config.vocab_size)
    log0(f"tokenizer: {tok_desc}")
    result["tokenizer"] = tok_desc
    if args.check_generate:
        prompt = torch.tensor(encode(args.prompt), dtype=torch.int64)
        result["generate"] = check_generate(model, args.check_generate, prompt, compute_dtype,
                                            model_class=cls, log=log0)

    # A learned table of positions (GPT-2's wpe, OPT's embed_positions) has no row past the
    # model's context: a longer --seq-len fails inside the first step. Rotary models have none
    # and run longer sequences (their max_position_embeddings is no hard limit).
    context = next((getattr(model.config, k) for k in ("n_positions", "max_position_embeddings", "n_ctx")
                    if isinstance(getattr(model.config, k, None), int)), None)
    learned = any(isinstance(m, torch.nn.Embedding) and ("pos" in n.rsplit(".", 1)[-1] or n.endswith("wpe"))
                  for n, m in model.named_modules())
    if learned and context is not None and args.seq_len > context:  # the same on every rank: all stop together
        e = reshard.InvalidArgumentError(
            f"--seq-len {args.seq_len} is longer than the model's context ({context} positions: its config's "
            f"max_position_embeddings / n_positions): pass --seq-len {context} or less")
        if rank == 0:
            print(f"reshard.train: {e}", file=sys.stderr, flush=True)
        dist.barrier()
        raise JobError(e, 0, world, printed=True)
    t0 = time.perf_counter()
    stream = token_stream(docs, encode, eos_id, model.config.vocab_size)
    batches = Batches(stream, args.batch_size, args.seq_len, args.seed, dp_rank)  # one tp group: one stream
    log0(f"data: {args.data or DEFAULT_CORPUS}: {len(docs)} document(s), {stream.numel()} tokens "
         f"({time.perf_counter() - t0:.2f} s)")

    # --- training ---
    trainable = [p for p in model.parameters() if p.requires_grad]
    if args.lora:
        log0(f"lora: r={args.lora}, {len(trainable)} adapter tensor(s), "
             f"{sum(p.numel() for p in trainable) / 1e6:.3f} M trainable parameters "
             f"({report.adapters.get('source')})")
        result["lora"] = {"r": args.lora, "trainable_tensors": len(trainable),
                          "trainable_params": sum(p.numel() for p in trainable),
                          "adapters": report.adapters}
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    start_step = 0
    if resume:
        # The trainer state first: at another world size no relayout of the optimizer state
        # helps reshard.train (each rank's data position is its own), so say that before
        # load_optimizer would ask for a relayout.
        tpath = os.path.join(resume, "trainer", f"rank-{rank:05d}.json")
        # Checked alike on every rank (the files, not this rank's alone), so that all ranks stop
        # together rather than some going on into a collective the others never join.
        tdir = os.path.join(resume, "trainer")
        saved_ranks = sorted(n for n in os.listdir(tdir) if n.startswith("rank-") and n.endswith(".json")) \
            if os.path.isdir(tdir) else []
        if len(saved_ranks) != world or not os.path.exists(tpath):
            e = reshard.LayoutMismatchError(
                f"--resume: {resume} holds the trainer state (step, data position, random state) of "
                f"{len(saved_ranks)} rank(s) in {tdir}, this job has {world}: each rank's data position and "
                f"random state are its own, so reshard.train resumes only at the world size that saved them "
                f"(run it with {len(saved_ranks)} processes). The weights and optimizer state themselves load at "
                f"any world size: reshard relayout {resume} --world-size {world}, then reshard.load + "
                f"reshard.load_optimizer in your own loop" if saved_ranks else
                f"--resume: {tdir} holds no trainer state (rank-*.json): {resume} was not written by "
                f"reshard.train --save-dir; load it with reshard.load + reshard.load_optimizer instead")
            if rank == 0:
                print(f"reshard.train: {e}", file=sys.stderr, flush=True)
            dist.barrier()  # no rank exits (and gets the others killed) before rank 0 has said why
            raise JobError(e, 0, world, printed=True)
        reshard.load_optimizer(opt, model, resume)
        with open(tpath) as f:
            tstate = json.load(f)
        start_step = int(tstate["step"])
        batches.set_state(tstate["batches"])
        torch.set_rng_state(_rng_tensor(tstate["torch_rng"]))
        if "cuda_rng" in tstate and device.type == "cuda":
            torch.cuda.set_rng_state(_rng_tensor(tstate["cuda_rng"]))
        log0(f"resume: {resume} at step {start_step}")
    result["first_step"] = start_step + 1
    result["checkpoints"] = []
    checkpoints = Checkpoints(args, rank, weights, log0)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * dp_world
    losses: List[float] = []
    grad_norms: List[float] = []
    step_times: List[float] = []
    model.train()
    for step in range(start_step, args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else args.lr
        for g in opt.param_groups:
            g["lr"] = lr
        t_step = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            if args.fsdp1:
                sync = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            with sync:
                ids = batches.next().to(device)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float()
        if args.max_grad_norm > 0:
            if args.fsdp1:  # FSDP1's own: the norm over all ranks' shards
                norm = model.clip_grad_norm_(args.max_grad_norm)
            elif tp_mesh is not None or ep_mesh is not None:
                norm = clip_grad_norm_dtensor(trainable, args.max_grad_norm)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            grad_norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # SUM: gloo has no AVG
        step_loss = loss_sum.item() / (args.grad_accum * world)
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"step {step + 1}: loss is {step_loss}")
        dt = time.perf_counter() - t_step
        losses.append(step_loss)
        step_times.append(dt)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            gn = f" grad_norm {grad_norms[-1]:.3f}" if grad_norms else ""
            log0(f"step {step + 1}/{args.steps} loss {step_loss:.4f} lr {lr:.2e}{gn} "
                 f"tokens/s {tokens_per_step / dt:.0f} ({dt:.2f} s)")
        if args.save_dir and ((args.save_every and (step + 1) % args.save_every == 0)
                              or step + 1 == args.steps):
            result["checkpoints"].append(checkpoints.save(model, opt, batches, step + 1))
    checkpoints.finish()
    result["save_stall_seconds"] = checkpoints.stalls

    train_s = sum(step_times)
    result.update({
        "losses": losses, "grad_norms": grad_norms, "step_seconds": step_times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * len(step_times) / train_s if train_s else 0.0,
        "steps": args.steps, "lr": args.lr, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "grad_accum": args.grad_accum, "max_grad_norm": args.max_grad_norm, "seed": args.seed,
    })
    result["rss"]["peak_final"] = peak_rss_bytes()
    if device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    cuda = (f", peak CUDA {format_bytes(result['cuda_peak_bytes'])}" if "cuda_peak_bytes" in result else "")
    loss_txt = f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
    here = os.path.relpath(report.file, weights) if report.source == "rank file" else report.file
    line = (f"rank {rank}/{world}: loaded {format_bytes(report.bytes)} from {here} in {report.seconds:.3f} s ({format_rate(report.gbps * 1e9)}); "
            f"peak RSS {format_bytes(peak_after)} after load (RSS before load {format_bytes(rss_before)}), "
            f"{format_bytes(result['rss']['peak_final'])} at the end{cuda}{loss_txt}, "
            f"{result['tokens_per_s']:.0f} tokens/s")
    if dist.is_available() and dist.is_initialized() and world > 1:
        lines = [None] * world  # one summary per rank, printed in rank order by rank 0
        dist.all_gather_object(lines, line)
        if rank == 0:
            print("\n".join(lines), flush=True)
    else:
        print(line, flush=True)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
        if args.json_out:
            os.makedirs(args.json_out, exist_ok=True)
            with open(os.path.join(args.json_out, f"rank-{result['rank']}.json"), "w") as f:
                json.dump(result, f, indent=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


class JobError(Exception):
    """A refusal on some rank(s) of the job: `error` as raised on rank `rank`, the lowest of the
    `count` ranks that failed. That rank prints it; every rank exits with its code."""

    def __init__(self, error: Exception, rank: int, count: int, printed: bool = False):
        super().__init__(str(error))
        self.error, self.rank, self.count, self.printed = error, rank, count, printed


EXIT_USAGE, EXIT_FAILED = 2, 3  # as the reshard CLI: bad usage, the operation failed


def _exit_code(e: Exception) -> int:
    return EXIT_USAGE if isinstance(e, reshard.InvalidArgumentError) else EXIT_FAILED


def cli(argv=None) -> None:
    """`python -m reshard.train` / `python -m reshard.examples.train`: main(), then leave
    without interpreter teardown, as recipes/accelerate/train_accelerate.py does: on CPU/gloo a
    run now and then aborts in a C++ destructor at exit ("terminate called without an active
    exception") after all work, output and the process-group teardown are done; seen more often
    since checkpoints use object collectives (broadcast_object_list)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        code = main(argv)
    except JobError as e:
        # One line, from one rank, instead of a traceback per rank.
        if rank == e.rank and not e.printed:
            more = f" (and {e.count - 1} other rank(s))" if e.count > 1 else ""
            print(f"reshard.train: rank {e.rank}{more}: {e.error}", file=sys.stderr, flush=True)
        code = _exit_code(e.error)
    except reshard.ReshardError as e:  # the same on every rank (before the load): rank 0 says it
        if rank == 0:
            print(f"reshard.train: {e}", file=sys.stderr, flush=True)
        code = _exit_code(e)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
