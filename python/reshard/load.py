"""Loading a rank file into a live FSDP2 (DTensor, Shard(0)) or plain model in place: the
model's parameters are matched against the file's entries, turned into raw targets, and the
copy engine moves the bytes; buffers are restored as from_pretrained has them."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .engine import (LoadReport, ProgressLine, default_threads, load_tensors, load_via_host, open_rank_file, target,
                     target_device)
from .errors import InvalidArgumentError, LayoutMismatchError, NotFoundError, UnsupportedError
from .layout import POLICY_NAMES, layout_key, layout_rank_file, read_manifest, require_manifest, torch_dtype
from .model import clean_name, fresh_buffers, persistent_buffer_names, unsaved_names, unsaved_values
from .sources import open_job_source


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter, the data of a plain one."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p.data


def shard_coordinate(model: nn.Module) -> Tuple[int, int]:
    """(world size, shard coordinate) of the job, from the parameters' placements."""
    from torch.distributed.tensor import DTensor

    found = None
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            placements = p.placements
            shard_dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
            ok = (len(shard_dims) == 1 and placements[shard_dims[0]].dim == 0 and
                  all(pl.is_replicate() for i, pl in enumerate(placements) if i != shard_dims[0]))
            if not ok:
                raise UnsupportedError(
                    f"parameter {name}: placements {placements}; reshard loads FSDP2 layouts "
                    "sharded on dim 0 along one mesh dimension (Replicate on the others, as in HSDP)")
            mesh_dim = shard_dims[0]
            this = (p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim))
        else:
            this = (1, 0)
        if found is None:
            found = (this, name)
        elif found[0] != this:
            if (1, 0) in (found[0], this) and hasattr(model, "reshard"):
                plain = found[1] if found[0] == (1, 0) else name
                raise UnsupportedError(
                    f"parameter {plain} is not sharded while others are (world size {max(found[0], this)[0]}): "
                    "FSDP2 leaves a module's parameters unsharded after a forward without backward "
                    "(an eval, generate): call model.reshard() first, or shard every parameter with "
                    "fully_shard on one mesh")
            raise UnsupportedError(
                f"parameters {found[1]} and {name} are sharded differently ({found[0]} vs {this} "
                "as (world size, shard coordinate)); shard every parameter with fully_shard on one mesh")
    if found is None:
        raise InvalidArgumentError("the model has no parameters")
    return found[0]


def find_rank_file(out: str, world_size: int, rank: int,
                   live_dtype: Optional[torch.dtype] = None) -> Tuple[str, str]:
    """Path of the rank file for this job in OUT and its layout key; raises with the command
    that would create it. A layout converted to the live dtype (`--dtype bf16` →
    fsdp2-wsN-bf16) is preferred; else the one with the checkpoint's own dtypes (fsdp2-wsN)."""
    policy = POLICY_NAMES.get(live_dtype)
    candidates = ([layout_key(world_size, dtype=policy)] if policy else []) + [layout_key(world_size)]
    convert = f"reshard convert <checkpoint> -o {out} --world-size {world_size}"
    layouts = require_manifest(out, convert).get("layouts", {})
    key = next((k for k in candidates if k in layouts), None)
    if key is None:
        have = ", ".join(sorted(layouts)) or "none"
        dtype_flag = f" --dtype {policy}" if policy else ""
        raise NotFoundError(
            f"{out} has no layout {' or '.join(candidates)} for this job (FSDP2, world size "
            f"{world_size}); it has: {have}. Create it with: {convert}{dtype_flag}")
    path = layout_rank_file(out, key, rank, world_size, {"layouts": layouts})
    if not os.path.exists(path):
        raise NotFoundError(
            f"{path}: missing rank file for shard coordinate {rank} of {world_size}. Create it with: "
            f"{convert} --ranks {rank}-{rank}"
            + (f" --dtype {layouts[key]['dtype']}" if layouts[key].get("dtype", "keep") != "keep" else ""))
    return path, key


