"""reshard.load of a DTensor job: parameters placed on a device mesh of several dims (FSDP2
over tensor parallel, expert parallel, any Shard / _StridedShard / Replicate), loaded from a
DTensor layout of OUT (`reshard convert --mesh ... --plan ...`, formats/rank-file.md,
*DTensor layouts*). Each parameter's live placements, the mesh dim fully_shard applied and the
rank's mesh coordinate are read from the DTensor itself and checked against the file before
any byte moves; the local tensors are then filled in place as an FSDP2 load fills its shards.
Without such a layout, the rank is planned for the job's own placements over another layout
of OUT or a Hugging Face checkpoint and read from there (dtensor_sources)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from torch import nn

from .engine import LoadReport, open_rank_file
from .errors import InvalidArgumentError, LayoutMismatchError, NotFoundError, UnsupportedError
from .layout import layout_rank_file, read_manifest
from .model import clean_name


def placement_name(pl, name: str = "", mesh_dim: str = "") -> str:
    """A torch placement as rank files write it: "R", "S(d)", "_S(d,k)". Any other (Partial:
    pending sums) raises naming parameter `name` and its mesh dim `mesh_dim`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(pl, _StridedShard):
        return f"_S({pl.dim},{pl.split_factor})"
    if isinstance(pl, Shard):
        return f"S({pl.dim})"
    if isinstance(pl, Replicate):
        return "R"
    where = f"parameter {name or '?'}: placement {pl} on mesh dim {mesh_dim or '?'}"
    raise UnsupportedError(
        f"{where}: reshard loads and saves Shard, _StridedShard and Replicate placements only. Redistribute "
        f"the parameter to Replicate (or Shard) on that mesh dim before reshard.load / reshard.save, e.g. "
        f"nn.Parameter(p.redistribute(p.device_mesh, [Replicate() if isinstance(pl, Partial) else pl "
        f"for pl in p.placements])) set on its module")


def _fsdp2_shaped(p) -> bool:
    """An FSDP2 / HSDP parameter the plain FSDP2 path loads: one Shard(0), Replicate elsewhere."""
    from torch.distributed.tensor.placement_types import _StridedShard

    shards = [pl for pl in p.placements if pl.is_shard()]
    return (len(shards) == 1 and shards[0].dim == 0 and not isinstance(shards[0], _StridedShard) and
            all(pl.is_shard() or pl.is_replicate() for pl in p.placements))


@dataclasses.dataclass
class DTensorJob:
    names: Tuple[str, ...]        # the mesh's dim names
    shape: Tuple[int, ...]        # its dim sizes
    coordinate: Tuple[int, ...]   # this rank's
    rank: int                     # row-major index of the coordinate: the rank file's rank
    fsdp_dims: Dict[int, int]     # id(parameter) -> the mesh dim fully_shard sharded it over

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def mesh_flag(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.shape))


