"""Captures a parallel plan (formats/parallel-plan.md) from transformers' own tensor-parallel
plan of a model: its config's `base_model_tp_plan` (under the base model's prefix) and the
class's `_tp_plan` (the head), each module-name pattern with a style, translated into the
DTensor placements torch's parallel styles give that module's parameters:

| style | nn.Linear (weight [out, in], bias [out]) | nn.Embedding (weight [num, dim]) |
|---|---|---|
| `colwise`, `colwise_gather_output` (ColwiseParallel) | weight `S(0)`, bias `S(0)` | `S(1)` |
| `rowwise` (RowwiseParallel) | weight `S(1)`, bias `R` | `S(0)` |

Any other style (packed / fused experts, `moe_tp_experts`, sequence parallel on norms, local
variants) is refused by name: its layout is not one placement per parameter, or not a DTensor.

    python -m reshard.parallel_plan SRC -o llama_tp.json [--name llama_tp] [--fsdp dp_shard] [--tp-dim tp]
    reshard convert SRC -o OUT --mesh dp_shard=2,tp=4 --plan llama_tp.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Dict, List, Optional

from torch import nn

FORMAT = "reshard.parallel-plan"
STYLES = {"colwise": "col", "colwise_gather_output": "col", "rowwise": "row"}


def _module_regex(pattern: str) -> "re.Pattern[str]":
    # transformers' plan patterns: '*' is one dotted component (a layer index).
    return re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")


def _placement(style: str, module: nn.Module, pname: str, where: str) -> Optional[str]:
    kind = STYLES[style]
    if isinstance(module, nn.Embedding):
        if pname != "weight":
            return None
        return "S(1)" if kind == "col" else "S(0)"
    if isinstance(module, nn.Linear):
        if pname == "weight":
            return "S(0)" if kind == "col" else "S(1)"
        if pname == "bias":
            return "S(0)" if kind == "col" else "R"
        return None
    raise ValueError(f"{where}: style {style!r} on a {type(module).__name__}; reshard translates "
                     "transformers' tensor-parallel styles on nn.Linear and nn.Embedding only")


def transformers_tp_plan(model: nn.Module) -> Dict[str, str]:
    """transformers' module-name pattern -> style for `model` (its full names): the base model's
    plan under its prefix, then the head's."""
    plan: Dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    for pattern, style in base.items():
        plan[f"{prefix}.{pattern}" if prefix and hasattr(model, prefix) else pattern] = style
    for pattern, style in (getattr(model, "_tp_plan", None) or {}).items():
        plan[pattern] = style
    return plan


def capture_plan(model: nn.Module, name: str, tp_dim: str = "tp", fsdp: Optional[str] = None) -> Dict[str, Any]:
    """The parallel plan of `model` (parameters may be on meta) under transformers' tensor-parallel
    plan, its placements on mesh dim `tp_dim`; with `fsdp`, fully_shard over that mesh dim.
    Raises ValueError naming the pattern and style transformers uses that has no such plan."""
    tp = transformers_tp_plan(model)
    if not tp:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in transformers "
                         "(config.base_model_tp_plan / _tp_plan)")
    for pattern, style in tp.items():
        if style not in STYLES:
            raise ValueError(f"{type(model).__name__}: transformers' tp plan gives {pattern!r} the style "
                             f"{style!r}, which is not one DTensor placement per parameter (supported: "
                             f"{', '.join(sorted(STYLES))})")
    modules = dict(model.named_modules())
    rules: List[Dict[str, Any]] = []
    seen = set()
    for pattern, style in tp.items():
        rx = _module_regex(pattern)
        matched = [m for m in modules if rx.match(m)]
        if not matched:
            continue
        # One rule per parameter pattern (the pattern's '*' kept): every match of one class.
        odd = next((m for m in matched[1:] if type(modules[m]) is not type(modules[matched[0]])), None)
        if odd is not None:
            raise ValueError(f"{pattern!r} matches modules of two classes ({matched[0]}, {odd})")
        for pname, _ in modules[matched[0]].named_parameters(recurse=False):
            placement = _placement(style, modules[matched[0]], pname, pattern)
            key = f"{pattern}.{pname}"
            if placement is None or placement == "R" or key in seen:
                continue
            seen.add(key)
            rules.append({"pattern": key, "placements": {tp_dim: placement}})
    plan: Dict[str, Any] = {"format": FORMAT, "format_version": 1, "name": name, "rules": rules}
    if fsdp:
        plan["fsdp"] = {"mesh_dim": fsdp}
    return plan


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.parallel_plan",
                                 description="Write the parallel plan (formats/parallel-plan.md) of a Hugging Face "
                                             "model's own tensor-parallel plan (transformers' base_model_tp_plan "
                                             "and _tp_plan), for reshard convert --mesh ... --plan FILE.")
    ap.add_argument("src", help="checkpoint directory (its config.json) or a model id in the local HF cache")
    ap.add_argument("-o", "--output", required=True, help="the plan file to write (NAME.json)")
    ap.add_argument("--name", default=None, help="the plan's name (default: the output file's stem)")
    ap.add_argument("--tp-dim", default="tp", help="the tensor-parallel mesh dim's name (default tp)")
    ap.add_argument("--fsdp", default=None, metavar="MESH_DIM",
                    help="fully_shard over this mesh dim too (e.g. dp_shard)")
    args = ap.parse_args(argv)
    import os

    from .model import empty_model

    name = args.name or os.path.splitext(os.path.basename(args.output))[0]
    try:
        plan = capture_plan(empty_model(args.src), name, args.tp_dim, args.fsdp)
    except ValueError as e:
        print(f"reshard.parallel_plan: error: {e}", file=sys.stderr)
        return 2
    tmp = f"{args.output}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(plan, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {len(plan['rules'])} rule(s) from transformers' tp plan of "
          f"{args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
