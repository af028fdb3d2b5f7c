"""Where a DTensor job's load reads from when OUT holds no DTensor layout of its mesh and plan:
another complete layout of OUT (any world size, FSDP2, FSDP1 or another mesh / plan), or a
Hugging Face checkpoint directory (or a model id in the local cache). The rank's part is planned
by the C++ core exactly as `reshard convert --mesh ... --plan ...` would plan the missing rank
file (reshard._C.SourceRankView with a mesh and a plan), under a parallel plan written from the
job's own DTensors (formats/parallel-plan.md: one rule per parameter, its exact name, its live
placements; `fsdp` the mesh dim fully_shard used), so every check of the load is the same and
only this rank's bytes are read; nothing is stored."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Optional

from torch import nn

from . import _C
from .errors import UnsupportedError
from .load_dtensor import DTensorJob, live_placements
from .sources import JobSource, checkpoint_manifest, hf_source, other_layout, target_policy, whole_names

PLAN_WHAT = "the job's own placements (a parallel plan written from its DTensors)"
_SHARD_DIM = re.compile(r"_?S\((\d+)")


def job_plan(job: DTensorJob, params: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    """The parallel plan of the live job: a rule per parameter with a placement other than R
    off the fully_shard mesh dim (its name with and without the base model prefix, as
    checkpoints spell it), and `fsdp` the mesh dim (and tensor dim) fully_shard sharded every
    parameter over. Raises UnsupportedError when no plan file can say it: fully_shard over two
    mesh dims, or over some parameters and not others."""
    rules = []
    fsdp, fsdp_of, without = None, None, None
    for name, p in params.items():
        live, fdim = live_placements(job, name, p)
        if fdim is not None:
            dim = int(_SHARD_DIM.match(live[fdim]).group(1))
            this = (job.names[fdim], dim)
            if fsdp is None:
                fsdp, fsdp_of = this, name
            elif this != fsdp:
                raise UnsupportedError(
                    f"parameter {name} is sharded by fully_shard over mesh dim {this[0]} (tensor dim {this[1]}), "
                    f"{fsdp_of} over {fsdp[0]} (tensor dim {fsdp[1]}): no parallel plan says both; load from a "
                    "DTensor layout converted for this job (reshard convert ... --mesh ... --plan ...)")
        elif without is None and p.dim() > 0:
            without = name
        placements = {job.names[m]: pl for m, pl in enumerate(live) if m != fdim and pl != "R"}
        if not placements:
            continue
        names = {name}
        if prefix:
            names.add(name[len(prefix) + 1:] if name.startswith(prefix + ".") else f"{prefix}.{name}")
        for n in sorted(names):
            rules.append({"pattern": n, "placements": placements})
    if fsdp is not None and without is not None:
        raise UnsupportedError(
            f"parameter {without} is not sharded by fully_shard, {fsdp_of} is (over mesh dim {fsdp[0]}): no "
            "parallel plan says both; load from a DTensor layout converted for this job "
            "(reshard convert ... --mesh ... --plan ...)")
    plan: Dict[str, Any] = {"format": "reshard.parallel-plan", "format_version": 1, "name": "live", "rules": rules}
    if fsdp is not None:
        plan["fsdp"] = {"mesh_dim": fsdp[0], "dim": fsdp[1]}
    return plan


def open_dtensor_view(out: str, manifest: Optional[Dict[str, Any]], job: DTensorJob, model: nn.Module,
                      params: Dict[str, Any], live_dtype, buffer_names) -> Optional[JobSource]:
    """The job's rank planned over what is there: a complete layout of OUT (manifest given) or
    OUT as a Hugging Face checkpoint. None when neither is there."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan = json.dumps(job_plan(job, params, prefix))
    policy = target_policy(live_dtype)
    whole = whole_names(buffer_names, prefix)
    if manifest is not None:
        other = other_layout(manifest, job.world_size, policy)
        if other is None:
            return None
        model_json = os.path.join(out, "reshard-model.json")
        manifest_json = ""
        if os.path.exists(model_json):
            with open(model_json) as f:
                manifest_json = f.read()
        view = _C.SourceRankView.of_layout(out, other, job.world_size, job.rank, dtype=policy, whole=whole,
                                           model_manifest=manifest_json, mesh=job.mesh_flag(), plan=plan,
                                           plan_what=PLAN_WHAT)
        return JobSource(view.description, view.layout_key, view,
                         f"{view.description}, resharded while reading to mesh {job.mesh_flag()} "
                         "(no conversion stored)")
    src = hf_source(out)
    if src is None:
        return None
    manifest_json = checkpoint_manifest(src, model, list(params))
    view = _C.SourceRankView.of_checkpoint(src, job.world_size, job.rank, dtype=policy, whole=whole,
                                           model_manifest=manifest_json, mesh=job.mesh_flag(), plan=plan,
                                           plan_what=PLAN_WHAT)
    how = "through transformers' conversion, " if manifest_json else ""
    return JobSource(view.description, view.layout_key, view,
                     f"{view.description}, read directly for mesh {job.mesh_flag()} ({how}no conversion stored)")