def file_key(name: str, keys, prefix: str) -> Optional[str]:
    """The rank-file entry of model name `name`: itself, or without / with the base model
    prefix, as transformers maps checkpoint keys."""
    if name in keys:
        return name
    if prefix:
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in keys:
            return name[len(prefix) + 1:]
        if f"{prefix}.{name}" in keys:
            return f"{prefix}.{name}"
    return None


def convert_command(out: str, flags: str, note: str = "") -> str:
    """The `reshard convert` that creates what a load of OUT lacks, with `flags` (and `note`, in
    parentheses): into OUT when it is a reshard output directory (or none yet); when OUT is a
    Hugging Face checkpoint, from it into a new directory (a conversion never writes into the
    checkpoint)."""
    from .sources import hf_source

    if not os.path.exists(os.path.join(out, "reshard.json")) and hf_source(out) is not None:
        notes = "; ".join(n for n in ("OUT: a new directory, not the checkpoint; then reshard.load(model, OUT)",
                                      note) if n)
        return f"reshard convert <checkpoint> -o OUT {flags} ({notes})"
    if _saved_checkpoint(out):
        notes = "; ".join(n for n in (f"OUT: a new directory: {out} holds a checkpoint reshard.save wrote, which "
                                      "a conversion never writes into; the same checkpoint at another world size "
                                      f"or mesh: reshard relayout {out} {flags}", note) if n)
        return f"reshard convert <checkpoint> -o OUT {flags} ({notes})"
    return f"reshard convert <checkpoint> -o {out} {flags}" + (f" ({note})" if note else "")


def _saved_checkpoint(out: str) -> bool:
    """Whether OUT/reshard.json says reshard.save wrote OUT (its source is a save, not files)."""
    from .errors import ReshardError

    try:
        manifest = read_manifest(out)
    except ReshardError:  # a damaged manifest: the load's own error says so
        return False
    return manifest is not None and "saved" in manifest.get("source", {})


def open_job_file(out: str, world_size: int, coord: int, live_dtype: Optional[torch.dtype] = None):
    """(path, layout key, opened rank file) of this job's shard coordinate in OUT, checked to
    be that rank's and listed by OUT/reshard.json (source, dtype, size)."""
    path, key = find_rank_file(out, world_size, coord, live_dtype)
    rank_file = open_rank_file(path)
    if rank_file.world_size != world_size or rank_file.rank != coord:
        raise LayoutMismatchError(f"{path}: holds rank {rank_file.rank} of {rank_file.world_size}, "
                                  f"expected {coord} of {world_size}")
    rank_file.check_listed(out, key, coord)
    return path, key, rank_file


def move_tensors(rank_file, entries, direct, converted, device_index, *, threads, verify, io):
    """Moves the bytes: direct targets through the native loader, converted ones (and
    buffers) through host batches. Returns (native stats, host bytes, host seconds)."""
    n_threads = threads or default_threads()
    dev = device_index or 0
    result = load_tensors(rank_file, direct, device=dev, threads=n_threads, verify=verify, io=io)
    b, sec = load_via_host(rank_file, entries, converted, dev, n_threads, verify)
    return result, b, sec


def finish_load(model, rank_file, key, world_size, coord, entries, direct, converted,
                buffers, needs_fresh, device_index, *, threads, verify, io,
                strict_buffers, rename=None, buffers_of=None, source: str = "rank file") -> LoadReport:
    """Moves the bytes, restores non-persistent buffers (the values reshard.empty_model kept
    on `buffers_of`, default `model`), waits for the device, reports."""
    result, b, sec = move_tensors(rank_file, entries, direct, converted + buffers, device_index,
                                  threads=threads, verify=verify, io=io)
    restored = restore_buffers(model, needs_fresh, strict_buffers, rename, buffers_of)
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    total_bytes, total_seconds = result.bytes + b, result.seconds + sec
    return LoadReport(file=rank_file.path, layout=key, rank=coord, world_size=world_size, bytes=total_bytes,
                      seconds=total_seconds, gbps=total_bytes / total_seconds / 1e9 if total_seconds else 0.0,
                      tensors=len(direct) + len(converted) + len(buffers),
                      staging_bytes=result.staging_bytes, direct_io=result.direct_io,
                      # a view converts while reading (its dtype policy), a rank file here
                      threads=result.threads,
                      converted_tensors=len(converted) + int(getattr(rank_file, "converted_tensors", 0) or 0),
                      buffers_restored=restored, staging_alloc_seconds=result.staging_alloc_seconds,
                      pooled=result.pooled, source=source)


