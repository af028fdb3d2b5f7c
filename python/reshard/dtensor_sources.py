"""Where a DTensor job's load reads from when OUT holds no DTensor layout of its mesh and plan:
another complete layout of OUT (any world size, FSDP2, FSDP1 or another mesh / plan), or a
Hugging Face checkpoint directory (or a model id in the local cache). The rank's part is planned
by the C++ core exactly as `reshard convert --mesh ... --plan ...` would plan the missing rank
file (reshard._C.SourceRankView with a mesh and a plan), under the parallel plan of the job's
own placements (PlanOfShardings, formats/parallel-plan.md "Saved plans": reshard.save records a
job by the same plan), so every check of the load is the same and only this rank's bytes are
read; nothing is stored."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from torch import nn

from . import _C
from .errors import UnsupportedError
from .load_dtensor import DTensorJob, placed_tensors
from .model import clean_name
from .sources import JobSource, checkpoint_manifest, hf_source, other_layout, target_policy, whole_names

PLAN_WHAT = "the job's own placements (a parallel plan written from its DTensors)"
PLAN_NAME = "live"  # the plan of a rank planned for a live job's placements


def job_plan(job: DTensorJob, params: Dict[str, Any], buffers, prefix: str, command: str) -> str:
    """The parallel plan (canonical JSON) that gives every parameter of the live job its
    placements and fully_shard mesh dim, persistent buffers whole: the native
    PlanOfShardings (as reshard.save records a job), each name also with / without the base
    model prefix, as checkpoints spell it. Raises UnsupportedError naming the parameter when no
    plan can say the job's placements, with the convert command that fits."""
    tensors, _ = placed_tensors(job, params, buffers, prefix)
    try:
        _, _, _, plan = _C.plan_of_placements(PLAN_NAME, list(job.names), list(job.shape), tensors)
    except UnsupportedError as e:
        raise UnsupportedError(f"reshard.load: this job's rank cannot be planned over another layout or a "
                               f"checkpoint: {e}. Convert a DTensor layout with this job's plan: {command}") from e
    return plan


def open_dtensor_view(out: str, manifest: Optional[Dict[str, Any]], job: DTensorJob, model: nn.Module,
                      params: Dict[str, Any], live_dtype, buffer_names, command: str) -> Optional[JobSource]:
    """The job's rank planned over what is there: a complete layout of OUT (manifest given) or
    OUT as a Hugging Face checkpoint. None when neither is there."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    buffers = dict((clean_name(n), b.dim()) for n, b in model.named_buffers())
    # Every name of each parameter, its first (named_parameters') first: the checkpoint may store
    # a tied parameter by another (load.param_sources finds it there).
    ids = {id(p) for p in params.values()}
    named = dict(params)
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            named.setdefault(clean_name(n), p)
    plan = job_plan(job, named, [(n, buffers[n]) for n in sorted(buffer_names) if n in buffers], prefix, command)
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
