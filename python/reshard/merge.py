"""`reshard export SAVED -o DIR --merge [--base OUT]`: a PEFT (LoRA) model's trained adapters
merged into its base weights, written as an ordinary Hugging Face checkpoint that
`from_pretrained(DIR)` loads equal, bit for bit, to `merge_and_unload()` of the trained PEFT
model (on a CPU, with this torch).

The CLI links no torch, and the merge must be PEFT's own arithmetic (torch's matmul), so the CLI
runs `python -m reshard.merge` ($RESHARD_PYTHON, default python3), which:

1. finds the base: `--base OUT`, else the save itself when it holds the base
   (`reshard.save(..., base=True)`), else the reshard output directory the job loaded the base
   from, as the save records it (OUT/reshard-adapter.json, formats/manifest.md);
2. exports the base layout as `reshard export` does (the C++ core, streaming chunk by chunk,
   config and tokenizer files included) into a hidden directory beside DIR;
3. reads the adapters (small: r rows or columns per target) and, one target at a time, reads
   its base weight from the exported safetensors file, adds the delta exactly as peft 0.21's
   `LoraLayer.merge` does, and writes it back in place (same dtype, same bytes count);
4. renames the hidden directory to DIR.

Host memory: one base weight, its delta in float32, and the adapters. Not less: the product
`B[rows] @ A` of a block of rows does not give the bits of those rows of `B @ A` (measured with
torch 2.11's MKL on CPU: 123 of 599 row and column blocks of 10 shapes differed, e.g. 64x64
r=8 over 7 blocks, 33x4096 r=128 over 2-8 blocks; the library picks other kernels for other
shapes), so each delta is computed whole, as PEFT computes it. Bit-exactness holds against
merge_and_unload() run with the same torch build on the same kind of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from typing import Dict, List, Optional, Tuple

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_RECORD = "reshard-adapter.json"  # formats/manifest.md, *Saved checkpoints*, PEFT
PEFT_PREFIX = "base_model.model."        # PEFT's saved keys: PeftModel.base_model (LoraModel).model

# LoRA variants whose merge is not vanilla LoRA's delta (their config keys, when set).
_VARIANT_KEYS = ("use_dora", "lora_bias", "use_bdlora", "alora_invocation_tokens", "arrow_config",
                 "velora_config", "monteclora_config", "mica", "kasa_config")


def read_record(out: str) -> Optional[dict]:
    """OUT/reshard-adapter.json when OUT's manifest lists it, else None."""
    from .errors import CorruptFileError
    from .layout import read_manifest

    manifest = read_manifest(out) or {}
    if ADAPTER_RECORD not in manifest.get("aux_files", []):
        return None
    path = os.path.join(out, ADAPTER_RECORD)
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(rec, dict) or rec.get("format") != "reshard.adapter" or \
            not isinstance(rec.get("adapter_tensors"), list) or not isinstance(rec.get("base"), dict):
        raise CorruptFileError(f"{path}: not a reshard.adapter record (format, adapter_tensors, base)")
    return rec