def _identity(name: str) -> str:
    return name


def plan_buffers(model: nn.Module, entries: dict, prefix: str, path: str, used: set, rename=None):
    """Persistent buffers come from the file ((key, buffer) pairs); non-persistent ones (and
    persistent ones the file lacks) are restored as from_pretrained computes them (their
    names; fresh_buffers). `rename` maps a live name to the Hugging Face model's (PEFT)."""
    rename = rename or _identity
    persistent = {rename(n) for n in persistent_buffer_names(model)}
    targets = []
    needs_fresh = []
    for name, b in model.named_buffers():
        name = rename(clean_name(name))
        if name is None:  # a PEFT adapter's (none today)
            continue
        key_in_file = file_key(name, entries, prefix)
        if name in persistent and key_in_file is not None:
            e = entries[key_in_file]
            used.add(key_in_file)
            if e.shard is not None and e.local_shape != e.global_shape:
                raise LayoutMismatchError(
                    f"buffer {name} is stored sharded in {path}: FSDP2 keeps buffers whole on every rank, "
                    "and this layout was converted without the model manifest (which names the persistent "
                    "buffers, to store them whole). Convert again with Python (reshard, transformers) "
                    f"importable: reshard convert <checkpoint> -o {os.path.dirname(os.path.dirname(path))} "
                    "--world-size N (or first: python -m reshard.model_manifest <checkpoint> -o "
                    f"{os.path.join(os.path.dirname(os.path.dirname(path)), 'reshard-model.json')})")
            targets.append((key_in_file, b))
        else:
            # Non-persistent buffers are never in a checkpoint; a persistent one that the
            # checkpoint lacks is initialised by from_pretrained (a missing key): both come
            # from the values reshard.empty_model computed as from_pretrained does.
            needs_fresh.append(name)
    return targets, needs_fresh


def restore_buffers(model: nn.Module, needs_fresh: List[str], strict_buffers: bool,
                    rename=None, buffers_of: Optional[nn.Module] = None) -> List[str]:
    restored = []
    if needs_fresh:
        fresh = fresh_buffers(buffers_of if buffers_of is not None else model)
        rename = rename or _identity
        missing_fresh = [n for n in needs_fresh if fresh is None or n not in fresh]
        if missing_fresh and strict_buffers:
            raise InvalidArgumentError(
                f"cannot restore buffers {missing_fresh} (not in the rank file, and to_empty left "
                "them uninitialised): build the model with reshard.empty_model(OUT), or restore "
                "them yourself and pass strict_buffers=False")
        with torch.no_grad():
            for name, b in model.named_buffers():
                name = rename(clean_name(name))
                if name is not None and name in needs_fresh and fresh is not None and name in fresh:
                    b.copy_(fresh[name])
                    restored.append(name)
    return restored


