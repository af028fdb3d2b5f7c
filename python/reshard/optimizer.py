"""Optimizer state in a saved checkpoint: what reshard.save writes of it (OUT/KEY/optim/: one
rank file of state tensors per shard coordinate, sharded like their parameters under FSDP2,
and optimizer.json with the param groups and scalars) and reshard.load_optimizer, which
restores it into a job of the same layout."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .engine import (default_threads, load_tensors, load_via_host, open_rank_file, raw_save_entry, save_entry,
                     target)
from .errors import (CorruptFileError, InvalidArgumentError, LayoutMismatchError, NotFoundError,
                     UnsupportedError)
from .layout import layout_key, rank_file_name, read_manifest, torch_dtype
from .load import local_tensor, shard_coordinate
from .load_fsdp1 import fsdp1_job
from .model import clean_name

OPTIM_DIR = "optim"
OPTIM_JSON = "optimizer.json"
OPTIM_SEP = "#"  # optimizer tensor names: "<parameter name>#<state key>"


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(type(v).__name__)


def param_names(model: nn.Module, fsdp1: bool) -> Dict[str, torch.Tensor]:
    """name → parameter, names as model.named_parameters() gives them (for FSDP1 without the
    wrapper parts: "model.layers.0._flat_param", or the original parameters' names)."""

    return {(clean_name(n) if fsdp1 else n): p for n, p in model.named_parameters()}


def optimizer_entries(optimizer, model: nn.Module, world: int, coord: int, fsdp1: bool = False,
                      dtensor: Optional[Dict[str, Tuple[List[str], int]]] = None, only: Optional[set] = None):
    """Save items of the optimizer's state tensors and its description (optimizer.json).
    `only`: the state of these parameters (clean names) alone (an expert-parallel save writes
    the experts' state and the dense parameters' state into two layouts; param_groups whole).
    `dtensor`: a DTensor job's placements (clean parameter name -> (placements, fsdp mesh dim)):
    state shaped like its parameter is stored as the parameter's local tensor with its
    placements (AdamW's exp_avg / exp_avg_sq are DTensors placed like it), 0-dim state whole."""
    from torch.distributed.tensor import DTensor

    params = param_names(model, fsdp1)
    names = {id(p): n for n, p in params.items()}
    entries, keep, state_desc = [], [], {}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        gnames = []
        for p in g["params"]:
            if id(p) not in names:
                raise InvalidArgumentError(f"optimizer param_groups[{gi}] holds a tensor that is not a "
                                   "parameter of the model")
            gnames.append(names[id(p)])
        hyper = {}
        for k, v in g.items():
            if k == "params":
                continue
            try:
                hyper[k] = _jsonable(v)
            except TypeError:
                raise UnsupportedError(f"optimizer param_groups[{gi}][{k!r}] is a {type(v).__name__}; "
                                   "reshard saves JSON-like hyper-parameters only") from None
        groups.append({"params": gnames, **hyper})
    for p, st in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            raise InvalidArgumentError("optimizer state for a tensor that is not a parameter of the model")
        if only is not None and clean_name(name) not in only:
            continue
        desc = {"tensors": {}, "scalars": {}}
        for k, v in sorted(st.items()):
            if not isinstance(v, torch.Tensor):
                try:
                    desc["scalars"][k] = _jsonable(v)
                except TypeError:
                    raise UnsupportedError(f"optimizer state {name}[{k!r}] is a {type(v).__name__}; "
                                       "reshard saves tensors and JSON-like values only") from None
                continue
            full_shape = list(v.shape)
            if dtensor is not None:
                pl, fsdp = dtensor[clean_name(name)]
                tname = f"{name}{OPTIM_SEP}{k}"
                if v.dim() == 0:
                    kind = "whole"
                    e, t = raw_save_entry(tname, v.detach(), [], False, 0, 0)
                    e.placements, e.fsdp_mesh_dim = ["R"] * len(pl), -1
                elif full_shape == list(params[name].shape):
                    local = local_tensor(params[name])
                    if isinstance(v, DTensor):
                        if list(v.placements) != list(params[name].placements):
                            raise UnsupportedError(
                                f"optimizer state {name}[{k!r}] is placed {list(v.placements)}, its parameter "
                                f"{list(params[name].placements)}; reshard saves state placed like its parameter")
                        v = v.to_local()
                    if list(v.shape) != list(local.shape):
                        raise UnsupportedError(
                            f"optimizer state {name}[{k!r}] has local shape {list(v.shape)}, its parameter "
                            f"{list(local.shape)}; reshard saves state placed like its parameter")
                    kind = "sharded"
                    e, t = raw_save_entry(tname, v.detach(), full_shape, False, 0, 0)
                    e.placements, e.fsdp_mesh_dim = pl, fsdp
                else:
                    raise UnsupportedError(f"optimizer state {name}[{k!r}] has shape {full_shape}; reshard "
                                           "saves state shaped like its parameter, or 0-dim")
                desc["tensors"][k] = kind
                entries.append(e)
                keep.append(t)
                continue
            if v.dim() == 0:
                kind = "whole"
                e, t = save_entry(f"{name}{OPTIM_SEP}{k}", v.detach(), [], world, coord, True)
            elif fsdp1:
                # FSDP1: state of this rank's local flat shard or original-parameter view, kept
                # as it is (stored whole); it fits only this layout's same shard coordinate.
                if full_shape != list(params[name].shape):
                    raise UnsupportedError(
                        f"optimizer state {name}[{k!r}] has shape {full_shape}, its parameter "
                        f"{list(params[name].shape)} on this rank; reshard saves FSDP1 state shaped "
                        "like its local parameter, or 0-dim (load_optimizer could not restore it)")
                kind = "local"
                e, t = raw_save_entry(f"{name}{OPTIM_SEP}{k}", v.detach(), full_shape, False, 0, 0)
            elif full_shape == list(params[name].shape):
                kind = "sharded"
                local = v.to_local() if isinstance(v, DTensor) else v
                e, t = save_entry(f"{name}{OPTIM_SEP}{k}", local.detach(), full_shape, world, coord,
                              sharded_like_param=isinstance(v, DTensor) or world == 1)
            else:
                raise UnsupportedError(f"optimizer state {name}[{k!r}] has shape {full_shape}; reshard "
                                   "saves state shaped like its parameter, or 0-dim")
            desc["tensors"][k] = kind
            entries.append(e)
            keep.append(t)
        state_desc[name] = desc
    meta = {"format": "reshard.optimizer", "format_version": 1,
            "class": type(optimizer).__name__, "param_groups": groups, "state": state_desc}
    return entries, keep, meta


def check_optimizer_files(out: str, key: str, world: int, save_id: int, step) -> None:
    """Before the manifest commits the save: every optimizer rank file is there, valid
    (preamble and header), and of this save."""
    want = (f"{save_id:016x}", step)
    for r in range(world):
        path = os.path.join(out, key, OPTIM_DIR, rank_file_name(r, world))
        if not os.path.exists(path):
            raise NotFoundError(f"{path}: missing; the optimizer state of shard {r} was not written")
        f = open_rank_file(path)
        if f.saved != want or f.rank != r or f.layout_key != key:
            raise LayoutMismatchError(f"{path}: not rank {r} of this save (id, step {want}); found rank "
                                      f"{f.rank} of {f.layout_key}, saved {f.saved}")
    if not os.path.exists(os.path.join(out, key, OPTIM_DIR, OPTIM_JSON)):
        raise NotFoundError(f"{os.path.join(out, key, OPTIM_DIR, OPTIM_JSON)}: missing")


def _dtensor_optim_layout(out: str, model: nn.Module, job, params: Optional[dict] = None) -> str:
    """The DTensor layout of OUT, of this job's mesh, that holds optimizer state (reshard.save
    of a DTensor job writes one); of several, the one whose parameters (`params`, clean name
    -> parameter: those on the job's mesh; default all) are placed as the live ones."""
    from .layout import layout_rank_file
    from .load_dtensor import placement_mismatch

    manifest = read_manifest(out)
    if manifest is None:
        raise NotFoundError(f"{out}: no reshard.json; not a complete checkpoint")
    mesh = {"names": list(job.names), "shape": list(job.shape)}
    keys = sorted(k for k, v in manifest.get("layouts", {}).items()
                  if v.get("kind") == "dtensor" and v.get("complete") and v.get("mesh") == mesh
                  and os.path.exists(os.path.join(out, k, OPTIM_DIR, OPTIM_JSON)))
    if not keys:
        raise NotFoundError(f"{out}: no optimizer state for a DTensor layout of the mesh {job.mesh_flag()} of "
                            f"this job (layouts: {', '.join(sorted(manifest.get('layouts', {}))) or 'none'}); "
                            "was it saved with reshard.save(model, OUT, optimizer=...) by a job on this mesh? "
                            "The state of another layout of OUT becomes this mesh's offline: reshard relayout "
                            f"{out} --mesh {job.mesh_flag()} --plan PLAN.json (PLAN.json: this job's parallel plan, "
                            "formats/parallel-plan.md)")
    if len(keys) == 1:
        return keys[0]
    if params is None:
        params = {clean_name(n): p for n, p in model.named_parameters()}
    for key in keys:
        f = open_rank_file(layout_rank_file(out, key, job.rank, job.world_size, manifest))
        if placement_mismatch(job, params, {t.name: t for t in f.tensors}, "", f.path) is None:
            return key
    raise LayoutMismatchError(f"{out}: optimizer state in DTensor layouts {', '.join(keys)}, none placed as "
                              "this job's parameters")


def load_optimizer(optimizer, model: nn.Module, out: str) -> int:
    """Restores the optimizer state that reshard.save wrote into OUT for this job's shard
    coordinate: every state tensor (DTensors sharded like their parameters, 0-dim tensors
    whole; FSDP1: this rank's tensors as saved, which needs the same fsdp1 layout), the
    scalars, and the param_groups' hyper-parameters. `optimizer` must hold the model's
    parameters in the same groups, in the same order, as when saved. An expert-parallel job
    (torchtitan's arrangement, reshard.load_ep): the experts' state from the DTensor layout of
    their mesh, the dense parameters' from the FSDP2 layout of their mesh dim, both checked
    (placements per parameter) before any byte moves. The state is cast as torch's
    Optimizer.load_state_dict casts it: every state tensor but `step` ends on its parameter's
    device and, for a floating-point parameter, in its dtype (a bf16 job's save resumes in an
    fp32 job with `saved.to(torch.float32)`, bit for bit; converted a batch at a time through
    host tensors of the file's dtype); `step` stays as saved, float32 on the parameter's
    device under fused or capturable. Returns the number of parameters whose state was
    restored. Raises ReshardError on any mismatch."""
    out = os.fspath(out)  # a pathlib.Path too
    from torch.distributed.tensor import DTensor

    from .load_dtensor import dtensor_job

    from .model import require_fsdp2_sharded

    require_fsdp2_sharded(model, "reshard.load_optimizer")
    job = fsdp1_job(model, "reshard.load_optimizer")
    dt_job = dtensor_job(model) if job is None else None
    # The layouts holding the state: (key, world, coord, the parameters whose state it holds or
    # None for all, the DTensor job whose placements it is checked against or None).
    parts: List[Tuple[str, int, int, Optional[set], Any]] = []
    if job is not None:
        parts.append((job.key, job.world, job.coord, None, None))
    elif dt_job is not None:  # a DTensor job: the DTensor layout of its mesh that holds optimizer state
        from .load_ep import dense_shard, split_dense

        on_mesh, dense = split_dense(dt_job, {clean_name(n): p for n, p in model.named_parameters()})
        key = _dtensor_optim_layout(out, model, dt_job, on_mesh)
        parts.append((key, dt_job.world_size, dt_job.rank, set(on_mesh) if dense else None, dt_job))
        if dense:  # expert parallel: the dense parameters' state as an FSDP2 job's
            _, ws, c = dense_shard(dt_job, dense)
            parts.append((layout_key(ws), ws, c, set(dense), None))
    else:
        world, coord = shard_coordinate(model)
        parts.append((layout_key(world), world, coord, None, None))
    if read_manifest(out) is None:
        raise NotFoundError(f"{out}: no reshard.json; not a complete checkpoint")
    plans = [_plan_part(optimizer, model, out, job, *part) for part in parts]
    if len(plans) > 1:  # one save's two layouts, each naming both
        keys = [part[0] for part in parts]
        for (_, _, _, _, meta, meta_path) in plans:
            if meta.get("parts") != keys:
                raise LayoutMismatchError(
                    f"{meta_path}: saved with the layouts {meta.get('parts')}, this expert-parallel job needs "
                    f"the optimizer state of {keys} (one reshard.save of a job on this mesh and plan)")
    for rank_file, (targets, converted), device_index, _, _, _ in plans:  # every part checked: the bytes move
        if targets:
            load_tensors(rank_file, targets, device=device_index or 0, threads=default_threads(),
                         io="buffered")
        if converted:  # read in the file's dtype, a batch at a time, then .to() the live one
            load_via_host(rank_file, {e.name: e for e in rank_file.tensors}, converted,
                          device_index or 0, default_threads(), True)
        if device_index is not None:
            torch.cuda.synchronize(device_index)
    new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
    for _, _, _, state, _, _ in plans:
        new_state.update(state)
    for p, st in new_state.items():  # sharded state becomes DTensors like its parameter
        if isinstance(p, DTensor):
            for k, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    st[k] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                               shape=p.shape, stride=p.stride())
    meta = plans[0][4]
    for saved, g in zip(meta["param_groups"], optimizer.param_groups):
        for k, v in saved.items():
            if k == "params":
                continue
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v
    optimizer.state.clear()
    for p, st in new_state.items():
        optimizer.state[p] = st
    return len(new_state)