def dtensor_job(model: nn.Module) -> Optional[DTensorJob]:
    """The job's mesh when some parameter is placed other than FSDP2 / HSDP do (Shard(0) over
    one mesh dim): the largest mesh of the model's DTensor parameters (fully_shard over a TP
    model leaves parameters TP did not touch on the data-parallel mesh alone). None for an
    FSDP2, HSDP or unsharded job."""
    from torch.distributed.tensor import DTensor

    dts = [p for p in model.parameters() if isinstance(p, DTensor)]
    fsdp_params = _fsdp_params(model)
    if fsdp_params is not None:
        # A Shard(0) that fully_shard did not make (ColwiseParallel, experts Shard(0) over an ep
        # dim) is the job's own placement, not FSDP2's. A parameter of `model` that a unit above
        # it holds (reshard.load(model.model) of a fully_shard'ed root) is not among the units
        # found here: FSDP2's too when it is on the mesh of one of theirs (TP and EP meshes are
        # others).
        managed = {id(fp.sharded_param) for fp in fsdp_params}
        meshes = {fp.sharded_param.device_mesh for fp in fsdp_params}  # DeviceMesh hashes as it compares
        placed = [p for p in dts if not (_fsdp2_shaped(p) and (id(p) in managed or p.device_mesh in meshes))]
    else:
        placed = [p for p in dts if not _fsdp2_shaped(p)]
        if not placed and dts:
            # No fully_shard at all: Shard(0) DTensors load as an FSDP2 job only when they make
            # one (every parameter a DTensor, one world size and shard coordinate); else (tensor
            # parallel of some modules, the rest plain) they are a DTensor job on their mesh.
            from .load import shard_coordinate

            try:
                shard_coordinate(model)
            except UnsupportedError:
                placed = dts
    if not placed:
        return None
    # The mesh of the parameters FSDP2 alone did not place (TP / EP): with expert parallel, the
    # dense parameters' FSDP2 mesh may have as many dims (HSDP) and is not the job's.
    mesh = max((p.device_mesh for p in placed), key=lambda m: m.ndim)
    names = mesh.mesh_dim_names
    if not names:
        raise UnsupportedError("a DTensor job whose device mesh has no dim names: name them "
                               "(init_device_mesh(..., mesh_dim_names=(...))), as the layout key does")
    coordinate = tuple(mesh.get_coordinate() or ())
    if len(coordinate) != mesh.ndim:
        raise InvalidArgumentError("this process is not in the parameters' device mesh")
    rank = 0
    for c, s in zip(coordinate, mesh.shape):
        rank = rank * s + c
    return DTensorJob(tuple(names), tuple(mesh.shape), coordinate, rank, _fsdp_mesh_dims(model, names))