def param_target(name: str, p: torch.Tensor, key_in_file: str, e, path: str, convert_cmd: str,
                 device_index: Optional[int]):
    """Checks live parameter `name` against its rank-file entry `e` and says how it loads:
    ("direct", a native target), ("converted", (key, local)) when the dtypes differ, or
    ("empty", None) for an empty shard; and the rank's CUDA device index so far."""
    local = local_tensor(p)
    if local.device.type == "meta":
        raise InvalidArgumentError(f"parameter {name} is on the meta device: call "
                                   "model.to_empty(device=...) before reshard.load")
    if list(p.shape) != e.global_shape:
        raise LayoutMismatchError(
            f"parameter {name}: the model has global shape {list(p.shape)}, {path} has "
            f"{e.global_shape}: another model or config. Convert this model's checkpoint: {convert_cmd}")
    if list(local.shape) != e.local_shape:
        raise LayoutMismatchError(
            f"parameter {name}: local shard shape {list(local.shape)} but {path} holds "
            f"{e.local_shape} (rows {e.shard}); the layout does not match this job. "
            f"Convert for it: {convert_cmd}")
    if not local.is_contiguous():
        raise UnsupportedError(f"parameter {name}: local shard is not contiguous")
    try:
        file_dtype = torch_dtype(e.dtype)
    except ValueError:
        raise UnsupportedError(f"parameter {name}: file dtype {e.dtype} has no torch dtype") from None
    on_device, device_index = target_device(local, f"parameter {name}", device_index)
    if e.nbytes == 0:
        return "empty", None, device_index
    if local.dtype == file_dtype:
        return "direct", target(key_in_file, local, e.nbytes, on_device), device_index
    if not (local.dtype.is_floating_point and file_dtype.is_floating_point):
        raise UnsupportedError(
            f"parameter {name}: live dtype {local.dtype}, file dtype {file_dtype}; only "
            "floating-point dtypes are converted at load time")
    return "converted", (key_in_file, local), device_index


def load_saved_adapters(out: str, world_size: int, coord: int, params, *, threads, verify, io) -> int:
    """Loads a PEFT model's adapter parameters (`params`: PEFT's saved key -> live parameter)
    from OUT, a reshard.save of the adapters at this world size, through the copy engine;
    returns the bytes read. Raises naming what does not match."""
    from .merge import read_record

    path, _, rank_file = open_job_file(out, world_size, coord)
    entries = {t.name: t for t in rank_file.tensors}
    record = read_record(out)
    if record is not None:  # a save holding the base too: only the adapter's tensors
        entries = {k: e for k, e in entries.items() if k in set(record["adapter_tensors"])}
    absent = sorted(k for k in params if k not in entries)
    extra = sorted(k for k in entries if k not in params)
    if absent or extra:
        what = (f"has no tensor {', '.join(absent[:4])}" if absent else
                f"has tensor(s) the model has no adapter parameter for: {', '.join(extra[:4])}")
        raise LayoutMismatchError(f"{path}: {what}: the adapters of another base model or PEFT config")
    cmd = "reshard.save the adapters from a job of this world size"
    direct, converted, device_index = [], [], None
    for k, p in params.items():
        kind, t, device_index = param_target(k, p, k, entries[k], path, cmd, device_index)
        if kind == "direct":
            direct.append(t)
        elif kind == "converted":
            converted.append(t)
    r, b, _ = move_tensors(rank_file, entries, direct, converted, device_index, threads=threads,
                           verify=verify, io=io)
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    return r.bytes + b


