"""Expert parallel as torchtitan arranges it (issue 22): the routed experts' fused parameters
are `Shard(0)` over an `ep` mesh dim and fully_shard'ed over `efsdp` inside it (torch 2.11
records `(_StridedShard(0, ep), Shard(0))` on the 2-D mesh `(efsdp, ep)`, fully_shard's dim
last; `(Shard(1), Shard(0))` when fully_shard shards them on tensor dim 1, torchtitan's choice
when efsdp x ep exceeds the experts: a plan rule's "fsdp_dim": 1), while every other parameter
is fully_shard'ed over a *different* mesh: a 1-D `fsdp` dim spanning the same ranks (torchtitan unflattens the world into a dense mesh `(fsdp, tp)`
and a sparse one `(efsdp, ep, etp)`). FSDP2 chunks those dense parameters over all of `fsdp`
at once (`torch.chunk` over its size), which no placement on the expert mesh's dims
reproduces for sizes the mesh does not divide; they are exactly an FSDP2 (or HSDP) job of
their own. So a DTensor job whose parameters include FSDP2-shaped ones (one `Shard(0)`,
`Replicate` elsewhere) on mesh dims outside the job's mesh loads those as reshard.load loads
an FSDP2 job (OUT's layout `fsdp2-wsN` for their shard dim's size N, else another complete
layout or the Hugging Face checkpoint, resharded while reading), and the rest as any DTensor
job (`--mesh efsdp=..,ep=.. --plan PLAN.json`); both sources are checked before any byte
moves. Persistent buffers the FSDP2 source holds whole are read from it after the DTensor part
(a reshard.save of such a job stores them there only). reshard.save writes such a job back in
the same two layouts (split_dense / dense_shard decide which parameter goes where) and
reshard.load_optimizer restores the state from both."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from .engine import LoadReport
from .errors import LayoutMismatchError, NotFoundError, UnsupportedError
from .model import clean_name


@dataclasses.dataclass
class DensePart:
    """The parameters that load as an FSDP2 job of their own, checked and ready to move."""
    names: List[str]
    mesh_dim: str            # the mesh dim fully_shard sharded them over
    world_size: int          # its size
    coord: int               # this rank's coordinate on it
    path: str
    key: str
    reader: object           # the rank file, or a view resharding another source while reading
    source: str
    entries: dict
    direct: list
    converted: list
    device_index: Optional[int]
    # (key, buffer) of the persistent buffers the source holds whole: read from it after the
    # DTensor part (a reshard.save of an EP job stores them here only; a conversion stores the
    # same values in both layouts)
    buffers: list = dataclasses.field(default_factory=list)


def _shard_coordinate(p) -> Tuple[str, int, int]:
    """(mesh dim name, its size, this rank's coordinate) of an FSDP2-shaped DTensor's Shard(0)."""
    mesh = p.device_mesh
    i = next(i for i, pl in enumerate(p.placements) if pl.is_shard())
    return mesh.mesh_dim_names[i], mesh.size(i), mesh.get_local_rank(i)


def split_dense(job, params: Dict[str, object]) -> Tuple[Dict[str, object], Dict[str, object]]:
    """(parameters on the job's mesh dims, parameters fully_shard'ed alone over mesh dims outside
    it: FSDP2-shaped DTensors whose mesh has a dim the job's mesh lacks)."""
    from torch.distributed.tensor import DTensor

    from .load_dtensor import _fsdp2_shaped

    on_mesh, dense = {}, {}
    for name, p in params.items():
        own = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
        if own and any(n not in job.names for n in own) and _fsdp2_shaped(p):
            dense[name] = p
        else:
            on_mesh[name] = p
    return on_mesh, dense


def dense_shard(job, dense: Dict[str, object]) -> Tuple[str, int, int]:
    """(mesh dim, its size, this rank's coordinate) that every `dense` parameter is
    fully_shard'ed over; raises naming two parameters sharded over different mesh dims."""
    first = next(iter(dense))
    mesh_dim, ws, coord = _shard_coordinate(dense[first])
    for name, p in dense.items():
        this = _shard_coordinate(p)
        if this != (mesh_dim, ws, coord):
            raise UnsupportedError(
                f"parameters {first} and {name} are fully_shard'ed outside the mesh {job.mesh_flag()} on "
                f"different mesh dims ({mesh_dim} of {ws} at {coord}, {this[0]} of {this[1]} at {this[2]}); "
                "reshard loads and saves such parameters as one FSDP2 job: fully_shard them over one mesh dim")
    return mesh_dim, ws, coord


def prepare_dense(model: nn.Module, out: str, job, dense: Dict[str, object], prefix: str) -> DensePart:
    """This rank's FSDP2 source for the `dense` parameters (OUT's FSDP2 layout of their shard dim,
    else another complete layout of OUT or OUT as a Hugging Face checkpoint, resharded while
    reading: reshard.sources.open_job_source), each parameter checked against its entry; nothing
    moves yet. Raises naming the parameters, the mesh dim and the command."""
    from .load import file_key, local_tensor, param_target
    from .model import persistent_buffer_names
    from .sources import open_job_source

    mesh_dim, ws, coord = dense_shard(job, dense)
    names = list(dense)
    what = (f"parameters {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} ({len(names)}) are "
            f"fully_shard'ed over mesh dim {mesh_dim} ({ws} ranks), outside the mesh {job.mesh_flag()} of the "
            f"expert / tensor parallel parameters: they load as an FSDP2 job of {ws} ranks")
    command = f"reshard convert <checkpoint> -o {out} --world-size {ws}"
    float_dtypes = {local_tensor(p).dtype for p in dense.values() if p.is_floating_point()}
    live_dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
    persistent = {clean_name(n) for n in persistent_buffer_names(model)}
    try:
        src = open_job_source(out, ws, coord, live_dtype, model, names, persistent)
    except (NotFoundError, LayoutMismatchError) as e:
        raise type(e)(f"{what}: {e}") from None
    entries = {t.name: t for t in src.reader.tensors}
    direct, converted = [], []
    device_index = None
    for name, p in dense.items():
        k = file_key(name, entries, prefix)
        if k is None:
            raise LayoutMismatchError(f"{what}: parameter {name} is not in {src.path} (another model?). "
                                      f"Convert this model's checkpoint: {command}")
        kind, t, device_index = param_target(name, p, k, entries[k], src.path, command, device_index)
        if kind == "direct":
            direct.append(t)
        elif kind == "converted":
            converted.append(t)
    buffers = []
    for bname, b in model.named_buffers():
        bname = clean_name(bname)
        k = file_key(bname, entries, prefix) if bname in persistent else None
        if k is not None and (entries[k].shard is None or entries[k].local_shape == entries[k].global_shape):
            buffers.append((k, b))
    return DensePart(names, mesh_dim, ws, coord, src.path, src.key, src.reader, src.source, entries, direct,
                     converted, device_index, buffers)


def with_dense(model: nn.Module, out: str, job, dense: Dict[str, object], prefix: str,
               load: Callable[[], LoadReport], *, threads, verify, io) -> LoadReport:
    """`load()` (the DTensor layout's part) and, when there are `dense` parameters, theirs: their
    source opened and checked first, their bytes moved after; one report of both."""
    if not dense:
        return load()
    from .load import finish_load

    part = prepare_dense(model, out, job, dense, prefix)
    report = load()
    r = finish_load(model, part.reader, part.key, part.world_size, part.coord, part.entries, part.direct,
                    part.converted, part.buffers, [], part.device_index, threads=threads, verify=verify, io=io,
                    strict_buffers=True, source=part.source)
    where = r.file if r.source == "rank file" else r.source
    b, s = report.bytes + r.bytes, report.seconds + r.seconds
    return dataclasses.replace(
        report, layout=f"{report.layout} + {r.layout}", bytes=b, seconds=s, gbps=b / s / 1e9 if s else 0.0,
        tensors=report.tensors + r.tensors, staging_bytes=max(report.staging_bytes, r.staging_bytes),
        direct_io=report.direct_io and r.direct_io, converted_tensors=report.converted_tensors + r.converted_tensors,
        staging_alloc_seconds=report.staging_alloc_seconds + r.staging_alloc_seconds,
        source=(f"{report.source}; {where} (shard {part.coord} of {part.world_size} on mesh dim {part.mesh_dim}) "
                f"for the {len(part.names)} parameter(s) fully_shard'ed outside that mesh"))