def _group_difference(saved: List[str], live: List[Optional[str]], most: int = 4) -> str:
    """What differs between a param group as saved and as the optimizer holds it (names; None
    for a tensor that is no parameter of the model), the first few of each kind."""
    def some(names):
        names = [repr(n) if n is not None else "a tensor that is no parameter of the model" for n in names]
        return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")

    missing = [n for n in saved if n not in set(live)]
    extra = [n for n in live if n not in set(saved)]
    said = []
    if missing:
        said.append(f"{len(missing)} saved parameter(s) not in it ({some(missing)})")
    if extra:
        said.append(f"{len(extra)} of its parameter(s) not saved ({some(extra)})")
    if not said:
        i = next((i for i, (a, b) in enumerate(zip(saved, live)) if a != b), None)
        if i is None:  # one list the other's start: a parameter listed twice
            said.append(f"{len(saved)} saved against {len(live)} in the optimizer's group (a parameter listed twice)")
        else:
            said.append(f"the same {len(saved)} parameters in another order (position {i}: saved {saved[i]!r}, "
                        f"the optimizer's {live[i]!r})")
    return "; ".join(said)


def _plan_part(optimizer, model: nn.Module, out: str, job, key: str, world: int, coord: int,
               only: Optional[set], dt_job):
    """One layout's optimizer state for this rank, checked, nothing moved: (rank file, (native
    load targets, (entry name, tensor) pairs to convert from the file's dtype), device index,
    parameter -> state (tensors not yet filled, in the dtypes and on the devices _live_state
    gives), optimizer.json, its path). `only`: the parameters (clean names) whose state this
    layout must hold."""
    from .load_dtensor import live_placements

    odir = os.path.join(out, key, OPTIM_DIR)
    meta_path = os.path.join(odir, OPTIM_JSON)
    path = os.path.join(odir, rank_file_name(coord, world))
    for p in (meta_path, path):
        if not os.path.exists(p):
            others = sorted(d for d in os.listdir(out)
                            if d != key and os.path.exists(os.path.join(out, d, OPTIM_DIR, OPTIM_JSON)))
            cmd = f"reshard relayout {out} --world-size {world}"
            if job is not None:
                cmd += " --layout fsdp1 " + " ".join(f"--wrap {c}" for c in job.wrap)
                if job.use_orig_params:
                    cmd += " --use-orig-params" + (f" --param-dtype {job.param_dtype}" if job.param_dtype else "")
            entry = ((read_manifest(out) or {}).get("layouts") or {}).get(key)
            if entry is not None and not entry.get("from"):
                # This job's layout is the checkpoint's own, listed: relayout never rewrites it in
                # place; taken out, it is made again from a copy that holds the state.
                cmd = f"reshard remove {out} {key}, then {cmd} --from {others[0]}" if others else cmd
            elif entry is not None:
                cmd += f" --from {entry['from']}"
            has = (f"; {out} holds optimizer state for layout(s) {', '.join(others)} only, "
                   f"another layout than this job's {key}: make this job's layout from it offline with "
                   f"{cmd} (weights and optimizer state)" if others and only is None else "")
            raise NotFoundError(f"{p}: missing; was {out} saved with reshard.save(..., optimizer=...) "
                               f"by a job of this layout ({key}, world size {world})?{has}")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep (hostile file)
        what = "nested too deep (more than the interpreter's recursion limit)" if isinstance(e, RecursionError) \
            else f"not valid JSON (truncated or damaged: {str(e)[:200]})"
        raise CorruptFileError(f"{meta_path}: {what}; the checkpoint's optimizer description is damaged: "
                               "restore it from a copy, or resume from another checkpoint") from None
    if meta.get("format") != "reshard.optimizer" or meta.get("format_version") != 1:
        raise CorruptFileError(f"{meta_path}: not a reshard optimizer description (format version 1)")
    if meta.get("layout", key) != key:
        raise LayoutMismatchError(f"{meta_path}: saved for layout {meta['layout']}, this job's is {key}")
    if meta["class"] != type(optimizer).__name__:
        raise LayoutMismatchError(f"{meta_path}: saved from optimizer class {meta['class']}, this optimizer is "
                                  f"{type(optimizer).__name__}")
    rank_file = open_rank_file(path)
    if rank_file.rank != coord or rank_file.layout_key != key:
        raise LayoutMismatchError(f"{path}: holds rank {rank_file.rank} of layout {rank_file.layout_key}, "
                                  f"this job needs rank {coord} of {key}")
    manifest_source = read_manifest(out)["source"]
    if rank_file.source_fingerprint != manifest_source["fingerprint"]:
        raise LayoutMismatchError(f"{path}: belongs to another save than {out}/reshard.json "
                                  f"({rank_file.source_fingerprint} vs {manifest_source['fingerprint']})")
    params = param_names(model, job is not None)
    names = {id(p): n for n, p in params.items()}
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise LayoutMismatchError(f"{meta_path}: {len(meta['param_groups'])} param group(s), the optimizer "
                           f"has {len(optimizer.param_groups)}")
    for gi, (saved, g) in enumerate(zip(meta["param_groups"], optimizer.param_groups)):
        live = [names.get(id(p)) for p in g["params"]]
        if live != saved["params"]:
            raise LayoutMismatchError(f"{meta_path}: param_groups[{gi}] holds other parameters than the "
                                      f"optimizer's: {_group_difference(saved['params'], live)}. Build the "
                                      "optimizer over the same parameters, in the same groups and order, "
                                      "as the job that saved")
    entries = {t.name: t for t in rank_file.tensors}
    new_state: Dict[torch.Tensor, Dict[str, Any]] = {}
    targets: list = []
    converted: List[Tuple[str, torch.Tensor]] = []  # (entry name, tensor of the live dtype)
    device_index = None
    group_of = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    if job is not None:  # FSDP1: the state of this shard coordinate
        rank_state = meta.get("rank_state")
        if not isinstance(rank_state, list) or len(rank_state) != world:
            raise CorruptFileError(f"{meta_path}: no rank_state for the {world} shard coordinates of "
                               f"this FSDP1 job")
        state_desc = rank_state[coord]
    else:
        state_desc = meta["state"]
    for name, desc in state_desc.items():
        if name not in params:
            raise LayoutMismatchError(f"{meta_path}: state for {name}, which the model does not have")
        if only is not None and clean_name(name) not in only:
            raise LayoutMismatchError(
                f"{meta_path}: state for {name}, which this expert-parallel job does not place in layout {key} "
                f"(the experts' state is in the DTensor layout of their mesh, the dense parameters' in the "
                f"FSDP2 layout of theirs): the job's split differs from the saved one")
        p = params[name]
        local_p = local_tensor(p)
        g = optimizer.param_groups[group_of[id(p)]]
        st: Dict[str, Any] = dict(desc.get("scalars", {}))
        for k, kind in desc["tensors"].items():
            tname = f"{name}{OPTIM_SEP}{k}"
            e = entries.get(tname)
            if e is None:
                raise CorruptFileError(f"{path}: no tensor {tname!r}")
            dtype, dev = _live_state(local_p, k, g, torch_dtype(e.dtype), kind == "whole")
            if kind == "whole":
                if e.local_shape != [] or e.shard is not None:
                    raise CorruptFileError(f"{path}: {tname} is listed whole (0-dim) in {meta_path}, but "
                                           f"the rank file stores it of shape {e.local_shape}")
                t = torch.empty([], dtype=dtype, device=dev)
            elif kind == "local":
                # This rank's own state of its local flat shard / original-parameter view.
                if job is None or e.shard is not None or e.local_shape != list(local_p.shape):
                    raise LayoutMismatchError(
                        f"{path}: {tname} is this rank's local state of shape {e.local_shape}, "
                        f"but the live parameter {name} has local shape {list(local_p.shape)}"
                        f"{'' if job is not None else ' (and is no FSDP1 parameter)'}: the job's "
                        f"layout or shard coordinate differs from the saved one ({key}, rank {coord})")
                t = torch.empty(e.local_shape, dtype=dtype, device=dev)
            elif kind != "sharded":
                raise CorruptFileError(f"{meta_path}: state {name}[{k!r}] has kind {kind!r}; expected "
                                   "sharded, whole or local")
            else:
                if dt_job is not None:
                    live, fsdp = live_placements(dt_job, clean_name(name), p)
                    if list(e.placements or []) != live or e.fsdp_mesh_dim != fsdp:
                        raise LayoutMismatchError(
                            f"{path}: {tname} is placed {list(e.placements or [])} (fsdp mesh dim "
                            f"{e.fsdp_mesh_dim}), the live parameter {name} {live} (fsdp mesh dim {fsdp}): "
                            f"this job's placements differ from those saved in layout {key}. Build the job "
                            f"with the saved placements (`reshard inspect {os.path.join(path)}` lists them), or "
                            "train this one from its weights alone (reshard.load without load_optimizer)")
                if e.global_shape != list(p.shape) or e.local_shape != list(local_p.shape):
                    raise LayoutMismatchError(f"{path}: {tname} has shape {e.global_shape} (local "
                                       f"{e.local_shape}); the parameter {list(p.shape)} (local "
                                       f"{list(local_p.shape)})")
                t = torch.empty(e.local_shape, dtype=dtype, device=dev)
            if e.nbytes:
                on_dev = t.device.type == "cuda"
                if on_dev:
                    device_index = t.device.index
                if t.dtype == torch_dtype(e.dtype):
                    targets.append(target(tname, t, e.nbytes, on_dev))
                else:
                    converted.append((tname, t))
            st[k] = t
        new_state[p] = st
    return rank_file, (targets, converted), device_index, new_state, meta, meta_path


def _live_state(local_p: torch.Tensor, key: str, group: dict, file_dtype: torch.dtype, whole: bool):
    """(dtype, device) of a restored state tensor, by torch's Optimizer.load_state_dict rule:
    `step` stays in its saved dtype (0-dim: on the CPU), except under fused or capturable
    (float32 on the parameter's device); any other state goes to the parameter's device and,
    if the parameter is floating-point, its dtype (a bf16 save loads into an fp32 job's state
    as `saved.to(torch.float32)`, an fp32 save into a bf16 job's as `saved.to(torch.bfloat16)`)."""
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return torch.float32, local_p.device
        return file_dtype, (torch.device("cpu") if whole else local_p.device)
    return (local_p.dtype if local_p.is_floating_point() else file_dtype), local_p.device