def _fsdp_params(model: nn.Module) -> Optional[list]:
    """The FSDPParams of `model`'s fully_shard'ed modules; None when no module is fully_shard'ed."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    found, out = False, []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        found = True
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None:
            out.extend(group.fsdp_params)
    return out if found else None


def _fsdp_mesh_dims(model: nn.Module, names) -> Dict[int, int]:
    """id(sharded parameter) -> the index in `names` of the mesh dim fully_shard sharded it over."""
    out: Dict[int, int] = {}
    for fp in _fsdp_params(model) or []:
        info = fp.mesh_info
        dim_names = info.mesh.mesh_dim_names or ()
        shard_name = dim_names[info.shard_mesh_dim] if info.shard_mesh_dim is not None and dim_names else None
        if shard_name in names:
            out[id(fp.sharded_param)] = list(names).index(shard_name)
    return out


def live_placements(job: DTensorJob, name: str, p) -> Tuple[List[str], Optional[int]]:
    """Parameter `p`'s placements on the job's whole mesh ("R" on the dims its own mesh lacks)
    and the mesh dim fully_shard applied (None when it did not shard it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return ["R"] * len(job.names), None
    own = p.device_mesh.mesh_dim_names or ()
    if not own or any(n not in job.names for n in own):
        raise UnsupportedError(f"parameter {name}: on a mesh of dims {list(own)}, the job's mesh has "
                               f"{list(job.names)}")
    for n, s in zip(own, p.device_mesh.shape):
        if job.shape[job.names.index(n)] != s:
            raise UnsupportedError(f"parameter {name}: mesh dim {n} of size {s}, the job's has "
                                   f"{job.shape[job.names.index(n)]}")
    full = ["R"] * len(job.names)
    for n, pl in zip(own, p.placements):
        full[job.names.index(n)] = placement_name(pl, name, n)
    return full, job.fsdp_dims.get(id(p))


def placed_tensors(job: DTensorJob, params, buffers, prefix: str = "") -> Tuple[list, dict]:
    """What _C.plan_of_placements takes for a live job: every parameter (clean name -> tensor)
    with its placements and fully_shard mesh dim (-1: none), then `buffers` ((name, ndim), the
    persistent ones) whole, R on every mesh dim; with `prefix`, each name also with / without
    the base model prefix, as checkpoints spell it (the model's own name first: errors name it).
    Returns (tensors, {clean name: (placements, fsdp mesh dim)})."""
    tensors, aliases, placed = [], [], {}

    def add(name, ndim, whole, placements, fsdp):
        placed[name] = (placements, fsdp)
        tensors.append((name, ndim, whole, placements, fsdp))
        if prefix:
            alias = name[len(prefix) + 1:] if name.startswith(prefix + ".") else f"{prefix}.{name}"
            aliases.append((alias, ndim, whole, placements, fsdp))

    for name, p in params.items():
        placements, fsdp = live_placements(job, name, p)
        add(name, p.dim(), False, placements, -1 if fsdp is None else fsdp)
    for name, ndim in buffers:
        if name not in placed:
            add(name, ndim, True, ["R"] * len(job.names), -1)
    # Every tensor's own name first, then the aliases that are no tensor's own name: an alias
    # never gives a real tensor another's placements.
    seen = set()
    tensors = [t for t in tensors + aliases if not (t[0] in seen or seen.add(t[0]))]
    return tensors, placed


def placement_mismatch(job: DTensorJob, params, entries, prefix: str, path: str,
                       model: Optional[nn.Module] = None) -> Optional[str]:
    """Why the entries of `path` do not hold this job's parameters as it places them; None when
    they do. With `model`, a parameter is also found by its other names and its tie partner's
    entry (the partner's placements checked), or is one the model never saves (computed after
    the load, as reshard.load does: load.param_sources); without, by its own name only."""
    from .load import file_key, param_sources

    if model is not None:
        found = param_sources(model, model, params, entries, prefix)
        if found.missing:
            return f"parameter {found.missing[0]} is not in {path}"
        keys = found.keys
    else:
        keys = {name: file_key(name, entries, prefix) for name in params}
    for name, p in params.items():
        if name not in keys:  # untied (its partner is checked) or never saved
            continue
        k = keys[name]
        if k is None:
            return f"parameter {name} is not in {path}"
        live, fsdp_dim = live_placements(job, name, p)
        e = entries[k]
        # The fsdp mesh dim is compared either way: fully_shard's chunk and the left-to-right
        # reading of the same placements hold different elements for uneven sizes.
        if list(e.placements or []) != live or e.fsdp_mesh_dim != fsdp_dim:
            return (f"parameter {name}: placements {live} (fully_shard over mesh dim "
                    f"{'none' if fsdp_dim is None else job.names[fsdp_dim]}) in the model, "
                    f"{list(e.placements or [])} (fsdp mesh dim "
                    f"{'none' if e.fsdp_mesh_dim is None else job.names[e.fsdp_mesh_dim]}) in {path}")
    return None


def load_dtensor(model: nn.Module, out: str, job: DTensorJob, *, threads, verify, io,
                 strict_buffers) -> LoadReport:
    """Loads from OUT's DTensor layout of this job's mesh and plan (preferred: one file laid
    out for this rank), else from another complete layout of OUT or from OUT as a Hugging Face
    checkpoint, planned for the job's own placements while reading (dtensor_sources)."""
    import os

    manifest = read_manifest(out) if os.path.isdir(out) else None
    _refuse_split_ties(model, job)  # may tie plain tensors again: before the parameters are listed
    params = {clean_name(n): p for n, p in model.named_parameters()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    # Expert parallel (torchtitan): parameters fully_shard'ed alone over a mesh dim outside this
    # mesh load as an FSDP2 job of their own (reshard.load_ep), checked before any byte moves.
    from .load_ep import split_dense, with_dense

    params, dense = split_dense(job, params)
    mesh = {"names": list(job.names), "shape": list(job.shape)}
    command = (f"reshard convert <checkpoint> -o {out} --mesh {job.mesh_flag()} --plan PLAN.json "
               "(the parallel plan of this job, formats/parallel-plan.md)")
    # A layout of the live dtype first, then the checkpoint's own dtypes (as FSDP2's
    # find_rank_file); a layout converted to another dtype is no exact match: read through a view.
    from .load import local_tensor
    from .sources import target_policy

    float_dtypes = {local_tensor(p).dtype for p in params.values() if p.is_floating_point()}
    live_dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
    policy = target_policy(live_dtype)
    layouts = (manifest or {}).get("layouts", {})
    # Layouts of this mesh that list this rank's file: a layout converted in parts (--ranks, one
    # OUT per node) serves the ranks it holds, as an FSDP2 layout does.
    ours = [k for k, v in layouts.items()
            if v.get("kind") == "dtensor" and v.get("mesh") == mesh and v.get("dtype", "keep") in (policy, "keep")]
    keys = sorted((k for k in ours if any(r.get("rank") == job.rank for r in layouts[k].get("ranks", []))),
                  key=lambda k: (layouts[k].get("dtype", "keep") != policy, k))
    reasons = [f"{k}: the rank file of rank {job.rank} (coordinate {list(job.coordinate)}) is missing; create it "
               f"with: reshard convert <checkpoint> -o {out} --mesh {job.mesh_flag()} --plan PLAN.json "
               f"--ranks {job.rank}-{job.rank}" for k in sorted(set(ours) - set(keys))]
    for key in keys:
        path = layout_rank_file(out, key, job.rank, job.world_size, manifest)
        rank_file = open_rank_file(path)
        if tuple(rank_file.coordinate or ()) != job.coordinate:
            raise LayoutMismatchError(f"{path}: holds mesh coordinate {rank_file.coordinate}, this rank is at "
                                      f"{list(job.coordinate)}")
        # Listed by OUT/reshard.json as this rank's file of this layout: same source, size and header.
        rank_file.check_listed(out, key, job.rank)
        entries = {t.name: t for t in rank_file.tensors}
        why = placement_mismatch(job, params, entries, prefix, path, model)
        if why is None:
            return with_dense(model, out, job, dense, prefix, lambda: _load_file(
                model, rank_file, key, job, entries, params, prefix, path, command, threads=threads,
                verify=verify, io=io, strict_buffers=strict_buffers,
                source=f"layout {key} (mesh {job.mesh_flag()}, coordinate {list(job.coordinate)})"),
                threads=threads, verify=verify, io=io)
        reasons.append(f"{key}: {why}")
    # No layout of this job's own: plan its rank over what is there, as convert would.
    from .dtensor_sources import open_dtensor_view
    from .load import convert_command
    from .model import persistent_buffer_names

    # OUT a Hugging Face checkpoint: the conversion goes to a new directory, never into it.
    command = convert_command(out, f"--mesh {job.mesh_flag()} --plan PLAN.json", "PLAN.json: the parallel "
                              "plan of this job, formats/parallel-plan.md")

    if manifest is None and not os.path.exists(out):
        from .sources import hf_source

        if hf_source(out) is None:
            raise NotFoundError(f"{out}: no such directory (nor a model id in the local Hugging Face cache)")
    persistent = {clean_name(n) for n in persistent_buffer_names(model)}
    view = open_dtensor_view(out, manifest, job, model, params, live_dtype, persistent, command)
    if view is None:
        if manifest is None:
            raise NotFoundError(f"{out}: no reshard.json (not a reshard output directory) and not a Hugging "
                                "Face checkpoint")
        have = ", ".join(sorted(manifest.get("layouts", {}))) or "none"
        detail = f" ({'; '.join(reasons)})" if reasons else f" (layouts: {have})"
        raise LayoutMismatchError(f"{out}: no DTensor layout matches this job{detail} and no other complete "
                                  f"layout to read it from. Create one with: {command}")
    entries = {t.name: t for t in view.reader.tensors}
    why = placement_mismatch(job, params, entries, prefix, view.path, model)
    if why is not None:  # the planner and the live job disagree: say so, do not load
        raise LayoutMismatchError(f"{view.path}: planned for this job's placements, but {why}. "
                                  f"Convert with this job's plan instead: {command}")
    return with_dense(model, out, job, dense, prefix, lambda: _load_file(
        model, view.reader, view.key, job, entries, params, prefix, view.path, command, threads=threads,
        verify=verify, io=io, strict_buffers=strict_buffers, source=view.source),
        threads=threads, verify=verify, io=io)


def _refuse_split_ties(model: nn.Module, job: DTensorJob) -> None:
    """Names transformers ties (all_tied_weights_keys: lm_head.weight and the input embeddings
    under tie_word_embeddings) must be one parameter of a DTensor job: parallelize_module gives
    each module it parallelizes a new Parameter, so a plan that touches one name of a tie leaves
    two parameters, which would load alike and then train apart. Refused before any byte moves.
    Two plain (not DTensor) tensors are tied again, as reshard.load does for a plain model
    (nn.Module.to_empty unties them)."""
    from torch.distributed.tensor import DTensor

    ties = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(ties, dict) or not ties:
        return

    def split():
        live = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
        pairs = [(str(t), str(s), live.get(clean_name(str(t))), live.get(clean_name(str(s))))
                 for t, s in ties.items()]
        return [(t, s, a, b) for t, s, a, b in pairs if a is not None and b is not None and a is not b]

    pairs = split()
    if pairs and hasattr(model, "tie_weights") and \
            not any(isinstance(a, DTensor) or isinstance(b, DTensor) for _, _, a, b in pairs):
        model.tie_weights()
        pairs = split()
    for target, source, a, b in pairs:
        pa, pb = live_placements(job, target, a)[0], live_placements(job, source, b)[0]
        raise LayoutMismatchError(
            f"parameter {target} is tied to {source} (the model ties them: all_tied_weights_keys, e.g. "
            f"tie_word_embeddings), but this job holds two parameters, placements {pa} and {pb} on mesh "
            f"{job.mesh_flag()}: parallelize_module gave the module it parallelized a new Parameter. Give both "
            f"names one placement (transformers' plan has embed_tokens: embedding_rowwise and lm_head: colwise, "
            f"both S(0)), and after parallelize_module and before fully_shard tie them again "
            f"({target} = {source}, i.e. setattr the owner module's parameter); "
            f"reshard.parallel_plan.parallelize(model, tp_mesh) does both")


def _load_file(model, rank_file, key, job, entries, params, prefix, path, command, *, threads, verify,
               io, strict_buffers, source: str) -> LoadReport:
    # load imports this module
    from .load import (check_untied, complete_sources, finish_load, param_sources, param_target,
                       plan_buffers)

    # As reshard.load: other names of a parameter, tie partners, parameters never saved.
    found = param_sources(model, model, params, entries, prefix)
    if found.missing:
        raise LayoutMismatchError(f"parameter {found.missing[0]} is not in {path}. Convert this model's "
                                  f"checkpoint: {command}")
    direct, converted = [], []
    used = set()
    device_index = None
    for name, k in found.keys.items():
        used.add(k)
        kind, t, device_index = param_target(name, params[name], k, entries[k], path, command, device_index)
        if kind == "direct":
            direct.append(t)
        elif kind == "converted":
            converted.append(t)
    check_untied(params, found.untied, path)
    buffers, needs_fresh = plan_buffers(model, entries, prefix, path, used)
    report = finish_load(model, rank_file, key, job.world_size, job.rank, entries, direct, converted,
                         buffers, needs_fresh, device_index, threads=threads, verify=verify, io=io,
                         strict_buffers=strict_buffers, source=source)
    complete_sources(model, model, params, found, report)
    return report