def _within(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _pick_layout(out: str, manifest: dict, wanted: Optional[str], prefer: Optional[str], flag: str) -> str:
    from .errors import InvalidArgumentError, NotFoundError

    layouts = manifest.get("layouts", {})
    if wanted:
        if wanted not in layouts:
            raise NotFoundError(f"{out}: no layout \"{wanted}\" (it holds: {', '.join(sorted(layouts)) or 'none'})")
        return wanted
    if len(layouts) == 1:
        return next(iter(layouts))
    if prefer in layouts:
        return prefer
    raise InvalidArgumentError(f"{out} holds {len(layouts)} layouts ({', '.join(sorted(layouts))}); "
                               f"pick one with {flag} KEY")


def read_adapter_tensors(out: str, key: str, names: List[str], threads: int):
    """Every tensor of `names` whole (CPU), from layout KEY of OUT: each rank file checked
    against the manifest, its rows copied into place, checksums checked."""
    import torch

    from . import _C
    from .errors import LayoutMismatchError
    from .layout import read_manifest, torch_dtype

    layout = read_manifest(out)["layouts"][key]
    full: Dict[str, "torch.Tensor"] = {}
    wanted = set(names)
    for r in layout["ranks"]:
        path = os.path.join(out, layout["dir"], r["file"])
        f = _C.RankFile.open(path)
        f.check_listed(out, key, r["rank"])
        targets = []
        for e in f.tensors:
            if e.name not in wanted:
                continue
            t = full.get(e.name)
            if t is None:
                t = full[e.name] = torch.empty(list(e.global_shape), dtype=torch_dtype(e.dtype))
            rows = e.shard
            part = t if rows is None else t[rows[0]:rows[1]]
            if list(part.shape) != list(e.local_shape):
                raise LayoutMismatchError(f"{path}: tensor {e.name}: local shape {list(e.local_shape)}, "
                                          f"expected {list(part.shape)}")
            if e.nbytes:
                targets.append(_C.LoadTarget(e.name, part.data_ptr(), e.nbytes, False))
        if targets:
            f.load(targets, device=0, threads=threads, verify=True)
    absent = sorted(wanted - set(full))
    if absent:
        raise LayoutMismatchError(f"{out}: layout {key} has no tensor {', '.join(absent[:4])}")
    return full


class _Targets:
    """The LoRA targets of an adapter: module key -> (kind, A, B), from PEFT's saved keys."""

    def __init__(self, tensors, saved: str):
        from .errors import UnsupportedError

        self.modules: Dict[str, Dict[str, object]] = {}
        for k, t in tensors.items():
            for suffix, kind, part in ((".lora_A.weight", "linear", "A"), (".lora_B.weight", "linear", "B"),
                                       (".lora_embedding_A", "embedding", "A"),
                                       (".lora_embedding_B", "embedding", "B")):
                if k.endswith(suffix):
                    m = self.modules.setdefault(k[:-len(suffix)], {"kind": kind})
                    if m["kind"] != kind:
                        raise UnsupportedError(f"{saved}: {k}: both Linear and Embedding LoRA tensors")
                    m[part] = t
                    break
            else:
                raise UnsupportedError(
                    f"{saved}: adapter tensor {k} is not LoRA's A or B (lora_A/lora_B, lora_embedding_A/B): "
                    "--merge merges vanilla LoRA adapters only (DoRA magnitudes, LoRA biases and other "
                    "variants are not merged)")
        for key, m in self.modules.items():
            if "A" not in m or "B" not in m:
                raise UnsupportedError(f"{saved}: module {key} has only one of LoRA's A and B")
            if m["A"].dim() != 2:
                raise UnsupportedError(f"{saved}: module {key}: LoRA on a convolution (A has "
                                       f"{m['A'].dim()} dims); --merge merges Linear and Embedding targets")


def _scaling(cfg: dict, module_key: str, r_found: int, saved: str) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with rank_pattern / alpha_pattern looked up
    for the module by PEFT's own get_pattern_key, as LoraModel._create_and_replace does."""
    import math

    from .errors import LayoutMismatchError

    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if rank_pattern or alpha_pattern:  # PEFT's own matching (importing peft takes seconds)
        from peft.utils.other import get_pattern_key

        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module_key), r)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module_key), alpha)
    if r != r_found:
        raise LayoutMismatchError(f"{saved}: module {module_key}: its adapter has rank {r_found}, "
                                  f"{ADAPTER_CONFIG} says r={r}")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def delta_weight(kind: str, A, B, scaling: float, fan_in_fan_out: bool):
    """The delta peft 0.21's get_delta_weight computes on a CPU (Linear: dtype of B;
    Embedding: of A): (b)float16 factors in float32, `transpose(B @ A, fan_in_fan_out) *
    scaling`, cast back."""
    import torch

    dtype = B.dtype if kind == "linear" else A.dtype
    cast = dtype in (torch.float16, torch.bfloat16)
    if cast:
        A, B = A.float(), B.float()
    out = B @ A
    if kind == "embedding" or fan_in_fan_out:
        out = out.T
    out = out.mul_(scaling)  # in place: the bits of PEFT's `out * scaling`, one float32 tensor less
    return out.to(dtype) if cast else out


