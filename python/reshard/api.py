"""The torch-aware half of the loader: matches a live (FSDP2 or plain) model against a rank
file, builds raw (pointer, size) targets, and lets the native module move the bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from . import _C
from ._C import ReshardError
from .format import torch_dtype

# Host memory used at once by dtype-converting loads (file dtype != live dtype).
_CONVERT_BATCH_BYTES = 64 << 20


_chosen_threads: Optional[int] = None  # set by prepare(threads=...): the process's default


def _default_threads() -> int:
    """Reader threads of a load (and lanes of its CUDA copier) when the caller names none:
    what reshard.prepare(threads=...) chose for this process, else 16 (the best measured on
    the GPU machine, BENCHMARKS.md §7) or this process's share of the CPUs it may run on
    among the job's processes on this host (torchrun's LOCAL_WORLD_SIZE), at least 4. One
    number per process keeps it to one copy engine (streams and pinned staging)."""
    if _chosen_threads:
        return _chosen_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(4, min(16, cpus // local))


_atexit_registered = False


def prepare(device=None, threads: Optional[int] = None, *, wait: bool = False) -> bool:
    """Starts making the CUDA copy engine of this process (streams and pinned staging) on a
    background thread, so that the first reshard.load finds it ready instead of paying its
    one-time set-up (5-11 ms measured on the GPU machine, BENCHMARKS.md §7). Call it early, e.g. right after choosing the
    rank's GPU and before building the model; reshard.empty_model and
    reshard.fsdp1_param_init_fn call it for you when CUDA is initialised. `threads` becomes
    this process's default for reshard.load and reshard.load_optimizer (so they use the copy
    engine prepared here). A load that comes before the set-up has finished waits for it.
    Returns False (and does nothing) without CUDA or with RESHARD_PREPARE=0; with `wait`,
    returns once the set-up is done (raising what it met)."""
    global _atexit_registered, _chosen_threads
    if os.environ.get("RESHARD_PREPARE", "1") == "0" or not torch.cuda.is_available():
        return False
    if not _C.build_info()["cuda"]:
        return False
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _atexit_registered:  # no set-up thread may still run while the process exits
        import atexit

        atexit.register(_wait_prepared_at_exit)
        _atexit_registered = True
    if threads:
        _chosen_threads = int(threads)
    _C.prepare(index, _default_threads(), wait=wait)
    return True


def _wait_prepared_at_exit() -> None:
    try:
        _C.wait_prepared()
    except Exception:  # noqa: BLE001 - a set-up nobody used failed: nothing to report now
        pass


def _prepare_quietly(device=None) -> None:
    """prepare() where CUDA is already initialised (never creates a context on its own) and
    the device is this process's own: the given one, or the current device when it is the
    one torchrun's LOCAL_RANK points at (a process that touched CUDA before set_device would
    otherwise set up GPU 0 for every rank)."""
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        if device is None:
            local = os.environ.get("LOCAL_RANK")
            if local is not None and torch.cuda.current_device() != int(local) % torch.cuda.device_count():
                return
        prepare(device)
    except Exception:  # noqa: BLE001 - an optimisation only: the load does the set-up itself
        pass


@dataclasses.dataclass
class LoadReport:
    file: str
    layout: str
    rank: int
    world_size: int
    bytes: int
    seconds: float
    gbps: float
    tensors: int
    staging_bytes: int
    direct_io: bool
    threads: int
    converted_tensors: int
    buffers_restored: List[str]
    staging_alloc_seconds: float = 0.0  # of `seconds`: pinned staging made by this load (0: reused/prepared)
    pooled: bool = False  # the reader threads were the copy engine's own (started once, by prepare)


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p.data


def _shard_coordinate(model: nn.Module) -> Tuple[int, int]:
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
                raise ReshardError(
                    f"parameter {name}: placements {placements}; reshard loads FSDP2 layouts "
                    "sharded on dim 0 along one mesh dimension (Replicate on the others, as in HSDP)")
            mesh_dim = shard_dims[0]
            this = (p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim))
        else:
            this = (1, 0)
        if found is None:
            found = (this, name)
        elif found[0] != this:
            raise ReshardError(
                f"parameters {found[1]} and {name} are sharded differently ({found[0]} vs {this} "
                "as (world size, shard coordinate)); shard every parameter with fully_shard on one mesh")
    if found is None:
        raise ReshardError("the model has no parameters")
    return found[0]


_POLICY_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def find_rank_file(out: str, world_size: int, rank: int,
                   live_dtype: Optional[torch.dtype] = None) -> Tuple[str, str]:
    """Path of the rank file for this job in OUT and its layout key; raises with the command
    that would create it. A layout converted to the live dtype (`--dtype bf16` →
    fsdp2-wsN-bf16) is preferred; else the one with the checkpoint's own dtypes (fsdp2-wsN)."""
    base = f"fsdp2-ws{world_size}"
    policy = _POLICY_NAMES.get(live_dtype)
    candidates = ([f"{base}-{policy}"] if policy else []) + [base]
    manifest_path = os.path.join(out, "reshard.json")
    if not os.path.exists(manifest_path):
        raise ReshardError(
            f"{out}: no reshard.json; this is not a reshard output directory. Create one with: "
            f"reshard convert <checkpoint> -o {out} --world-size {world_size}")
    with open(manifest_path) as f:
        manifest = json.load(f)
    layouts = manifest.get("layouts", {})
    key = next((k for k in candidates if k in layouts), None)
    if key is None:
        have = ", ".join(sorted(layouts)) or "none"
        dtype_flag = f" --dtype {policy}" if policy else ""
        raise ReshardError(
            f"{out} has no layout {' or '.join(candidates)} for this job (FSDP2, world size "
            f"{world_size}); it has: {have}. Create it with: reshard convert <checkpoint> -o {out} "
            f"--world-size {world_size}{dtype_flag}")
    name = f"rank-{rank:05d}-of-{world_size:05d}.reshard"
    path = os.path.join(out, key, name)
    if not os.path.exists(path):
        raise ReshardError(
            f"{path}: missing rank file for shard coordinate {rank} of {world_size}. Create it with: "
            f"reshard convert <checkpoint> -o {out} --world-size {world_size} --ranks {rank}-{rank}"
            + (f" --dtype {layouts[key]['dtype']}" if layouts[key].get("dtype", "keep") != "keep" else ""))
    return path, key