def load(model: nn.Module, out: str, *, threads: Optional[int] = None, verify: bool = True,
         io: str = "auto", strict_buffers: bool = True, adapter: Optional[str] = None,
         progress: bool = False) -> LoadReport:
    """Loads this rank's shard from OUT into `model` in place.

    `model` is an FSDP2 model (fully_shard'ed, to_empty'd, before its first forward) or a plain
    module (world size 1) on CUDA or CPU. Every parameter is checked against the rank file
    (name, global shape, local shape, dtype) before any byte moves; a mismatch raises
    LayoutMismatchError naming the parameter. Non-persistent buffers (and persistent ones the
    file lacks) get the values from_pretrained gives them. Raises a ReshardError on any
    failure; then the model must be considered not loaded.

    FSDP1 models (FullyShardedDataParallel, any sharding strategy) load from an fsdp1 layout
    whose units match the live FlatParameters exactly (reshard.load_fsdp1).

    PEFT (LoRA) models: the base parameters load from OUT by their original names; the adapter
    parameters from `adapter` (a PEFT adapter directory: adapter_model.safetensors and
    adapter_config.json) when given, else with PEFT's own initialisation, which
    reshard.empty_model(OUT, peft_config=...) keeps (reshard.adapters).

    `progress`: a line on stderr showing the bytes landed, the rate and the time left while
    the load runs (e.g. progress=(rank == 0 and sys.stderr.isatty()), as reshard.train does);
    nothing for a load that ends within half a second."""
    with ProgressLine(f"rank {_rank_label()}: reshard.load", enabled=progress):
        try:
            return _load(model, out, threads=threads, verify=verify, io=io,
                         strict_buffers=strict_buffers, adapter=adapter)
        except LayoutMismatchError as e:
            # "another model or config": when OUT's config.json names another model_type, say
            # that first; its "convert into OUT" would be refused (OUT holds another source).
            from .sources import another_model_type

            inner = getattr(model, "module", model)
            why = another_model_type(os.fspath(out), getattr(inner, "_fsdp_wrapped_module", inner)) \
                if "another model or config" in str(e) else ""
            if not why:
                raise
            raise LayoutMismatchError(f"{why}. ({e})") from None


def _rank_label() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return "0"


def _note_unsharded_in_a_group(model: nn.Module, world_size: int, out: str) -> None:
    """A model with no sharded parameter loaded by a process of a group of several: every rank
    reads the whole model. Right for DDP; under FSDP it means fully_shard was not called
    before the load (each rank then holds everything): said once, as a warning."""
    import torch.distributed as dist
    import warnings

    if world_size != 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    warnings.warn(f"reshard.load: the model is not sharded (no fully_shard / FSDP parameters), and this process "
                  f"is one of {dist.get_world_size()}: each rank loads the whole model from {out}. Right for DDP; "
                  "under FSDP call fully_shard (and to_empty) before reshard.load, which then reads only this "
                  "rank's part", stacklevel=4)


def _refuse_ties_held_apart(hf_model: nn.Module, out: str) -> None:
    """A pair the model ties (all_tied_weights_keys) that OUT holds with different values would
    load one value into both; from_pretrained unties it instead (reshard.ties). Refused, naming
    both, before any byte moves; the same on every rank (decided from the layout's headers)."""
    from .ties import differing_tied_pairs, untie_message

    ties = getattr(hf_model, "all_tied_weights_keys", None)
    if not isinstance(ties, dict) or not ties:
        return
    shapes = {}
    for t in ties:
        try:
            shapes[str(t)] = list(hf_model.get_parameter(str(t)).shape)  # global (a DTensor's too)
        except AttributeError:
            pass
    differ = differing_tied_pairs(out, [(str(t), str(s)) for t, s in ties.items()],
                                  getattr(hf_model, "base_model_prefix", "") or "", shapes)
    if differ:
        raise LayoutMismatchError(
            untie_message(differ, out) + ": loaded tied, the model would hold one of the two values in both. "
            f"Build it with reshard.empty_model({out!r}), which unties them as from_pretrained does, or build it "
            "from a config with tie_word_embeddings=False")


