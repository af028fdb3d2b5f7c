"""PEFT models (LoRA) under reshard: which live parameters are the base model's (loaded from the
rank files by their original names) and which are adapters (initialised exactly as PEFT
initialises them on an unsharded model, or loaded from a PEFT adapter directory).

PEFT renames every wrapped base parameter (`base_model.model.` in front, `.base_layer.` inside
each wrapped layer) and adds adapter parameters that no base checkpoint holds. Under FSDP the
model is wrapped and sharded before `to_empty`, so PEFT's own initialisation (run while the base
weights are on the meta device) is lost with the meta tensors; reshard.empty_model(OUT,
peft_config=...) keeps what PEFT computed, and reshard.load writes each rank's part of it.

Supported: LoRA (`LoraConfig`) on Linear, Embedding and Conv layers whose adapter
initialisation does not read the base weights (init_lora_weights True, False or "gaussian",
no DoRA); with an adapter directory, any LoRA variant whose tensors PEFT saves (DoRA and
PiSSA/OLoRA-initialised adapters included, as their saved values are final). Other PEFT methods,
and PEFT's modules_to_save / trainable-token wrappers, are refused by name."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from .errors import InvalidArgumentError, LayoutMismatchError, NotFoundError, UnsupportedError
from .model import clean_name

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's; formats/manifest.md (aux files of an adapter save)

# Initialisations of LoRA's weights that use only the random generator (not the base weights).
RANDOM_INITS = (True, False, "gaussian")


def _peft():
    try:
        import peft
    except ImportError:
        return None
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """The model contains PEFT tuner layers (or is a PeftModel). PEFT is not imported here for
    a job that has not imported it (its model cannot hold PEFT layers)."""
    import sys

    if "peft" not in sys.modules:
        return False
    peft = _peft()
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(model, peft.PeftModel) or any(isinstance(m, BaseTunerLayer) for m in model.modules())


@dataclass
class AdapterNames:
    """The name map of a PEFT model (clean live names, without FSDP1 wrapper parts)."""
    prefix: str                      # path of the Hugging Face model inside the PEFT model, + "."
    inner: nn.Module                 # that model (base_model_prefix, ties, buffers' owner)
    tuners: Set[str]                 # paths of the tuner layers
    adapter_names: List[str] = field(default_factory=list)

    def _nearest_tuner(self, parts: List[str]) -> Optional[int]:
        """How many leading parts are the path of the deepest tuner layer holding the name, or
        None; looked up part by part (a name costs its depth, not the number of tuners)."""
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in self.tuners:
                return i
        return None

    def base_name(self, name: str) -> Optional[str]:
        """The Hugging Face model's name of a base parameter or buffer; None for an adapter's.
        Each tuner layer on the path, deepest first, must be passed through its base_layer."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in self.tuners:
                if parts[i] != "base_layer":
                    return None
                del parts[i]
        name = ".".join(parts)
        if self.prefix and name.startswith(self.prefix):
            return name[len(self.prefix):]
        return name

    def saved_key(self, name: str) -> str:
        """The key PEFT's save_pretrained gives adapter parameter `name` (the adapter's name
        removed: `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`)."""
        parts = name.split(".")
        i = self._nearest_tuner(parts)
        if i is not None and len(parts) > i + 1 and parts[i + 1] in self.adapter_names:
            del parts[i + 1]
        return ".".join(parts)


