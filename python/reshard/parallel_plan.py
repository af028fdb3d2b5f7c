"""Captures a parallel plan (formats/parallel-plan.md) from a tensor-parallel plan of a Hugging
Face model, translated into the DTensor placements torch's parallel styles give each module's
parameters:

| style | nn.Linear (weight [out, in], bias [out]) | nn.Embedding (weight [num, dim]) |
|---|---|---|
| `colwise`, `colwise_gather_output` (ColwiseParallel) | weight `S(0)`, bias `S(0)` | `S(1)` |
| `rowwise`, `embedding_rowwise` (RowwiseParallel) | weight `S(1)`, bias `R` | `S(0)` |

Two plans (`--tp-plan`):

* `transformers` (the default): transformers' own plan of the model: its config's
  `base_model_tp_plan` (under the base model's prefix) and the class's `_tp_plan` (the head).
  Any other style there (packed / fused experts, `moe_tp_experts`, local variants) is refused
  by name: its layout is not one placement per parameter, or not a DTensor.
* `torchtitan`: torchtitan's Llama tensor + sequence parallel plan (`apply_tp` of
  torchtitan/models/llama3/infra/parallelize.py) for a Hugging Face model of the Llama
  architecture (Llama, Mistral, Qwen2, Qwen3, ...). torchtitan's module names and the Hugging
  Face ones they are:

  | torchtitan | Hugging Face | style | placements on tp |
  |---|---|---|---|
  | `tok_embeddings` | `model.embed_tokens` | RowwiseParallel (input R, output S(1)) | weight `S(0)` (vocab) |
  | `layers.*.attention_norm` | `model.layers.*.input_layernorm` | SequenceParallel | `R` |
  | `layers.*.attention.wq`, `wk`, `wv` | `model.layers.*.self_attn.q_proj`, `k_proj`, `v_proj` | ColwiseParallel | weight `S(0)`, bias `S(0)` |
  | `layers.*.attention.wo` | `model.layers.*.self_attn.o_proj` | RowwiseParallel (output S(1)) | weight `S(1)`, bias `R` |
  | `layers.*.attention.q_norm`, `k_norm` | `model.layers.*.self_attn.q_norm`, `k_norm` (Qwen3) | SequenceParallel | `R` |
  | `layers.*.ffn_norm` | `model.layers.*.post_attention_layernorm` | SequenceParallel | `R` |
  | `layers.*.feed_forward.w1` | `model.layers.*.mlp.gate_proj` | ColwiseParallel | `S(0)` |
  | `layers.*.feed_forward.w3` | `model.layers.*.mlp.up_proj` | ColwiseParallel | `S(0)` |
  | `layers.*.feed_forward.w2` | `model.layers.*.mlp.down_proj` | RowwiseParallel (output S(1)) | `S(1)` |
  | `norm` | `model.norm` | SequenceParallel | `R` |
  | `output` | `lm_head` | ColwiseParallel (input S(1)) | weight `S(0)` (vocab) |

  SequenceParallel shards activations, not the norms' weights (they stay replicated): the plan
  has no rule for them, `R` on tp. A model lacking one of these modules is refused by name.

**Tied weights** (`tie_word_embeddings`: `lm_head.weight` is `model.embed_tokens.weight`): one
Parameter has one placement, `S(0)` (vocab) in both plans. torchtitan's gives both modules
`S(0)`; transformers' names `lm_head` colwise (`S(0)`) and, when the config ties the
embeddings, adds `embed_tokens: embedding_rowwise` (RowwiseParallel with replicated input and
output: `S(0)`, a vocab-parallel embedding; transformers' configuration_utils.py), and its
`from_pretrained(tp_plan=...)` keeps the one Parameter. The plan gives every name of a shared
parameter the placement the plan gives any of them, and refuses a plan that places two names of
one parameter differently (other than `R`), naming both. torch's `parallelize_module` gives each
module it parallelizes a new Parameter, untying them: `parallelize` below ties them again (and
reshard.load refuses a DTensor job whose tied names are two parameters).

    python -m reshard.parallel_plan SRC -o llama_tp.json [--tp-plan transformers|torchtitan] [--name llama_tp] [--fsdp dp_shard] [--tp-dim tp]
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
STYLES = {"colwise": "col", "colwise_gather_output": "col", "rowwise": "row", "embedding_rowwise": "row"}
TP_PLANS = ("transformers", "torchtitan")

# torchtitan's Llama plan (apply_tp) under Hugging Face module names; norms (SequenceParallel) stay R.
TORCHTITAN_LLAMA = {
    "model.embed_tokens": "rowwise",              # tok_embeddings
    "model.layers.*.self_attn.q_proj": "colwise",  # attention.wq
    "model.layers.*.self_attn.k_proj": "colwise",  # attention.wk
    "model.layers.*.self_attn.v_proj": "colwise",  # attention.wv
    "model.layers.*.self_attn.o_proj": "rowwise",  # attention.wo
    "model.layers.*.mlp.gate_proj": "colwise",     # feed_forward.w1
    "model.layers.*.mlp.up_proj": "colwise",       # feed_forward.w3
    "model.layers.*.mlp.down_proj": "rowwise",     # feed_forward.w2
    "lm_head": "colwise",                          # output
}


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


def torchtitan_tp_plan(model: nn.Module) -> Dict[str, str]:
    """torchtitan's Llama plan under `model`'s Hugging Face module names (TORCHTITAN_LLAMA).
    Raises ValueError naming a module of that plan the model lacks."""
    modules = dict(model.named_modules())
    for pattern in TORCHTITAN_LLAMA:
        rx = _module_regex(pattern)
        if not any(rx.match(m) for m in modules):
            raise ValueError(f"{type(model).__name__} has no module {pattern!r}: torchtitan's Llama tp plan "
                             "fits models of the Llama architecture (model.embed_tokens, model.layers.*.self_attn."
                             "{q,k,v,o}_proj, model.layers.*.mlp.{gate,up,down}_proj, lm_head); capture "
                             "transformers' plan instead: --tp-plan transformers")
    return dict(TORCHTITAN_LLAMA)


def _matches(pattern: str, name: str) -> bool:
    return _module_regex(pattern).match(name) is not None


def _tie_rules(model: nn.Module, rules: List[Dict[str, Any]], tp_dim: str, plan_name: str) -> List[Dict[str, Any]]:
    """Rules giving every name of a shared (tied) parameter the placement the plan gives any of
    them; ValueError when the plan places two names of one parameter differently."""
    names: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    extra: List[Dict[str, Any]] = []
    for group in names.values():
        if len(group) < 2:
            continue
        placed = {}
        for n in group:
            rule = next((r for r in rules if _matches(r["pattern"], n)), None)
            placed[n] = rule["placements"][tp_dim] if rule else "R"
        sharded = {n: pl for n, pl in placed.items() if pl != "R"}
        if len(set(sharded.values())) > 1:
            a, b = sorted(sharded)[:2]
            raise ValueError(f"{a} and {b} are one (tied) parameter, placed {sharded[a]} and {sharded[b]} on "
                             f"{tp_dim} by the {plan_name} plan: one parameter has one placement. Untie them "
                             "(config tie_word_embeddings=False) or place both alike")
        if sharded and len(sharded) < len(group):
            pl = next(iter(sharded.values()))
            extra += [{"pattern": n, "placements": {tp_dim: pl}} for n in group if n not in sharded]
    return extra + rules


def capture_plan(model: nn.Module, name: str, tp_dim: str = "tp", fsdp: Optional[str] = None,
                 tp_plan: str = "transformers") -> Dict[str, Any]:
    """The parallel plan of `model` (parameters may be on meta) under a tensor-parallel plan
    (`tp_plan`: "transformers", the model's own, or "torchtitan", torchtitan's Llama plan), its
    placements on mesh dim `tp_dim`; with `fsdp`, fully_shard over that mesh dim. Tied
    parameters: every name gets the placement of the one shared parameter. Raises ValueError
    naming the pattern and style that has no such plan."""
    if tp_plan not in TP_PLANS:
        raise ValueError(f"tp_plan {tp_plan!r}: expected one of {', '.join(TP_PLANS)}")
    if tp_plan == "torchtitan":
        tp = torchtitan_tp_plan(model)
    else:
        tp = transformers_tp_plan(model)
    if not tp:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in transformers "
                         "(config.base_model_tp_plan / _tp_plan); try --tp-plan torchtitan for a model "
                         "of the Llama architecture")
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
    rules = _tie_rules(model, rules, tp_dim, tp_plan)
    plan: Dict[str, Any] = {"format": FORMAT, "format_version": 1, "name": name, "rules": rules}
    if fsdp:
        plan["fsdp"] = {"mesh_dim": fsdp}
    return plan


def tied_groups(model: nn.Module) -> List[List[str]]:
    """The names transformers ties (the model's all_tied_weights_keys, e.g. lm_head.weight ->
    model.embed_tokens.weight under tie_word_embeddings), one list per tied group, the source
    first."""
    ties = getattr(model, "all_tied_weights_keys", None)
    pairs = list(ties.items()) if isinstance(ties, dict) else []
    groups: List[List[str]] = []
    for a, b in pairs:
        g = next((g for g in groups if a in g or b in g), None)
        if g is None:
            groups.append([b, a])
        else:
            g.extend(n for n in (a, b) if n not in g)
    return groups


def parallelize(model: nn.Module, tp_mesh) -> Dict[str, Any]:
    """Applies transformers' own tp plan of `model` with torch's styles over `tp_mesh` (colwise
    -> ColwiseParallel, rowwise -> RowwiseParallel, colwise_gather_output -> ColwiseParallel
    with replicated output, embedding_rowwise -> RowwiseParallel with replicated input and
    output), then ties tied parameters again: parallelize_module gave each parallelized module
    a new Parameter; every name of a tie points at one of them (same placements, as the plan
    makes them). Returns the parallelize_module plan applied. Call before fully_shard; the plan
    file to convert with is capture_plan(model, ...)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = transformers_tp_plan(model)
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    bad = {k: v for k, v in tp.items() if v not in make}
    if bad or not tp:
        raise ValueError(f"{type(model).__name__}: transformers' tp plan {bad or tp} has styles reshard does "
                         f"not apply with torch's styles (supported: {', '.join(sorted(make))})")
    # Column-wise q/k/v give each rank heads / tp heads: attention reshapes by whole heads.
    n = tp_mesh.size()
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % n:
            raise ValueError(f"{type(model).__name__}: config.{key} = {heads} is not divisible by the tensor-"
                             f"parallel size {n}: each rank must hold whole attention heads (choose a tp "
                             f"size that divides {heads})")
    plan = {k: make[v]() for k, v in tp.items()}
    groups = tied_groups(model)
    parallelize_module(model, tp_mesh, plan)
    for group in groups:
        params = [model.get_parameter(n) for n in group]
        placed = {str(getattr(p, "placements", "plain")) for p in params}
        if len(placed) > 1:
            raise ValueError(f"tied parameters {', '.join(group)} got placements {sorted(placed)} from "
                             "transformers' tp plan: one parameter has one placement")
        keep = params[-1]
        for n in group:
            owner, _, pname = n.rpartition(".")
            setattr(model.get_submodule(owner), pname, keep)
    return plan


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.parallel_plan",
                                 description="Write the parallel plan (formats/parallel-plan.md) of a Hugging Face "
                                             "model's tensor-parallel plan (transformers' own base_model_tp_plan "
                                             "and _tp_plan, or torchtitan's Llama plan with --tp-plan "
                                             "torchtitan), for reshard convert --mesh ... --plan FILE.")
    ap.add_argument("src", help="checkpoint directory (its config.json) or a model id in the local HF cache")
    ap.add_argument("-o", "--output", required=True, help="the plan file to write (NAME.json)")
    ap.add_argument("--name", default=None, help="the plan's name (default: the output file's stem)")
    ap.add_argument("--tp-dim", default="tp", help="the tensor-parallel mesh dim's name (default tp)")
    ap.add_argument("--tp-plan", choices=TP_PLANS, default="transformers",
                    help="whose tensor-parallel plan: transformers' own plan of the model (base_model_tp_plan, "
                         "_tp_plan), or torchtitan's Llama plan (apply_tp) under the Hugging Face names of a "
                         "Llama-architecture model")
    ap.add_argument("--fsdp", default=None, metavar="MESH_DIM",
                    help="fully_shard over this mesh dim too (e.g. dp_shard)")
    args = ap.parse_args(argv)
    import os

    from .model import empty_model

    name = args.name or os.path.splitext(os.path.basename(args.output))[0]
    try:
        plan = capture_plan(empty_model(args.src), name, args.tp_dim, args.fsdp, args.tp_plan)
    except ValueError as e:
        print(f"reshard.parallel_plan: error: {e}", file=sys.stderr)
        return 2
    tmp = f"{args.output}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(plan, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.output)
    whose = "transformers'" if args.tp_plan == "transformers" else "torchtitan's Llama"
    print(f"wrote {args.output}: {len(plan['rules'])} rule(s) from {whose} tp plan of {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