def _load(model: nn.Module, out: str, *, threads, verify, io, strict_buffers, adapter) -> LoadReport:
    from .adapters import adapter_names, is_peft_model, load_adapters
    from .load_fsdp1 import fsdp1_units, load_fsdp1

    out = os.fspath(out)  # a pathlib.Path too

    names = adapter_names(model) if is_peft_model(model) else None
    units = fsdp1_units(model)
    if units:
        if names is not None:
            raise UnsupportedError(
                "a PEFT model under FSDP1 (FullyShardedDataParallel): reshard loads PEFT models "
                "under FSDP2 (fully_shard) or unsharded")
        return load_fsdp1(model, out, units, threads=threads, verify=verify, io=io,
                          strict_buffers=strict_buffers)
    if adapter is not None and names is None:
        raise InvalidArgumentError(f"adapter={adapter!r} given, but the model has no PEFT layers "
                                   "(wrap it with peft.get_peft_model, or build it with "
                                   "reshard.empty_model(OUT, peft_config=...))")
    hf_model = names.inner if names is not None else model
    rename = names.base_name if names is not None else _identity
    from .load_dtensor import dtensor_job, load_dtensor
    from .model import require_fsdp2_sharded

    require_fsdp2_sharded(model, "reshard.load")
    _refuse_ties_held_apart(hf_model, out)

    dt_job = dtensor_job(model)
    if dt_job is not None:  # tensor / expert parallel on a mesh of several dims
        if names is not None:
            raise UnsupportedError("a PEFT model on a DTensor mesh of several dims: reshard loads PEFT "
                                   "models under FSDP2 (fully_shard) or unsharded")
        return load_dtensor(model, out, dt_job, threads=threads, verify=verify, io=io,
                            strict_buffers=strict_buffers)
    world_size, coord = shard_coordinate(model)
    _note_unsharded_in_a_group(model, world_size, out)
    if world_size == 1 and hasattr(hf_model, "tie_weights"):
        # nn.Module.to_empty gives each module its own new parameter, silently untying
        # shared weights of a plain (not fully_shard'ed) model; tie them again first.
        hf_model.tie_weights()
    # Parameters by the Hugging Face model's names; a PEFT model's adapters apart.
    params, adapter_params = {}, {}
    for n, p in model.named_parameters():
        n = clean_name(n)
        base = rename(n)
        if base is None:
            adapter_params[n] = p
        else:
            params[base] = p
    float_dtypes = {local_tensor(p).dtype for p in params.values() if p.is_floating_point()}
    live_dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
    persistent = {clean_name(n) for n in persistent_buffer_names(hf_model)}  # the HF model's own names
    job = open_job_source(out, world_size, coord, live_dtype, hf_model, list(params), persistent)
    path, key, rank_file = job.path, job.key, job.reader
    entries = {t.name: t for t in rank_file.tensors}
    saved_adapters = set()
    if names is not None:
        from .layout import read_manifest
        from .merge import read_record

        manifest = read_manifest(out)
        record = read_record(out) if manifest is not None else None
        if record is not None:  # a PEFT save: its adapter tensors are not the base's
            saved_adapters = set(record["adapter_tensors"])
            if record["base"].get("stored") and adapter is None:
                adapter = out  # reshard.save(..., base=True): base and adapters from OUT alone
            elif not record["base"].get("stored"):
                base_out = record["base"].get("out") or "BASE_OUT"
                raise InvalidArgumentError(
                    f"{out} holds a PEFT model's adapters without its base (reshard.save(..., base=True) "
                    f"stores both): reshard.load(model, {base_out!r}, adapter={out!r})")
        if manifest is not None:  # where the base came from, for reshard.save's record
            model._reshard_base = {"out": os.path.abspath(out), "layout": key, "source": manifest.get("source")}
    prefix = getattr(hf_model, "base_model_prefix", "") or ""
    convert_cmd = convert_command(out, f"--world-size {world_size}")

    direct = []
    converted: List[Tuple[str, torch.Tensor]] = []
    used = set()
    device_index = None
    found = param_sources(model, hf_model, params, entries, prefix, rename)
    missing = found.missing
    for name, key_in_file in found.keys.items():
        used.add(key_in_file)
        kind, t, device_index = param_target(name, params[name], key_in_file, entries[key_in_file], path,
                                             convert_cmd, device_index)
        if kind == "direct":
            direct.append(t)
        elif kind == "converted":
            converted.append(t)
    if missing:
        from .conversion import hub_names_cause

        head = (f"{len(missing)} parameter(s) of the model are not in {path}: {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''}. ")
        cause = hub_names_cause(hf_model, [k for k in entries if k not in used], missing)
        if cause:
            raise LayoutMismatchError(
                head + cause[0].upper() + cause[1:] + f". Convert again with Python (reshard, transformers) importable, which captures "
                f"it: {convert_cmd} (or first: python -m reshard.model_manifest <checkpoint> -o "
                f"{os.path.join(out, 'reshard-model.json')})")
        from .layout import read_manifest

        parts = ((read_manifest(out) or {}).get("layouts", {}).get(key) or {}).get("parts") if os.path.isdir(out) else None
        if parts:  # an expert-parallel save's dense part: not the whole model
            raise LayoutMismatchError(
                head + f"Layout {key} of {out} is one part of an expert-parallel save ({' + '.join(parts)}): "
                "load it into a job arranged as it was saved (experts over an ep mesh dim: reshard.ep.parallelize, "
                f"or reshard.train --ep N), or export each part: reshard export {out} --layout KEY")
        raise LayoutMismatchError(head + "Is OUT converted from this model's checkpoint? " + convert_cmd)

    buffers, needs_fresh = plan_buffers(model, entries, prefix, path, used, rename)
    unexpected = sorted(set(entries) - used)
    aliases = set()
    for n, _ in model.named_parameters(remove_duplicate=False):
        n = rename(clean_name(n))
        k = file_key(n, entries, prefix) if n is not None else None
        if k is not None:
            aliases.add(k)
    unexpected = [k for k in unexpected if k not in aliases and k not in saved_adapters]
    if unexpected:
        warnings.warn(f"{path}: {len(unexpected)} tensor(s) not used by the model: "
                      f"{', '.join(unexpected[:8])}", stacklevel=2)

    check_untied(params, found.untied, path)
    report = finish_load(model, rank_file, key, world_size, coord, entries, direct, converted,
                         buffers, needs_fresh, device_index, threads=threads, verify=verify, io=io,
                         strict_buffers=strict_buffers, rename=rename, buffers_of=hf_model,
                         source=job.source)
    if names is not None:
        report.adapters = load_adapters(model, names, adapter_params, adapter, world_size, coord,
                                        threads=threads, verify=verify, io=io)
    complete_sources(model, hf_model, params, found, report)
    return report