def adapter_names(model: nn.Module) -> AdapterNames:
    """Checks that every PEFT layer of `model` is one reshard supports and maps its names;
    raises UnsupportedError naming the first that is not."""
    peft = _peft()
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    inner = model.get_base_model() if isinstance(model, peft.PeftModel) else model
    prefix = ""
    tuners, names = [], set()
    for mname, m in model.named_modules():
        mname = clean_name(mname)
        if m is inner and not prefix and mname:
            prefix = mname + "."
        cls = type(m)
        if cls.__name__ in ("ModulesToSaveWrapper", "TrainableTokensWrapper") or \
                any(c.__name__ == "AuxiliaryTrainingWrapper" for c in cls.__mro__):
            raise UnsupportedError(
                f"{mname}: PEFT's {cls.__name__} (modules_to_save / trainable_token_indices) is not "
                "supported by reshard.load yet: train those modules as ordinary parameters instead "
                "(leave them out of the PEFT config and set requires_grad on them)")
        if isinstance(m, BaseTunerLayer):
            if not isinstance(m, LoraLayer):
                raise UnsupportedError(
                    f"{mname}: PEFT layer {cls.__module__}.{cls.__name__} is not supported by "
                    "reshard.load; it supports LoRA (peft.LoraConfig) layers")
            tuners.append(mname)
            names |= set(getattr(m, "active_adapters", None) or [])
            for layer_name in m.adapter_layer_names:
                names |= set(getattr(m, layer_name, {}).keys())
    return AdapterNames(prefix=prefix, inner=inner, tuners=set(tuners), adapter_names=sorted(names))


# ---------------------------------------------------------------------------------------------
# Building: PEFT's own initialisation, kept while the base weights are on the meta device.


