"""Captures a model manifest (formats/model-manifest.md): the modules, parameter order, tied
parameters and buffers of a Hugging Face model, built on the meta device from its config.

FSDP1 flattens each wrapped unit's parameters in module registration order, which a checkpoint
does not record (safetensors keys are sorted), so `reshard convert --layout fsdp1` needs this.

    python -m reshard.model_manifest SRC -o OUT/reshard-model.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from torch import nn

FORMAT = "reshard.model"
FORMAT_VERSION = 2


def _no_split_modules(model: nn.Module) -> List[str]:
    names = getattr(model, "_no_split_modules", None) or []
    return sorted(set(names))


def model_manifest(model: nn.Module, checkpoint: Optional[str] = None,
                   quantized: str = "dequantize") -> Dict[str, Any]:
    """The manifest of `model` (any nn.Module; parameters may be on the meta device); with
    `checkpoint` (a Hugging Face checkpoint directory or weight file), also the conversion of
    its tensors into the model's names and shapes (reshard.conversion).

    An FP8 checkpoint (quantization_config quant_method "fp8") is captured under policy
    `quantized`: "dequantize" (the model from_pretrained builds without a GPU: FP8 weights
    dequantized to its dtype with their scales) or "keep" (the FP8 model: each weight and its
    weight_scale_inv as stored); `model` is prepared here by transformers' own quantizer."""
    quantizer = None
    if checkpoint is not None:
        from .conversion import fp8_config, mxfp4_config, mxfp4_quantizer_for, quantizer_for

        if mxfp4_config(model.config) is not None:
            # gpt-oss: dequantized to bfloat16 (the model stays as it is); keep is refused there.
            quantizer = mxfp4_quantizer_for(model.config, quantized)
        elif fp8_config(model.config) is not None:
            if quantized not in ("dequantize", "keep"):
                raise ValueError(f"quantized policy {quantized!r}: expected dequantize or keep")
            quantizer = quantizer_for(model.config, quantized)
            # keep: nn.Linear -> FP8Linear, experts -> FP8Experts, as from_pretrained on a GPU
            # (dequantize: the model stays as it is).
            quantizer._process_model_before_weight_loading(model)
    param_index: Dict[int, int] = {}
    params: List[Dict[str, Any]] = []
    modules: List[Dict[str, Any]] = []
    for mname, module in model.named_modules(remove_duplicate=False):
        entries = []
        for pname, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            idx = param_index.get(id(p))
            if idx is None:
                idx = param_index[id(p)] = len(params)
                params.append({"names": [fqn], "shape": list(p.shape)})
            elif fqn not in params[idx]["names"]:
                params[idx]["names"].append(fqn)
            entries.append([pname, idx])
        modules.append({"name": mname, "class": type(module).__name__, "params": entries})
    # Parameters the model never saves (transformers' _keys_to_ignore_on_save, exact names:
    # Marian's sinusoidal positions): from_pretrained computes them, and so does reshard.load.
    unsaved = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for p in params:
        if unsaved.intersection(p["names"]):
            p["unsaved"] = True
    persistent = set(model.state_dict().keys())
    buffers = [{"name": n, "shape": list(b.shape), "persistent": n in persistent}
               for n, b in model.named_buffers()]
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_class": type(model).__name__,
        "base_model_prefix": getattr(model, "base_model_prefix", "") or "",
        "no_split_modules": _no_split_modules(model),
        "modules": modules,
        "params": params,
        "buffers": buffers,
    }
    if checkpoint is not None:
        from . import _C
        from .conversion import capture_conversion

        out["conversion"] = capture_conversion(model, _C.checkpoint_tensors(checkpoint), hf_quantizer=quantizer,
                                               quantized_policy=quantized if quantizer else None)
    return out


def build_meta_model(src: str, model_class: Optional[str] = None) -> nn.Module:
    """The model of checkpoint directory `src` (its config.json) with meta parameters."""
    from .model import empty_model

    cls = None
    if model_class:
        import transformers

        cls = getattr(transformers, model_class, None)
        if cls is None:
            raise SystemExit(f"transformers has no class {model_class}")
    return empty_model(src, model_class=cls)


def write_manifest(manifest: Dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m reshard.model_manifest",
        description="Record a Hugging Face model's modules, parameter order, tied parameters and "
                    "buffers (built on the meta device from SRC/config.json, no weights read) "
                    "for `reshard convert --layout fsdp1`.",
        epilog="Example: python -m reshard.model_manifest ./Llama-3.1-8B -o ./shards/reshard-model.json\n"
               "         reshard convert ./Llama-3.1-8B -o ./shards --world-size 8 --layout fsdp1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", metavar="SRC", help="checkpoint directory with config.json")
    ap.add_argument("-o", "--out", required=True,
                    help="manifest file to write (convert looks for SRC/ or OUT/reshard-model.json)")
    ap.add_argument("--model-class", default=None,
                    help="transformers class to build (default: config.architectures[0])")
    ap.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                    help="an FP8 checkpoint (quantization_config quant_method fp8): dequantize its "
                         "weights at convert exactly as from_pretrained does without a GPU (default), "
                         "or keep each FP8 weight with its weight_scale_inv as stored, in the FP8 "
                         "model's names (then convert with --dtype keep)")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.src, "config.json")):
        print(f"{args.src}: no config.json; a Hugging Face checkpoint directory is needed",
              file=sys.stderr)
        return 3
    # A checkpoint reshard.save wrote holds the model's own names and no Hugging Face weight
    # files: nothing to convert, so no conversion is captured. A conversion's output is not its
    # source: the Hugging Face checkpoint it came from is what to pass (the names it converts).
    from .errors import ReshardError

    hf_weights = any(n.endswith((".safetensors", ".bin", ".index.json")) for n in os.listdir(args.src))
    own_names = False
    if not hf_weights and os.path.exists(os.path.join(args.src, "reshard.json")):
        from .layout import read_manifest

        try:
            own_names = "saved" in (read_manifest(args.src) or {}).get("source", {})
        except ReshardError:
            own_names = False
        if not own_names:
            print(f"python -m reshard.model_manifest: {args.src} is the output of reshard convert, not a "
                  "checkpoint: pass the Hugging Face checkpoint it was converted from (its weight names are "
                  f"what the manifest records), e.g. python -m reshard.model_manifest HF_DIR -o "
                  f"{os.path.join(args.src, 'reshard-model.json')}", file=sys.stderr)
            return 3
    try:
        model = build_meta_model(args.src, args.model_class)
        m = model_manifest(model, checkpoint=None if own_names else args.src, quantized=args.quantized)
    except (ReshardError, ValueError, OSError) as e:  # ValueError: transformers on a config it cannot build
        print(f"python -m reshard.model_manifest: {args.src}: {e}" if str(args.src) not in str(e)
              else f"python -m reshard.model_manifest: {e}", file=sys.stderr)
        return 3
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_manifest(m, args.out)
    conv = m.get("conversion", {"targets": [], "refused": []})
    print(f"wrote {args.out}: {m['model_class']}, {len(m['params'])} parameters, "
          f"{len(m['modules'])} modules, default wrap {m['no_split_modules'] or '(root only)'}, "
          + (f"{len(conv['targets'])} tensor(s) converted from the checkpoint's names" if not own_names
             else "the checkpoint holds the model's own names (a reshard output): no conversion")
          + (f", {len(conv['refused'])} refused" if conv["refused"] else "")
          + (f", FP8 weights: {conv['quantization']['policy']}" if conv.get("quantization") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