@dataclasses.dataclass
class ParamSources:
    """Where each parameter of a load comes from (param_sources)."""
    keys: Dict[str, str]                       # name -> the entry holding it
    # Parameters the model never saves (Marian's sinusoidal positions) that the source lacks:
    # from_pretrained computes them, and so does fill_unsaved after the load.
    computed: List[Tuple[str, torch.Tensor]]
    # (name, partner): parameters the model ties but the sharding split in two (fully_shard of
    # units that hold one name each): the copy takes its tie partner's values after the load.
    untied: List[Tuple[str, str]]
    missing: List[str]                         # none of the above: the source is another model's


def param_sources(model: nn.Module, hf_model: nn.Module, params: Dict[str, torch.Tensor], entries, prefix: str,
                  rename=None) -> ParamSources:
    """The entry of `entries` each of `params` (the Hugging Face model's names) loads from: its
    own name (with / without the base model prefix), else another name of the same parameter,
    else its tie partner's (untied), else computed (never saved), else missing. `model` is
    the live module (a PEFT model's wrapper: `rename` maps its names), `hf_model` the Hugging
    Face model inside it."""
    rename = rename or _identity
    unsaved = unsaved_names(hf_model)
    # Every name of each parameter: a tie the sharding kept is one parameter with two names, and
    # named_parameters gives the first in module order, which need not be the one save_pretrained
    # kept (LUKE ties lm_head.bias to lm_head.decoder.bias: the file holds only the latter).
    names_of: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        base = rename(clean_name(n))
        if base is not None:
            names_of.setdefault(id(p), []).append(base)
    found = ParamSources({}, [], [], [])
    for name, p in params.items():
        key_in_file = file_key(name, entries, prefix)
        if key_in_file is None:
            key_in_file = next((k for k in (file_key(a, entries, prefix) for a in names_of.get(id(p), [])
                                            if a != name) if k is not None), None)
        if key_in_file is not None:
            found.keys[name] = key_in_file
            continue
        partner = tie_partner(hf_model, name, params, entries, prefix)
        if partner is None and name in unsaved:
            found.computed.append((name, p))
        elif partner is None:
            found.missing.append(name)
        else:
            found.untied.append((name, partner))
    return found


