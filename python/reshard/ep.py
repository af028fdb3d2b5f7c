"""Expert parallel for a Hugging Face mixture-of-experts model, arranged as torchtitan arranges it
on torch 2.11 (what reshard.load / reshard.save read and write for such a job, load_ep.py): the
world mesh unflattened into a dense 1-D mesh ``fsdp`` of every rank and a sparse one
``efsdp x ep`` over the same ranks; each fused experts module (transformers' ``MixtralExperts``
and its kind: ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) has its parameters
distributed ``Shard(0)`` over ``ep`` and is ``fully_shard``'ed over ``efsdp`` (its own FSDP2
unit) on tensor dim 0, or on dim 1 (``shard_placement_fn=lambda p: Shard(1)``) when efsdp x ep
exceeds the number of experts, as torchtitan's ``apply_fsdp`` does (dim 0 would then leave ranks
empty or uneven expert shards; experts_shard_dim); every module of the model's
``_no_split_modules`` and the root are ``fully_shard``'ed over ``fsdp``. Each experts module
then runs only this rank's experts on the tokens routed to them, the shares summed over ``ep``
(every rank of an ep group must be given the same batch):

    dense, sparse = reshard.ep.meshes("cuda", world_size, ep)
    model = reshard.empty_model(OUT)
    reshard.ep.parallelize(model, dense, sparse, mp_policy=...)   # before to_empty
    model.to_empty(device="cuda")
    reshard.load(model, OUT)

``python -m reshard.ep SRC -o PLAN.json --world-size W --ep N`` writes the plan file
(formats/parallel-plan.md) of the experts' placements on that job (``"fsdp_dim": 1`` in their
rules when torchtitan's rule shards them on dim 1), for ``reshard convert SRC -o OUT --mesh
efsdp=E,ep=N --plan PLAN.json`` (with ``reshard convert SRC -o OUT --world-size W`` for the
dense parameters: the two layouts a job reads as stored)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import UnsupportedError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def meshes(device_type: str, world_size: int, ep: int, names=("fsdp", "efsdp", "ep")):
    """(dense, sparse): the 1-D mesh ``fsdp`` of every rank and the 2-D mesh ``efsdp x ep``
    (efsdp = world_size / ep) over the same ranks, unflattened from one world mesh (ranks
    r * ep .. r * ep + ep - 1 form one ep group). Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep < 1 or world_size % ep:
        raise ValueError(f"expert-parallel size {ep}: the world size {world_size} is not a multiple of it")
    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (world_size,), (names[0],))[names[0]]
    sparse = world._unflatten(0, (world_size // ep, ep), (names[1], names[2]))
    return dense, sparse


def _model_name(model: nn.Module) -> str:
    return type(model).__name__.removeprefix("FSDP")


def fused_experts(model: nn.Module, ep: Optional[int] = None) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every fused experts module of `model`: direct parameters exactly
    ``gate_up_proj`` and ``down_proj``, 3-D, one row per expert, gated and concatenated as
    transformers' default (``has_gate``, no bias, not transposed). Raises UnsupportedError
    naming the model class when there is none, when one is of another kind, or when `ep` does
    not divide the number of experts."""
    found = []
    for name, m in model.named_modules():
        own = dict(m.named_parameters(recurse=False))
        if not any(k in own for k in EXPERT_PARAMS):
            continue
        what = f"{_model_name(model)}: {name} ({type(m).__name__})"
        if set(own) != set(EXPERT_PARAMS) or any(own[k].dim() != 3 for k in EXPERT_PARAMS):
            shapes = {k: list(p.shape) for k, p in own.items()}
            raise UnsupportedError(f"{what} has parameters {shapes}; expert parallel runs fused experts whose "
                                   "parameters are exactly gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
        flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
        odd = {k: getattr(m, k) for k, v in flags.items() if getattr(m, k, v) != v}
        if odd or not hasattr(m, "act_fn"):
            raise UnsupportedError(f"{what}: experts {odd or 'without act_fn'} are not run by reshard's "
                                   "expert-parallel forward (gated, concatenated, no bias, not transposed)")
        e = own["gate_up_proj"].shape[0]
        if own["down_proj"].shape[0] != e:
            raise UnsupportedError(f"{what}: gate_up_proj has {e} experts, down_proj {own['down_proj'].shape[0]}")
        if ep is not None and e % ep:
            raise UnsupportedError(f"{what} has {e} experts, not divisible by the expert-parallel size {ep} "
                                   f"(--ep {ep}): each rank of an ep group holds whole experts, as many as "
                                   "the others")
        found.append((name, m))
    if not found:
        raise UnsupportedError(f"{_model_name(model)} has no fused experts (modules with parameters gate_up_proj "
                               "and down_proj, as transformers' MixtralExperts): expert parallel (--ep) needs a "
                               "mixture-of-experts model")
    return found


def experts_shard_dim(num_experts: int, efsdp: int, ep: int, experts_fsdp_dim: Optional[int] = None) -> int:
    """The tensor dim fully_shard shards fused experts on over efsdp: `experts_fsdp_dim` when
    given (0 or 1), else torchtitan's rule (``apply_fsdp`` of its MoE models): 1 when
    ``efsdp * ep > num_experts`` (``shard_placement_fn=lambda p: Shard(1)``: on dim 0 the ep
    shard's few experts would leave efsdp ranks empty or uneven), else 0 (FSDP2's default)."""
    if experts_fsdp_dim is not None:
        if experts_fsdp_dim not in (0, 1):
            raise ValueError(f"experts_fsdp_dim {experts_fsdp_dim!r}: the experts are fully_shard'ed on tensor "
                             "dim 0 (the experts) or 1 (torchtitan's Shard(1)); None: torchtitan's rule")
        return experts_fsdp_dim
    return 1 if efsdp * ep > num_experts else 0


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (in fp32); backward: identity (every rank of the group
    holds the whole gradient of the sum, the ranks computing the same loss)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.float()
        dist.all_reduce(y, group=group)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradOverGroup(torch.autograd.Function):
    """Forward: identity; backward: the sum over the group of every rank's partial gradient
    (each rank's experts contribute their own tokens' share)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        g = grad.float().contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.to(grad.dtype), None


def expert_parallel_forward(experts: nn.Module, ep_mesh):
    """A forward for a fused experts module whose parameters are Shard(0) over `ep_mesh`: this
    rank's experts only (global ids start .. start + local - 1), each on the tokens routed to
    it, the outputs summed over `ep_mesh`. Every rank of the ep group must see the same tokens."""
    group = ep_mesh.get_group()
    coord = ep_mesh.get_local_rank()
    gate = getattr(experts, "_apply_gate", None)

    def forward(hidden_states, top_k_index, top_k_weights):
        w_gate_up = experts.gate_up_proj.to_local()
        w_down = experts.down_proj.to_local()
        local = w_gate_up.shape[0]
        start = coord * local  # Shard(0) of a count ep divides: equal chunks
        hidden_states = _SumGradOverGroup.apply(hidden_states, group)
        top_k_weights = _SumGradOverGroup.apply(top_k_weights, group)
        out = torch.zeros_like(hidden_states)
        for j in range(local):
            token, pos = torch.where(top_k_index == start + j)
            if token.numel() == 0:
                continue
            gate_up = nn.functional.linear(hidden_states[token], w_gate_up[j])
            if gate is not None:
                h = gate(gate_up)
            else:
                g, up = gate_up.chunk(2, dim=-1)
                h = experts.act_fn(g) * up
            h = nn.functional.linear(h, w_down[j]) * top_k_weights[token, pos, None]
            out = out.index_add(0, token, h.to(out.dtype))
        return _SumOverGroup.apply(out, group)

    return forward


def _experts_dims(model: nn.Module, found, efsdp: Optional[int], ep: Optional[int],
                  experts_fsdp_dim: Optional[int]) -> List[int]:
    """The fsdp tensor dim of each of `found`'s experts modules (experts_shard_dim); without
    efsdp / ep sizes only a given experts_fsdp_dim, else 0. Refuses (UnsupportedError) a dim-1
    shard fully_shard cannot make: FSDP2 shards a dim other than 0 only evenly."""
    dims = []
    for mname, m in found:
        e = m.gate_up_proj.shape[0]
        d = experts_shard_dim(e, efsdp or 1, ep or 1, experts_fsdp_dim)  # no sizes: 0 unless told
        if d == 1 and efsdp is not None:
            for pname in EXPERT_PARAMS:
                size = getattr(m, pname).shape[1]
                if size % efsdp:
                    why = ("experts_fsdp_dim=1" if experts_fsdp_dim is not None else
                           f"torchtitan's rule: efsdp {efsdp} x ep {ep} > {e} experts")
                    raise UnsupportedError(
                        f"{_model_name(model)}: {mname}.{pname} {list(getattr(m, pname).shape)} is fully_shard'ed "
                        f"on tensor dim 1 over efsdp={efsdp} ({why}), but FSDP2 shards a dim other than 0 only "
                        f"evenly and {size} is not a multiple of {efsdp}; choose another efsdp size, or shard "
                        "the experts on dim 0 (experts_fsdp_dim=0, python -m reshard.ep --experts-fsdp-dim 0)")
        dims.append(d)
    return dims


def parallelize(model: nn.Module, dense, sparse, mp_policy=None, ep_dim: str = "ep", efsdp_dim: str = "efsdp",
                experts_fsdp_dim: Optional[int] = None) -> int:
    """Expert parallel on `model` (parameters on meta: call before to_empty and reshard.load):
    every fused experts module's parameters distributed Shard(0) over ``sparse[ep_dim]``, the
    module fully_shard'ed over ``sparse[efsdp_dim]`` (on tensor dim `experts_fsdp_dim`; None:
    torchtitan's rule, dim 1 when efsdp x ep > the module's experts, else 0: experts_shard_dim)
    and given expert_parallel_forward; every module of ``model._no_split_modules`` and the root
    fully_shard'ed over `dense` (1-D); `mp_policy` for all. Refuses (UnsupportedError,
    fused_experts) a model without fused experts or whose experts the ep size does not divide,
    and a dim-1 shard FSDP2 cannot make (uneven). Returns the number of FSDP2 units."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh, efsdp_mesh = sparse[ep_dim], sparse[efsdp_dim]
    found = fused_experts(model, ep_mesh.size())
    dims = _experts_dims(model, found, efsdp_mesh.size(), ep_mesh.size(), experts_fsdp_dim)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for (_, experts), dim in zip(found, dims):
        for pname, p in list(experts.named_parameters(recurse=False)):
            placed = nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad)
            experts.register_parameter(pname, placed)
        placement = {} if dim == 0 else {"shard_placement_fn": lambda p, d=dim: Shard(d)}
        fully_shard(experts, mesh=efsdp_mesh, **placement, **kwargs)
        experts.forward = expert_parallel_forward(experts, ep_mesh)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    units = len(found)
    for m in list(model.modules()):
        if m is not model and type(m).__name__ in no_split:
            fully_shard(m, mesh=dense, **kwargs)
            units += 1
    fully_shard(model, mesh=dense, **kwargs)
    return units + 1


def _pattern(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def capture_plan(model: nn.Module, name: str, ep_dim: str = "ep", efsdp_dim: str = "efsdp", *,
                 efsdp: Optional[int] = None, ep: Optional[int] = None,
                 experts_fsdp_dim: Optional[int] = None) -> Dict[str, object]:
    """The plan file (formats/parallel-plan.md) of parallelize()'s experts on a job of `efsdp` x
    `ep` ranks: each fused experts parameter ``S(0)`` on `ep_dim`, fully_shard over `efsdp_dim`
    (layer indices as ``*``), with ``"fsdp_dim": 1`` in the experts' rules when parallelize
    shards them on dim 1 (the same `experts_fsdp_dim`, or torchtitan's rule for those sizes).
    Without the sizes: `experts_fsdp_dim` (None: dim 0, the plan of efsdp x ep <= experts)."""
    if (efsdp is None) != (ep is None):
        raise ValueError("capture_plan: give both efsdp and ep (the job's sizes), or neither")
    if ep is not None and (ep < 1 or efsdp < 1):
        raise ValueError(f"capture_plan: efsdp {efsdp} and ep {ep} must be at least 1")
    found = fused_experts(model, ep)
    dims = _experts_dims(model, found, efsdp, ep, experts_fsdp_dim)
    rules: Dict[str, int] = {}
    for (mname, _), dim in zip(found, dims):
        for pname in EXPERT_PARAMS:
            p = _pattern(f"{mname}.{pname}")
            if rules.setdefault(p, dim) != dim:
                raise UnsupportedError(f"{_model_name(model)}: the experts matching {p} are fully_shard'ed on "
                                       f"tensor dims {rules[p]} and {dim} (different numbers of experts)")
    return {"format": "reshard.parallel-plan", "format_version": 1, "name": name,
            "fsdp": {"mesh_dim": efsdp_dim},
            "rules": [dict({"pattern": p, "placements": {ep_dim: "S(0)"}}, **({"fsdp_dim": d} if d else {}))
                      for p, d in rules.items()]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.ep",
                                 description="Write the parallel plan of reshard.ep.parallelize's experts")
    ap.add_argument("src", help="a Hugging Face checkpoint directory (or a reshard output directory)")
    ap.add_argument("-o", "--output", required=True, help="the plan file to write")
    ap.add_argument("--name", default=None, help="plan name (default: <model_type>_ep)")
    ap.add_argument("--world-size", type=int, default=None, metavar="W",
                    help="the job's number of ranks (with --ep): efsdp = W / N; the experts are fully_shard'ed on "
                         "tensor dim 1 when efsdp x ep > their number, as torchtitan and reshard.ep.parallelize do")
    ap.add_argument("--ep", type=int, default=None, metavar="N", help="the job's expert-parallel size (with --world-size)")
    ap.add_argument("--experts-fsdp-dim", type=int, choices=(0, 1), default=None,
                    help="the tensor dim fully_shard shards the experts on over efsdp, whatever the sizes "
                         "(parallelize(..., experts_fsdp_dim=D)); default: torchtitan's rule with --world-size and "
                         "--ep, else 0")
    args = ap.parse_args(argv)
    if (args.world_size is None) != (args.ep is None):
        ap.error("--world-size and --ep go together (the job's sizes: efsdp = world size / ep)")
    efsdp = None
    if args.ep is not None:
        if args.ep < 1 or args.world_size < 1 or args.world_size % args.ep:
            ap.error(f"--world-size {args.world_size} is not a positive multiple of --ep {args.ep}")
        efsdp = args.world_size // args.ep
    from .errors import ReshardError
    from .model import empty_model

    try:
        model = empty_model(args.src)
        name = args.name or f"{getattr(model.config, 'model_type', None) or 'model'}_ep"
        plan = capture_plan(model, name, efsdp=efsdp, ep=args.ep, experts_fsdp_dim=args.experts_fsdp_dim)
    except ReshardError as e:
        print(f"reshard.ep: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w") as f:
        json.dump(plan, f, indent=1)
        f.write("\n")
    dims = sorted({r.get("fsdp_dim", 0) for r in plan["rules"]})
    if args.experts_fsdp_dim is not None:
        why = f"--experts-fsdp-dim {args.experts_fsdp_dim}"
    elif efsdp is not None:
        why = f"torchtitan's rule for efsdp={efsdp} x ep={args.ep}"
    else:
        why = ("no --world-size / --ep given: dim 0, right for jobs where efsdp x ep <= the number of experts; "
               "torchtitan and reshard.ep.parallelize shard them on dim 1 otherwise")
    print(f"{args.output}: plan {name}, {len(plan['rules'])} rule(s), experts S(0) on ep, fully_shard over efsdp "
          f"on tensor dim {' and '.join(map(str, dims))} ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