def _load_via_host(path: str, entries: dict, items, dev: int, n_threads: int, verify: bool):
    """Loads entries into host tensors of the file's dtype, batch by batch, and copies them
    into their destinations (converting exactly as Tensor.to() when the dtypes differ).
    Returns (bytes, seconds)."""
    total_bytes, total_seconds = 0, 0.0
    batch, size = [], 0
    for item in list(items) + [None]:
        if item is not None:
            k, dst = item
            e = entries[k]
            batch.append((k, dst, torch.empty(e["local_shape"], dtype=torch_dtype(e["dtype"]))))
            size += e["nbytes"]
        if batch and (item is None or size >= _CONVERT_BATCH_BYTES):
            r = _C.load(path, [(k, t.data_ptr(), t.numel() * t.element_size(), False)
                               for k, _, t in batch], device=dev, threads=n_threads,
                        verify=verify, io="buffered")
            total_bytes += r["bytes"]
            total_seconds += r["seconds"]
            with torch.no_grad():
                for _, dst, t in batch:
                    dst.copy_(t)  # same rounding as Tensor.to()
            batch, size = [], 0
    return total_bytes, total_seconds


def _file_key(name: str, keys, prefix: str) -> Optional[str]:
    if name in keys:
        return name
    if prefix:
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in keys:
            return name[len(prefix) + 1:]
        if f"{prefix}.{name}" in keys:
            return f"{prefix}.{name}"
    return None