def check_untied(params: Dict[str, torch.Tensor], untied: List[Tuple[str, str]], path: str) -> None:
    """Refuses, before any byte moves, an untied pair whose local parts differ (shape, or
    DTensor placements): the copy of the partner's values after the load would be wrong."""
    from torch.distributed.tensor import DTensor

    for name, partner in untied:
        pa, pb = params[name], params[partner]
        a, b = local_tensor(pa), local_tensor(pb)
        placed = [(p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in (pa, pb)]
        if a.shape != b.shape or placed[0] != placed[1]:
            raise LayoutMismatchError(
                f"parameter {name} (tied to {partner} in the model, which {path} holds): the sharding "
                f"made them two parameters with local shapes {list(a.shape)} and {list(b.shape)}"
                f"{'' if placed[0] == placed[1] else ', placed differently'}; "
                "shard the modules holding both in one unit")


def complete_sources(model: nn.Module, hf_model: nn.Module, params: Dict[str, torch.Tensor],
                     found: ParamSources, report: LoadReport) -> None:
    """After the bytes moved: the never-saved parameters computed, untied ones copied from their
    partners (recorded on `report` and the model, with a warning)."""
    if found.computed:
        fill_unsaved(hf_model, found.computed)
    untied = found.untied
    if untied:
        with torch.no_grad():
            for name, partner in untied:
                local_tensor(params[name]).copy_(local_tensor(params[partner]))
        report.untied = [f"{name} = {partner}" for name, partner in untied]
        model._reshard_untied = {name: partner for name, partner in untied}  # for check_weights
        warnings.warn(
            f"{len(untied)} tied parameter pair(s) are two parameters in this sharded model "
            f"({'; '.join(report.untied[:4])}): the sharding put them in different units. Both were "
            "loaded with the checkpoint's values, but training updates them separately; to keep them "
            "tied, shard the modules holding both names in one unit (e.g. do not fully_shard the "
            "embeddings module on its own)", stacklevel=3)


def fill_unsaved(model: nn.Module, computed: List[Tuple[str, torch.Tensor]]) -> None:
    """Writes each parameter the model never saves (reshard.model.unsaved_names) with the
    values from_pretrained computes for it: a DTensor its local part (the global offset and
    local shape of its placements), a plain parameter all of it."""
    from torch.distributed.tensor import DTensor

    values = unsaved_values(model)
    with torch.no_grad():
        for name, p in computed:
            v = values.get(name)
            if v is None or tuple(v.shape) != tuple(p.shape):
                raise LayoutMismatchError(
                    f"parameter {name}: the model never saves it (_keys_to_ignore_on_save) and its "
                    f"values could not be computed as from_pretrained computes them"
                    f"{'' if v is None else f' (shape {list(v.shape)}, the model has {list(p.shape)})'}")
            local = local_tensor(p)
            if isinstance(p, DTensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                v = v[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            local.copy_(v.to(local.dtype))


def tie_partner(model: nn.Module, name: str, params, entries, prefix: str) -> Optional[str]:
    """The live parameter that transformers ties `name` to (`all_tied_weights_keys`, either
    direction) when it is a separate parameter of the model and the rank file holds it."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    if not isinstance(ties, dict):
        return None
    group = {name}
    for tied, source in ties.items():
        if isinstance(tied, str) and isinstance(source, str) and name in (tied, source):
            group |= {tied, source}
    for other in sorted(group - {name}):
        if other in params and params[other] is not params[name] and \
                file_key(other, entries, prefix) is not None:
            return other
    return None