def merge_into(weight, kind: str, delta) -> None:
    """In place, as LoraLayer.merge (safe_merge=False): Linear `weight += delta` (torch's type
    promotion: a float32 delta is added to a bfloat16 weight in float32, rounded once);
    Embedding `weight += delta.to(weight.dtype)`."""
    if kind == "embedding":
        delta = delta.to(weight.dtype)
    weight += delta


# ---- the exported checkpoint, tensor by tensor --------------------------------------------------


def _safetensors_index(hf_dir: str) -> Dict[str, Tuple[str, int, str, List[int], int]]:
    """name -> (file, absolute data offset, dtype, shape, nbytes) of an exported checkpoint."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    where = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            where[k] = (path, 8 + n + a, v["dtype"], v["shape"], b - a)
    return where


def _pread_into(fd: int, t, offset: int) -> None:
    view = memoryview(t.view(-1).view(__import__("torch").uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += n


def _pwrite_from(fd: int, t, offset: int) -> None:
    view = memoryview(t.contiguous().view(-1).view(__import__("torch").uint8).numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def target_plan(targets: "_Targets", have: Dict[str, Tuple[str, List[int]]], cfg: dict, saved: str,
                base: str) -> list:
    """(weight name, kind, A, B, scaling) of every target, checked against the base's tensors
    `have` (name -> (dtype, shape)): each target's weight must be there, floating, with the shape
    the adapter implies (errors name SAVED and BASE)."""
    from .errors import LayoutMismatchError, UnsupportedError

    fan_in_fan_out = bool(cfg.get("fan_in_fan_out"))
    plan = []
    for key in sorted(targets.modules):
        m = targets.modules[key]
        if not key.startswith(PEFT_PREFIX):
            raise LayoutMismatchError(f"{saved}: adapter module {key} is not under {PEFT_PREFIX!r} "
                                      "(PEFT's saved names)")
        hf_key = key[len(PEFT_PREFIX):]
        name = hf_key + ".weight"
        A, B = m["A"], m["B"]
        if m["kind"] == "linear":
            shape = [B.shape[0], A.shape[1]]
            if fan_in_fan_out:
                shape.reverse()
        else:
            shape = [A.shape[1], B.shape[0]]
        if name not in have:
            raise LayoutMismatchError(
                f"the adapters of {saved} target {hf_key}, whose weight {name} the base {base} does not "
                "hold: adapters of another model (or of a weight tied to another, which the base stores "
                "once); pass the base they were trained on with --base OUT")
        dtype, found = have[name]
        if list(found) != shape:
            raise LayoutMismatchError(
                f"the adapters of {saved} need {name} of shape {shape}, the base {base} has {list(found)}: "
                "adapters trained on another model; pass the base they were trained on with --base OUT")
        if dtype not in ("F32", "BF16", "F16", "F64"):
            raise UnsupportedError(f"{base}: {name} is {dtype}; --merge merges into floating weights")
        plan.append((name, m["kind"], A, B, _scaling(cfg, hf_key, A.shape[0], saved)))
    return plan


def merge_checkpoint(hf_dir: str, plan: list, fan_in_fan_out: bool) -> int:
    """Merges every target of `plan` into the exported checkpoint HF_DIR in place, one weight
    at a time (read, merged, written back, the files fsynced); returns how many."""
    import torch

    from .errors import LayoutMismatchError
    from .layout import torch_dtype

    where = _safetensors_index(hf_dir)
    fds: Dict[str, int] = {}
    try:
        for name, kind, A, B, scaling in plan:
            if name not in where:
                raise LayoutMismatchError(f"{hf_dir}: the export holds no {name}")
            path, offset, dtype, shape, _ = where[name]
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDWR)
            w = torch.empty(shape, dtype=torch_dtype(dtype))
            _pread_into(fd, w, offset)
            merge_into(w, kind, delta_weight(kind, A, B, scaling, fan_in_fan_out))
            _pwrite_from(fd, w, offset)
            del w
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return len(plan)


def _publish(staging: str, hf_dir: str, force: bool) -> None:
    from .errors import InvalidArgumentError

    if os.path.lexists(hf_dir):
        if os.path.isdir(hf_dir) and not os.listdir(hf_dir):
            os.rmdir(hf_dir)
        elif not force:
            raise InvalidArgumentError(f"{hf_dir}: appeared and is not empty; pass --force to replace it")
        else:
            aside = staging + ".old"
            os.rename(hf_dir, aside)
            os.rename(staging, hf_dir)
            shutil.rmtree(aside, ignore_errors=True)
            return
    os.rename(staging, hf_dir)
    fd = os.open(os.path.dirname(hf_dir) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_base(saved: str, record: Optional[dict], base: Optional[str]) -> Tuple[str, bool]:
    """(the base's reshard output directory, whether it is SAVED itself)."""
    from .errors import InvalidArgumentError, LayoutMismatchError, NotFoundError
    from .layout import read_manifest

    stored = bool(record and record["base"].get("stored"))
    if base is None:
        if stored:
            return saved, True
        recorded = record and record["base"].get("out")
        if not recorded:
            raise InvalidArgumentError(
                f"{saved} holds the adapters only and does not record the base they were trained on: "
                "pass --base OUT (the reshard output directory the job loaded the base from)")
        if read_manifest(recorded) is None:
            raise NotFoundError(
                f"{saved} records its base as {recorded}, which is not a reshard output directory (any "
                "more): pass --base OUT")
        base = recorded
    base = os.path.abspath(base)
    manifest = read_manifest(base)
    if manifest is None:
        raise NotFoundError(f"--base {base}: no reshard.json: not a reshard output directory (convert the "
                            "base checkpoint with reshard convert first)")
    if os.path.realpath(base) == os.path.realpath(saved):
        if not stored:
            raise InvalidArgumentError(f"--base {base} is the adapter save itself, which does not hold the "
                                       "base (reshard.save(..., base=True) writes it)")
        return saved, True
    base_record = read_record(base)
    if ADAPTER_CONFIG in manifest.get("aux_files", []) and not (base_record and base_record["base"].get("stored")):
        raise InvalidArgumentError(f"--base {base} is itself a save of adapters without the base: pass the "
                                   "base model's reshard output directory")
    want = record and record["base"].get("source")
    if want is not None and manifest.get("source") != want:
        raise LayoutMismatchError(
            f"--base {base} is not the base the adapters of {saved} were trained on: its source is "
            f"{json.dumps(manifest.get('source'), sort_keys=True)}, the save records "
            f"{json.dumps(want, sort_keys=True)} (from {record['base'].get('out')})")
    return base, False


def run(args) -> dict:
    import torch  # noqa: F401 - fail here, before anything is written, when torch is missing

    from . import _C
    from .errors import InvalidArgumentError, NotFoundError
    from .layout import read_manifest

    saved = os.path.abspath(args.saved)
    hf_dir = os.path.abspath(args.out)
    manifest = read_manifest(saved)
    if manifest is None:
        raise NotFoundError(f"{saved}: no reshard.json: not a reshard output directory")
    if ADAPTER_CONFIG not in manifest.get("aux_files", []):
        raise InvalidArgumentError(
            f"{saved}: --merge, but its manifest lists no {ADAPTER_CONFIG}: not a save of a PEFT model's "
            "adapters (reshard.save of a PEFT model writes one); a model exports without --merge")
    record = read_record(saved)
    key = _pick_layout(saved, manifest, args.layout, None, "--layout")
    base, stored = resolve_base(saved, record, args.base)
    for src in {saved, base}:
        if _within(hf_dir, src) or _within(src, hf_dir):
            raise InvalidArgumentError(f"{hf_dir}: the output directory must lie outside {src} (and not contain it)")
    if os.path.lexists(hf_dir):
        if not os.path.isdir(hf_dir):
            raise InvalidArgumentError(f"{hf_dir}: exists and is not a directory")
        if os.listdir(hf_dir) and not args.force:
            raise InvalidArgumentError(f"{hf_dir}: exists and is not empty; pass --force to replace it")
    with open(os.path.join(saved, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        from .errors import UnsupportedError

        raise UnsupportedError(f"{os.path.join(saved, ADAPTER_CONFIG)}: peft_type {cfg.get('peft_type')!r}; "
                               "--merge merges LORA adapters")
    variants = [k for k in _VARIANT_KEYS if cfg.get(k)]
    if variants:
        from .errors import UnsupportedError

        raise UnsupportedError(f"{os.path.join(saved, ADAPTER_CONFIG)}: {', '.join(variants)} set: --merge "
                               "merges vanilla LoRA only (export the adapters with --adapter and merge them "
                               "with PEFT's merge_and_unload)")
    if record is not None:
        names = list(record["adapter_tensors"])
    else:
        layout = manifest["layouts"][key]
        first = _C.RankFile.open(os.path.join(saved, layout["dir"], layout["ranks"][0]["file"]))
        names = [t.name for t in first.tensors]
    threads = args.threads or os.cpu_count() or 1
    targets = _Targets(read_adapter_tensors(saved, key, names, threads), saved)

    base_manifest = read_manifest(base)
    base_key = key if stored else _pick_layout(base, base_manifest, args.base_layout, key, "--base-layout")
    base_layout = base_manifest["layouts"][base_key]
    first = _C.RankFile.open(os.path.join(base, base_layout["dir"], base_layout["ranks"][0]["file"]))
    have = {t.name: (t.dtype, list(t.global_shape)) for t in first.tensors}
    plan = target_plan(targets, have, cfg, saved, base)  # checked before anything is written
    parent = os.path.dirname(hf_dir)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(hf_dir)}.merge-tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        exported = _C.export(base, staging, layout=base_key, max_shard_size=args.max_shard_size,
                             threads=args.threads or 0)
        merged = merge_checkpoint(staging, plan, bool(cfg.get("fan_in_fan_out")))
        _publish(staging, hf_dir, args.force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"hf_dir": hf_dir, "saved": saved, "layout": key, "base": base, "base_layout": base_key,
            "base_stored": stored, "merged": merged, "tensors": exported["tensors"],
            "weight_files": exported["weight_files"], "total_size": exported["total_size"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="reshard export --merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("saved")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--base", default=None)
    ap.add_argument("--layout", default=None)
    ap.add_argument("--base-layout", default=None)
    ap.add_argument("--max-shard-size", type=int, default=5_000_000_000)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        from .errors import ReshardError
    except ImportError as e:  # pragma: no cover - the package itself half-installed
        print(f"reshard: error: export --merge needs the reshard package and torch in this Python "
              f"({sys.executable}): {e}", file=sys.stderr)
        return 3
    try:
        r = run(args)
    except ReshardError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 2 if e.code == "invalid_argument" else 3
    except ImportError as e:
        print(f"reshard: error: export --merge runs PEFT's merge arithmetic in Python ({sys.executable}), "
              f"which cannot import {e.name or e}: pip install torch safetensors peft there, or set "
              "RESHARD_PYTHON to the training environment's python", file=sys.stderr)
        return 3
    except OSError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 3
    except Exception:  # noqa: BLE001 - exit 1 means to the CLI that the package did not start
        import traceback

        traceback.print_exc()
        return 3
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        where = "the save itself" if r["base_stored"] else r["base"]
        print(f"wrote the merged model into {r['hf_dir']}: {r['merged']} LoRA target(s) of {r['saved']} merged "
              f"into the base from {where} (layout {r['base_layout']}); {r['tensors']} tensors, "
              f"{len(r['weight_files'])} weight file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