def _fresh_buffers(model: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """Non-persistent buffers (and persistent ones that a checkpoint may lack) as
    from_pretrained has them for this model: the stash reshard.empty_model made, else those of
    a fresh copy of a Hugging Face model built as from_pretrained builds it (see
    _init_buffers_as_from_pretrained), in the dtype of its floating-point parameters."""
    stash = getattr(model, "_reshard_buffers", None)
    if stash is not None:
        return stash
    model = getattr(model, "_fsdp_wrapped_module", model)
    stash = getattr(model, "_reshard_buffers", None)
    if stash is not None:
        return stash
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    cls = next((c for c in type(model).__mro__
                if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP")), None)
    if cls is None or not hasattr(model, "config"):
        return None
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = getattr(model, "_reshard_build_dtype", None) or (dtypes.pop() if len(dtypes) == 1 else None)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        fresh = cls._from_config(model.config, dtype=dtype) if dtype is not None else cls(model.config)
    _init_buffers_as_from_pretrained(fresh)
    return _buffer_values(fresh)


def _init_buffers_as_from_pretrained(model: nn.Module) -> None:
    """Recomputes the buffers of a just-built model (parameters on meta) the way from_pretrained
    leaves them: from_pretrained builds under its dtype (torch's default dtype set to it, so a
    buffer computed in the constructor may be computed in bf16/fp16), then, after leaving that
    context, runs the model's own initialize_weights() on everything the checkpoint did not
    provide, which recomputes buffers such as GPT-J's `embed_positions` or a rotary
    `inv_freq` in the caller's default dtype (fp32). Here every parameter is marked
    initialised (transformers' init functions skip those), the modules' flags are cleared,
    and initialize_weights() runs, so that only buffers are written. Models without
    initialize_weights keep their constructor's values."""
    init_fn = getattr(model, "initialize_weights", None)
    if init_fn is None:
        return
    params = [p for p in model.parameters()]
    module_flags = [(m, m.__dict__.get("_is_hf_initialized")) for m in model.modules()]
    for p in params:
        p._is_hf_initialized = True
    for m, _ in module_flags:
        m.__dict__.pop("_is_hf_initialized", None)
    try:
        with torch.no_grad():
            init_fn()
    finally:
        for p in params:
            p.__dict__.pop("_is_hf_initialized", None)
        for m, flag in module_flags:
            m.__dict__.pop("_is_hf_initialized", None)
            if flag is not None:
                m._is_hf_initialized = flag


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _clean_name(name: str) -> str:
    """A module/parameter/buffer path without FSDP1 / activation-checkpoint wrapper parts."""
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_PARTS)


def _persistent_buffer_names(model: nn.Module) -> set:
    """Names of the persistent buffers, as state_dict() would list them, without calling it
    (FSDP1's state_dict() gathers the whole model)."""
    names = set()
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                names.add(_clean_name(f"{mname}.{bname}" if mname else bname))
    return names


def _buffer_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of every buffer (persistent or not) by clean name: non-persistent ones are
    restored from here after to_empty; persistent ones from here only when the rank file
    lacks them (as from_pretrained initialises a missing key)."""
    return {_clean_name(n): b.detach().clone() for n, b in model.named_buffers()
            if b is not None and not b.is_meta}


def _weights_dtype(out: str) -> Optional[torch.dtype]:
    """from_pretrained(dtype="auto") on a config without a dtype takes the first floating
    tensor's dtype of the checkpoint's first file; here the dtype of the first floating tensor
    (by name) of rank 0 of a layout that keeps the source's dtypes. None when OUT has none."""
    try:
        with open(os.path.join(out, "reshard.json")) as f:
            layouts = json.load(f).get("layouts", {})
    except (OSError, ValueError):
        return None
    for key in sorted(layouts):
        entry = layouts[key]
        if entry.get("dtype", "keep") != "keep" or not entry.get("ranks"):
            continue
        try:
            header = json.loads(_C.read_header(os.path.join(out, entry.get("dir", key),
                                                           entry["ranks"][0]["file"])))
        except (ReshardError, KeyError, OSError, ValueError):
            continue
        for t in sorted(header["tensors"], key=lambda t: t["name"]):
            try:
                d = torch_dtype(t["dtype"])
            except ValueError:
                continue
            if d.is_floating_point:
                return d
    return None


def empty_model(out: str, dtype="auto", model_class=None) -> nn.Module:
    """Builds the Hugging Face model described by OUT/config.json with parameters on the
    meta device and buffers computed for real, ready for fully_shard → to_empty → load."""
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(out)
    if model_class is None:
        archs = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, archs[0], None) if archs else None
        if model_class is None:
            model_class = transformers.AutoModelForCausalLM
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or \
            _weights_dtype(out) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    # transformers v5 ties weights in from_pretrained, not in from_config.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    _init_buffers_as_from_pretrained(model)
    model._reshard_buffers = _buffer_values(model)
    model._reshard_build_dtype = dtype
    _prepare_quietly()  # the copy engine's set-up overlaps fully_shard / to_empty
    return model


def _target_device(t: torch.Tensor, what: str, device_index: Optional[int]) -> Tuple[bool, Optional[int]]:
    """(on CUDA?, the rank's CUDA device index so far): one CUDA device per rank, or CPU."""
    if t.device.type == "cuda":
        if device_index is not None and device_index != t.device.index:
            raise ReshardError(f"{what}: tensors on several CUDA devices; reshard.load expects one "
                               "device per rank")
        return True, t.device.index
    if t.device.type != "cpu":
        raise ReshardError(f"{what} is on {t.device}; reshard loads onto CUDA or CPU")
    return False, device_index


def _move_and_report(model, path, key, world_size, coord, entries, direct, converted,
                     buffer_targets, needs_fresh, device_index, *, threads, verify, io,
                     strict_buffers) -> LoadReport:
    """Moves the bytes (direct targets through the native loader, converted ones and buffers
    through host batches), restores non-persistent buffers, waits for the device, reports."""
    n_threads = threads or _default_threads()
    dev = device_index or 0
    result = _C.load(path, direct, device=dev, threads=n_threads, verify=verify, io=io)
    b, sec = _load_via_host(path, entries, converted + buffer_targets, dev, n_threads, verify)
    restored = _restore_buffers(model, needs_fresh, strict_buffers)
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    total_bytes, total_seconds = result["bytes"] + b, result["seconds"] + sec
    return LoadReport(file=path, layout=key, rank=coord, world_size=world_size, bytes=total_bytes,
                      seconds=total_seconds, gbps=total_bytes / total_seconds / 1e9 if total_seconds else 0.0,
                      tensors=len(direct) + len(converted) + len(buffer_targets),
                      staging_bytes=result["staging_bytes"], direct_io=result["direct_io"],
                      threads=result["threads"], converted_tensors=len(converted),
                      buffers_restored=restored,
                      staging_alloc_seconds=result.get("staging_alloc_seconds", 0.0),
                      pooled=bool(result.get("pooled", False)))


def _buffer_targets(model: nn.Module, entries: dict, prefix: str, path: str, used: set):
    """Persistent buffers come from the file ((key, buffer) pairs); non-persistent ones (and
    persistent ones the file lacks) are restored as from_pretrained computes them (their
    names; _fresh_buffers)."""
    persistent = _persistent_buffer_names(model)
    buffer_targets = []
    needs_fresh = []
    for name, b in model.named_buffers():
        name = _clean_name(name)
        key_in_file = _file_key(name, entries, prefix)
        if name in persistent and key_in_file is not None:
            e = entries[key_in_file]
            used.add(key_in_file)
            if e["shard"] is not None and e["local_shape"] != e["global_shape"]:
                raise ReshardError(
                    f"buffer {name} is stored sharded in {path}; buffers must be whole on every "
                    "rank (not supported yet for world size > 1)")
            buffer_targets.append((key_in_file, b))
        else:
            # Non-persistent buffers are never in a checkpoint; a persistent one that the
            # checkpoint lacks is initialised by from_pretrained (a missing key): both come
            # from the values reshard.empty_model computed as from_pretrained does.
            needs_fresh.append(name)
    return buffer_targets, needs_fresh


def _restore_buffers(model: nn.Module, needs_fresh: List[str], strict_buffers: bool) -> List[str]:
    restored = []
    if needs_fresh:
        fresh = _fresh_buffers(model)
        missing_fresh = [n for n in needs_fresh if fresh is None or n not in fresh]
        if missing_fresh and strict_buffers:
            raise ReshardError(
                f"cannot restore buffers {missing_fresh} (not in the rank file, and to_empty left "
                "them uninitialised): build the model with reshard.empty_model(OUT), or restore "
                "them yourself and pass strict_buffers=False")
        with torch.no_grad():
            for name, b in model.named_buffers():
                name = _clean_name(name)
                if name in needs_fresh and fresh is not None and name in fresh:
                    b.copy_(fresh[name])
                    restored.append(name)
    return restored


def load(model: nn.Module, out: str, *, threads: Optional[int] = None, verify: bool = True,
         io: str = "auto", strict_buffers: bool = True) -> LoadReport:
    """Loads this rank's shard from OUT into `model` in place.

    `model` is an FSDP2 model (fully_shard'ed, to_empty'd, before its first forward) or a plain
    module (world size 1) on CUDA or CPU. Every parameter is checked against the rank file
    (name, global shape, local shape, dtype) before any byte moves; a mismatch raises
    ReshardError naming the parameter. Non-persistent buffers are restored to a freshly
    constructed model's values. Raises ReshardError on any failure; then the model must be
    considered not loaded.

    FSDP1 models (FullyShardedDataParallel, any sharding strategy) load from an fsdp1 layout
    whose units match the live FlatParameters exactly (see _load_fsdp1)."""
    units = _fsdp1_units(model)
    if units:
        return _load_fsdp1(model, out, units, threads=threads, verify=verify, io=io,
                           strict_buffers=strict_buffers)
    world_size, coord = _shard_coordinate(model)
    if world_size == 1 and hasattr(model, "tie_weights"):
        # nn.Module.to_empty gives each module its own new parameter, silently untying
        # shared weights of a plain (not fully_shard'ed) model; tie them again first.
        model.tie_weights()
    float_dtypes = {_local(p).dtype for _, p in model.named_parameters() if p.is_floating_point()}
    live_dtype = float_dtypes.pop() if len(float_dtypes) == 1 else None
    path, key = find_rank_file(out, world_size, coord, live_dtype)
    header = json.loads(_C.read_header(path))
    if header["layout"]["world_size"] != world_size or header["rank"] != coord:
        raise ReshardError(f"{path}: holds rank {header['rank']} of {header['layout']['world_size']}, "
                           f"expected {coord} of {world_size}")
    entries = {t["name"]: t for t in header["tensors"]}
    prefix = getattr(model, "base_model_prefix", "") or ""
    convert_cmd = f"reshard convert <checkpoint> -o {out} --world-size {world_size}"

    direct: List[Tuple[str, int, int, bool]] = []
    converted: List[Tuple[str, torch.Tensor]] = []
    used = set()
    device_index = None
    missing = []
    for name, p in model.named_parameters():
        key_in_file = _file_key(name, entries, prefix)
        if key_in_file is None:
            missing.append(name)
            continue
        e = entries[key_in_file]
        used.add(key_in_file)
        local = _local(p)
        if local.device.type == "meta":
            raise ReshardError(f"parameter {name} is on the meta device: call "
                               "model.to_empty(device=...) before reshard.load")
        if list(p.shape) != e["global_shape"]:
            raise ReshardError(
                f"parameter {name}: the model has global shape {list(p.shape)}, {path} has "
                f"{e['global_shape']}: another model or config. Convert this model's checkpoint: {convert_cmd}")
        if list(local.shape) != e["local_shape"]:
            raise ReshardError(
                f"parameter {name}: local shard shape {list(local.shape)} but {path} holds "
                f"{e['local_shape']} (rows {e['shard']}); the layout does not match this job. "
                f"Convert for it: {convert_cmd}")
        if not local.is_contiguous():
            raise ReshardError(f"parameter {name}: local shard is not contiguous")
        try:
            file_dtype = torch_dtype(e["dtype"])
        except ValueError:
            raise ReshardError(f"parameter {name}: file dtype {e['dtype']} has no torch dtype") from None
        on_device, device_index = _target_device(local, f"parameter {name}", device_index)
        if e["nbytes"] == 0:
            continue
        if local.dtype == file_dtype:
            direct.append((key_in_file, local.data_ptr(), e["nbytes"], on_device))
        else:
            if not (local.dtype.is_floating_point and file_dtype.is_floating_point):
                raise ReshardError(
                    f"parameter {name}: live dtype {local.dtype}, file dtype {file_dtype}; only "
                    "floating-point dtypes are converted at load time")
            converted.append((key_in_file, local))
    if missing:
        raise ReshardError(
            f"{len(missing)} parameter(s) of the model are not in {path}: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. Is OUT converted from this model's checkpoint? {convert_cmd}")

    buffer_targets, needs_fresh = _buffer_targets(model, entries, prefix, path, used)
    unexpected = sorted(set(entries) - used)
    aliases = set()
    for n, _ in model.named_parameters(remove_duplicate=False):
        k = _file_key(n, entries, prefix)
        if k is not None:
            aliases.add(k)
    unexpected = [k for k in unexpected if k not in aliases]
    if unexpected:
        warnings.warn(f"{path}: {len(unexpected)} tensor(s) not used by the model: "
                      f"{', '.join(unexpected[:8])}", stacklevel=2)

    return _move_and_report(model, path, key, world_size, coord, entries, direct, converted,
                            buffer_targets, needs_fresh, device_index, threads=threads,
                            verify=verify, io=io, strict_buffers=strict_buffers)


# ---- FSDP1 (FullyShardedDataParallel, FlatParameter) -----------------------------------------

def _fsdp1_units(model: nn.Module):
    """[(unit FQN, FSDP module, handle)] of the FSDP1 units that hold a FlatParameter."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return []
    units = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP) and getattr(m, "_handle", None) is not None:
            units.append((_clean_name(name), m, m._handle))
    return units


def _live_flat(handle) -> dict:
    """The live FlatParameter's layout, in the terms of the rank file's `flat` object."""
    fp = handle.flat_param
    fqns, shapes = list(fp._fqns), [list(s) for s in fp._shapes]
    numels, mask = list(fp._numels_with_padding), list(fp._is_padding_mask)
    params, offset, k = [], 0, 0
    for n, is_pad in zip(numels, mask):
        if not is_pad:
            params.append({"fqn": _clean_name(fqns[k]), "shape": shapes[k], "offset": offset})
            k += 1
        offset += n
    return {"params": params, "numel": int(fp._unpadded_unsharded_size.numel()),
            "aligned_numel": int(handle._aligned_numel), "world_size": int(handle.world_size),
            "rank": int(handle.rank), "local_numel": int(fp.numel()),
            "shard_numel_padded": int(fp._shard_numel_padded), "dtype": fp.dtype}


def _flat_difference(unit: str, live: dict, e: Optional[dict], world_size: int) -> Optional[str]:
    if e is None:
        return f"unit {unit or '(root)'} is not in the file"
    f = e["flat"]
    want = [{"fqn": p["fqn"], "shape": p["shape"], "offset": p["offset"]} for p in f["params"]]
    if want != live["params"]:
        untied = [p["fqn"] for p in live["params"] if p["fqn"] in set(f.get("shared", []))]
        if untied:
            return (f"unit {unit or '(root)'}: {untied[0]} is a parameter of its own in the model but "
                    "tied (shared) in the file: the param_init_fn untied it (nn.Module.to_empty "
                    "does); build FSDP with param_init_fn=reshard.fsdp1_param_init_fn(device)")
        for i, (a, b) in enumerate(zip(want, live["params"])):
            if a != b:
                return (f"unit {unit or '(root)'}: parameter {i} is {b['fqn']} {b['shape']} at flat "
                        f"offset {b['offset']} in the model, {a['fqn']} {a['shape']} at {a['offset']} "
                        "in the file")
        return (f"unit {unit or '(root)'}: {len(live['params'])} parameters in the model, "
                f"{len(want)} in the file")
    if f["numel"] != live["numel"]:
        return f"unit {unit or '(root)'}: flat numel {live['numel']} in the model, {f['numel']} in the file"
    if f["aligned_numel"] != live["aligned_numel"]:
        return (f"unit {unit or '(root)'}: alignment {live['aligned_numel']} elements in the model, "
                f"{f['aligned_numel']} in the file (use_orig_params / param_dtype differ)")
    c = -(-f["numel"] // world_size)
    if live["local_numel"] != c:
        return (f"unit {unit or '(root)'}: the local shard has {live['local_numel']} elements, the "
                f"file {c}; the FlatParameter is not sharded (call load before the first forward, "
                "outside summon_full_params)")
    if live["shard_numel_padded"] != c - (e["shard"]["end"] - e["shard"]["start"]):
        return f"unit {unit or '(root)'}: shard padding differs"
    return None


def _fsdp1_convert_command(out: str, model: nn.Module, units, live_dtype) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    classes = sorted({type(m.module).__name__ for u, m, _ in units if u != ""} |
                     {type(m.module).__name__ for n, m in model.named_modules()
                      if isinstance(m, FSDP) and _clean_name(n) != "" and m._handle is None})
    root = units[0][1] if units else model
    cmd = (f"python -m reshard.manifest <checkpoint> -o {out}/reshard-model.json && "
           f"reshard convert <checkpoint> -o {out} --world-size {units[0][2].world_size} --layout fsdp1")
    cmd += "".join(f" --wrap {c}" for c in classes) if classes else ""
    if getattr(root, "_use_orig_params", False):
        cmd += " --use-orig-params"
        mp = getattr(units[0][2], "_fwd_bwd_param_dtype", None)
        if mp is not None and mp != units[0][2]._orig_param_dtype and mp in _POLICY_NAMES:
            cmd += f" --param-dtype {_POLICY_NAMES[mp]}"
    if live_dtype in _POLICY_NAMES:
        cmd += f" --dtype {_POLICY_NAMES[live_dtype]}"
    return cmd


def _load_fsdp1(model: nn.Module, out: str, units, *, threads, verify, io, strict_buffers) -> LoadReport:
    """Loads an FSDP1 model: every unit's local flat shard (padding included) from the rank file
    of the fsdp1 layout whose units match the live FlatParameters (FQNs, shapes, offsets with
    padding, flat numel, alignment, world size), the shard coordinate being the handle's rank
    in its shard group (HYBRID_SHARD: within the replica)."""
    lives = [(u, m, h, _live_flat(h)) for u, m, h in units]
    world_size, coord = lives[0][3]["world_size"], lives[0][3]["rank"]
    dtypes = {lv["dtype"] for *_, lv in lives}
    live_dtype = dtypes.pop() if len(dtypes) == 1 else None
    command = _fsdp1_convert_command(out, model, units, live_dtype)
    manifest_path = os.path.join(out, "reshard.json")
    if not os.path.exists(manifest_path):
        raise ReshardError(f"{out}: no reshard.json; this is not a reshard output directory. "
                           f"Create one with: {command}")
    with open(manifest_path) as f:
        layouts = json.load(f).get("layouts", {})
    policy = _POLICY_NAMES.get(live_dtype)
    candidates = [k for k, l in layouts.items()
                  if l.get("kind") == "fsdp1" and l.get("world_size") == world_size]
    candidates.sort(key=lambda k: (layouts[k].get("dtype") != policy, layouts[k].get("dtype") != "keep", k))
    name = f"rank-{coord:05d}-of-{world_size:05d}.reshard"
    chosen, reasons = None, []
    for key in candidates:
        path = os.path.join(out, key, name)
        if not os.path.exists(path):
            reasons.append(f"{key}: {path} is missing (convert with --ranks {coord}-{coord})")
            continue
        header = json.loads(_C.read_header(path))
        entries = {t["name"]: t for t in header["tensors"]}
        if header["rank"] != coord or header["layout"]["world_size"] != world_size:
            reasons.append(f"{path}: holds rank {header['rank']} of {header['layout']['world_size']}")
            continue
        diff = None
        for u, _, _, lv in lives:
            diff = _flat_difference(u, lv, entries.get(_flat_entry_name(u)), world_size)
            if diff:
                break
        live_units = {_flat_entry_name(u) for u, *_ in lives}
        extra = [n for n, e in entries.items() if e.get("flat") and n not in live_units]
        if diff is None and extra:
            diff = f"the file has unit(s) the model lacks: {', '.join(extra[:4])}"
        if diff:
            reasons.append(f"{key}: {diff}")
            continue
        chosen = (key, path, entries)
        break
    if chosen is None:
        have = "; ".join(reasons) if reasons else (
            f"no fsdp1 layout for world size {world_size} (layouts: {', '.join(sorted(layouts)) or 'none'})")
        raise ReshardError(f"{out}: no layout matches this FSDP1 job ({have}). Create one with: {command}")
    key, path, entries = chosen

    direct, converted = [], []
    device_index = None
    for u, m, h, lv in lives:
        e = entries[_flat_entry_name(u)]
        fp = h.flat_param
        target = _flat_local_shard(fp, lv["local_numel"])
        if target.device.type == "meta":
            raise ReshardError(f"unit {u or '(root)'}: the FlatParameter is on the meta device; "
                               "build FSDP with param_init_fn=reshard.fsdp1_param_init_fn(device)")
        on_device, device_index = _target_device(target, f"unit {u or '(root)'}", device_index)
        if torch_dtype(e["dtype"]) == target.dtype:
            direct.append((e["name"], target.data_ptr(), e["nbytes"], on_device))
        else:
            converted.append((e["name"], target))
    prefix = getattr(model, "base_model_prefix", "") or ""
    used = {_flat_entry_name(u) for u, *_ in lives}
    buffer_targets, needs_fresh = _buffer_targets(model, entries, prefix, path, used)
    return _move_and_report(model, path, key, world_size, coord, entries, direct, converted,
                            buffer_targets, needs_fresh, device_index, threads=threads,
                            verify=verify, io=io, strict_buffers=strict_buffers)


def fsdp1_param_init_fn(device):
    """A param_init_fn for FullyShardedDataParallel over a meta-device model that allocates each
    module's own parameters and buffers (uninitialised, as `to_empty(recurse=False)`) on
    `device` while keeping tied parameters tied: FSDP1 materialises module by module, and
    to_empty would give `lm_head` and `embed_tokens` separate tensors. Values come from
    reshard.load afterwards."""
    import weakref

    device = torch.device(device)
    if device.type == "cuda":
        _prepare_quietly(device)
    # id(meta parameter) -> (the meta parameter, kept alive so that its id stays unique; a weak
    # reference to its materialised parameter: FSDP frees it once flattened, and a strong one
    # here would keep every unit's unsharded parameters alive).
    memo: Dict[int, Tuple[nn.Parameter, "weakref.ref"]] = {}

    def init(module: nn.Module) -> nn.Module:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            hit = memo.get(id(p))
            new = hit[1]() if hit is not None else None
            if new is None:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                memo[id(p)] = (p, weakref.ref(new))
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
        return module  # as nn.Module.to_empty does (accelerate's tie wrapper uses it)

    return init


def _flat_local_shard(fp, numel: int) -> torch.Tensor:
    """A FlatParameter's local shard of `numel` elements: `_local_shard` (there also while a
    unit stays unsharded after a forward), else its data (before the first forward)."""
    t = getattr(fp, "_local_shard", None)
    return t if t is not None and t.numel() == numel else fp.data


def _flat_entry_name(unit: str) -> str:
    return f"{unit}._flat_param" if unit else "_flat_param"