@contextlib.contextmanager
def _keep_adapter_values(stash: Dict[int, Dict[str, torch.Tensor]]):
    """While get_peft_model runs on a meta-device model, PEFT creates each adapter on the CPU,
    initialises it with the random generator and then moves it to its base layer's device
    and dtype (meta: the values are dropped). Here the move keeps a copy of the values first,
    cast to the base layer's dtype as the move casts them: stash[id(layer)][relative name]."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def move(self, adapter_name, device=None):
        base = self.get_base_layer()
        if isinstance(base, nn.MultiheadAttention):
            base = base.out_proj
        _, base_dtype = self._get_base_layer_device_and_dtype(base)
        kept = stash.setdefault(id(self), {})
        for layer_name in tuple(self.adapter_layer_names) + tuple(self.other_param_names):
            container = getattr(self, layer_name, None)
            if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)) or adapter_name not in container:
                continue
            item = container[adapter_name]
            named = ([("", item)] if isinstance(item, torch.Tensor) else list(item.named_parameters()))
            for rel, p in named:
                if p.is_meta:
                    continue
                v = p.detach().clone()
                if base_dtype is not None and v.is_floating_point() and \
                        (base_dtype.is_floating_point or base_dtype.is_complex):
                    v = v.to(base_dtype)
                kept[f"{layer_name}.{adapter_name}" + (f".{rel}" if rel else "")] = v
        return original(self, adapter_name, device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original


def check_config(peft_config) -> None:
    """Refuses, by name, what reshard cannot initialise on a meta-device model."""
    peft = _peft()
    if peft is None:
        raise NotFoundError("peft_config needs the peft package: pip install peft")
    if not isinstance(peft_config, peft.LoraConfig):
        raise UnsupportedError(
            f"peft_config is a {type(peft_config).__name__}: reshard supports LoRA (peft.LoraConfig)")
    init = peft_config.init_lora_weights
    if getattr(peft_config, "use_dora", False) or init not in RANDOM_INITS:
        what = "use_dora=True" if getattr(peft_config, "use_dora", False) else f"init_lora_weights={init!r}"
        raise UnsupportedError(
            f"LoraConfig({what}) computes the adapter from the base weights, which are not loaded "
            "yet when the model is built: initialise it on one process, save it with "
            "save_pretrained, and pass that directory as reshard.load(..., adapter=DIR)")
    if getattr(peft_config, "modules_to_save", None) or getattr(peft_config, "trainable_token_indices", None):
        raise UnsupportedError(
            "LoraConfig(modules_to_save=... / trainable_token_indices=...) is not supported by "
            "reshard yet: train those modules as ordinary parameters (requires_grad) instead")


def wrap(model: nn.Module, peft_config, adapter_name: str = "default") -> nn.Module:
    """get_peft_model on a meta-device model (reshard.empty_model), keeping PEFT's
    initialisation of every adapter parameter (its full value, as PEFT computes it on an
    unsharded model in the same random state) for reshard.load."""
    from peft import get_peft_model

    check_config(peft_config)
    stash: Dict[int, Dict[str, torch.Tensor]] = {}
    with _keep_adapter_values(stash):
        peft_model = get_peft_model(model, peft_config, adapter_name=adapter_name)
    names = adapter_names(peft_model)
    values: Dict[str, torch.Tensor] = {}
    for mname, m in peft_model.named_modules():
        for rel, v in stash.get(id(m), {}).items():
            values[f"{clean_name(mname)}.{rel}"] = v
    live = {clean_name(n): p for n, p in peft_model.named_parameters() if names.base_name(clean_name(n)) is None}
    missing = sorted(set(live) - set(values))
    if missing:
        raise UnsupportedError(f"PEFT created adapter parameter(s) reshard could not see initialised: "
                               f"{', '.join(missing[:6])}")
    for n, p in live.items():  # PEFT may cast afterwards (autocast_adapter_dtype: fp32)
        values[n] = values[n].to(p.dtype)
    peft_model._reshard_adapter_init = {n: values[n] for n in live}
    for attr in ("_reshard_buffers", "_reshard_build_dtype"):
        if hasattr(model, attr):
            setattr(peft_model, attr, getattr(model, attr))
    return peft_model


# ---------------------------------------------------------------------------------------------
# Loading the adapters.


def read_adapter_dir(path: str) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config.json) of a PEFT adapter directory (save_pretrained's output)."""
    if not os.path.isdir(path):
        raise NotFoundError(f"{path}: not a directory (expected a PEFT adapter directory with "
                            "adapter_model.safetensors and adapter_config.json)")
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(st_path):
        bin_hint = (" (it has adapter_model.bin, a pickle: save it again with "
                    "save_pretrained(..., safe_serialization=True))"
                    if os.path.exists(os.path.join(path, "adapter_model.bin")) else "")
        raise NotFoundError(f"{st_path}: missing{bin_hint}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise NotFoundError(f"{cfg_path}: missing") from None
    except ValueError as e:
        from .errors import CorruptFileError

        raise CorruptFileError(f"{cfg_path}: not JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        found = cfg.get("peft_type") if isinstance(cfg, dict) else type(cfg).__name__
        raise UnsupportedError(f"{cfg_path}: peft_type {found!r}; reshard loads LORA adapters")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(st_path)
    except (SafetensorError, OSError, ValueError) as e:
        from .errors import CorruptFileError

        raise CorruptFileError(f"{st_path}: cannot be read as safetensors ({e})") from None
    return tensors, cfg


def _local_part(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor `full` that live parameter `p` holds (a DTensor's local
    shard by its mesh coordinate and placements, as torch computes it; a plain one whole)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return full[index]


def load_adapters(model: nn.Module, names: AdapterNames, params: Dict[str, torch.Tensor],
                  adapter: Optional[str], world_size: int = 1, coord: int = 0, **load_kw) -> dict:
    """Writes every adapter parameter's local part: from the adapter directory when given,
    else PEFT's initialisation kept by reshard.empty_model(OUT, peft_config=...). Returns
    what the report says about them.

    An adapter directory may also hold base-layer tensors (PEFT saves the embedding weights
    with an adapter that targets them, save_embedding_layers): as PeftModel.from_pretrained
    does, they replace the base model's values."""
    from .load import local_tensor

    if not params:
        return {}
    overridden: List[str] = []
    if adapter is not None and os.path.exists(os.path.join(adapter, "reshard.json")):
        # A reshard.save of the adapters: this rank's shards, through the copy engine.
        from .load import load_saved_adapters

        cfg_path = os.path.join(adapter, ADAPTER_CONFIG)
        if not os.path.exists(cfg_path):
            raise InvalidArgumentError(
                f"adapter={adapter}: a reshard output directory without {ADAPTER_CONFIG}, so not a "
                "save of a PEFT model's adapters (a model's weights load with reshard.load(model, OUT))")
        n = load_saved_adapters(adapter, world_size, coord, {names.saved_key(k): p for k, p in params.items()},
                                **load_kw)
        return {"source": adapter, "tensors": len(params), "bytes": n}
    if adapter is not None:
        tensors, cfg = read_adapter_dir(adapter)
        source = adapter
        wanted = {n: names.saved_key(n) for n in params}
        st = os.path.join(adapter, "adapter_model.safetensors")
        absent = sorted(k for k in wanted.values() if k not in tensors)
        if absent:
            raise LayoutMismatchError(
                f"{st}: has no tensor {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''} "
                f"({len(absent)} of the model's {len(wanted)} adapter parameters): an adapter for another "
                f"base model or other target_modules (it targets {cfg.get('target_modules')!r}, "
                f"r={cfg.get('r')})")
        live = {clean_name(n): p for n, p in model.named_parameters()}
        for k in sorted(set(tensors) - set(wanted.values())):
            if k in live and names.base_name(k) is not None:
                overridden.append(k)
                wanted[k] = k
                params = {**params, k: live[k]}
        extra = sorted(set(tensors) - set(wanted.values()))
        if extra:
            raise LayoutMismatchError(
                f"{st}: {len(extra)} tensor(s) the model has no adapter parameter for: "
                f"{', '.join(extra[:4])}: an adapter for another base model or PEFT config")
        values = {}
        for n, k in wanted.items():
            t = tensors[k]
            if list(t.shape) != list(params[n].shape):
                raise LayoutMismatchError(
                    f"{st}: tensor {k} has shape {list(t.shape)}, the model's {n} has "
                    f"{list(params[n].shape)}: an adapter for another base model or rank r "
                    f"(the file's config: r={cfg.get('r')})")
            values[n] = t
    else:
        values = getattr(model, "_reshard_adapter_init", None)
        if values is None:
            raise InvalidArgumentError(
                f"{len(params)} adapter parameter(s) ({', '.join(sorted(params)[:3])} ...) have no values: "
                "PEFT's initialisation was lost with the meta device. Build the model with "
                "reshard.empty_model(OUT, peft_config=config) (which keeps it), or pass a saved "
                "adapter: reshard.load(model, OUT, adapter=DIR)")
        source = "initialised as PEFT initialises them (reshard.empty_model peft_config)"
        absent = sorted(set(params) - set(values))
        if absent:
            raise InvalidArgumentError(
                f"adapter parameter(s) {', '.join(absent[:4])} were added after reshard.empty_model: "
                "add every adapter through its peft_config, or pass adapter=DIR")
    with torch.no_grad():
        for n, p in params.items():
            local = local_tensor(p)
            if local.is_meta:
                raise InvalidArgumentError(f"parameter {n} is on the meta device: call "
                                           "model.to_empty(device=...) before reshard.load")
            local.copy_(_local_part(values[n], p).to(local.device))
    report = {"source": source, "tensors": len(params) - len(overridden)}
    if overridden:
        report["base_tensors_from_adapter"] = overridden
    return report


# ---------------------------------------------------------------------------------------------
# Saving: the adapters by PEFT's saved names, and PEFT's adapter_config.json.


def save_names(model: nn.Module) -> AdapterNames:
    """The name map for reshard.save of a PEFT model; one adapter only (PEFT's saved names
    drop the adapter's name)."""
    names = adapter_names(model)
    if len(names.adapter_names) != 1:
        raise UnsupportedError(f"the PEFT model holds {len(names.adapter_names)} adapters "
                               f"({names.adapter_names}); reshard.save saves a model with one")
    return names


def adapter_config_json(model: nn.Module, names: AdapterNames) -> str:
    """adapter_config.json as PeftModel.save_pretrained writes it (inference_mode true, the
    base model's name or path)."""
    import tempfile

    config = getattr(model, "peft_config", {}).get(names.adapter_names[0])
    if config is None:
        raise UnsupportedError("the PEFT model has no peft_config for its adapter; reshard.save "
                               "saves models made by peft.get_peft_model")
    saved_mode = config.inference_mode
    try:
        config.inference_mode = True
        if not getattr(config, "base_model_name_or_path", None):
            config.base_model_name_or_path = getattr(getattr(names.inner, "config", None), "_name_or_path", None)
        with tempfile.TemporaryDirectory() as d:
            config.save_pretrained(d)
            with open(os.path.join(d, ADAPTER_CONFIG)) as f:
                return f.read()
    finally:
        config.inference_mode = saved_mode
