"""Building the Hugging Face model a job loads into, and what the model itself decides:
parameter and buffer names (without FSDP1 wrapper parts), which buffers are persistent, and
the buffers' values as from_pretrained leaves them."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
from torch import nn

from .engine import open_rank_file, prepare_quietly
from .errors import CorruptFileError, NotFoundError, UnsupportedError
from .hub import resolve_source
from .layout import read_manifest, torch_dtype


def fresh_buffers(model: nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """Non-persistent buffers (and persistent ones that a checkpoint may lack) as
    from_pretrained has them for this model: the stash reshard.empty_model made, else those of
    a fresh copy of a Hugging Face model built as from_pretrained builds it (see
    init_buffers_as_from_pretrained), in the dtype of its floating-point parameters."""
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
    fresh = _fresh_meta_model(model, cls)
    init_buffers_as_from_pretrained(fresh)
    return buffer_values(fresh)


def _fresh_meta_model(model: nn.Module, cls) -> nn.Module:
    """A new `cls` of `model`'s config, parameters on meta, built in the dtype `model` was
    built in (reshard.empty_model records it) or that of its floating-point parameters."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = getattr(model, "_reshard_build_dtype", None) or (dtypes.pop() if len(dtypes) == 1 else None)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return cls._from_config(model.config, dtype=dtype) if dtype is not None else cls(model.config)


def unsaved_names(model: nn.Module) -> set:
    """The parameters `model` never saves (transformers' `_keys_to_ignore_on_save`, exact
    names such as Marian's `model.encoder.embed_positions.weight`): a checkpoint lacks them
    and from_pretrained computes them."""
    model = getattr(model, "_fsdp_wrapped_module", model)
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def compute_unsaved_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The values from_pretrained gives the parameters `model` never saves (unsaved_names):
    each computed on the CPU by the model's own `_init_weights` on its module, in the
    parameter's dtype, as from_pretrained initialises a key the checkpoint lacks. The
    parameters themselves are left as they are (meta); torch's random state is restored
    (`_init_weights` may draw before it overwrites)."""
    names = unsaved_names(model)
    init = getattr(model, "_init_weights", None)
    out: Dict[str, torch.Tensor] = {}
    if not names or init is None:
        return out
    for name, p in list(model.named_parameters()):
        if name not in names:
            continue
        mname, _, pname = name.rpartition(".")
        module = model.get_submodule(mname) if mname else model
        real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        module._parameters[pname] = real
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                init(module)
        finally:
            module._parameters[pname] = p
        out[name] = real.detach().clone()
    return out


def unsaved_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """compute_unsaved_params as from_pretrained has them for this model: the stash
    reshard.empty_model made, else computed on a fresh meta copy of the model."""
    for m in (model, getattr(model, "_fsdp_wrapped_module", model)):
        stash = getattr(m, "_reshard_unsaved", None)
        if stash is not None:
            return stash
    if not unsaved_names(model):
        return {}
    model = getattr(model, "_fsdp_wrapped_module", model)
    return compute_unsaved_params(_fresh_meta_model(model, reference_class(model)))


def init_buffers_as_from_pretrained(model: nn.Module) -> None:
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


WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_name(name: str) -> str:
    """A module/parameter/buffer path without FSDP1 / activation-checkpoint wrapper parts."""
    return ".".join(part for part in name.split(".") if part and part not in WRAPPER_PARTS)


def persistent_buffer_names(model: nn.Module) -> set:
    """Names of the persistent buffers, as state_dict() would list them, without calling it
    (FSDP1's state_dict() gathers the whole model)."""
    names = set()
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                names.add(clean_name(f"{mname}.{bname}" if mname else bname))
    return names


def buffer_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of every buffer (persistent or not) by clean name: non-persistent ones are
    restored from here after to_empty; persistent ones from here only when the rank file
    lacks them (as from_pretrained initialises a missing key)."""
    return {clean_name(n): b.detach().clone() for n, b in model.named_buffers()
            if b is not None and not b.is_meta}


def weights_dtype(out: str) -> Optional[torch.dtype]:
    """from_pretrained(dtype="auto") on a config without a dtype takes the first floating
    tensor's dtype of the checkpoint's first file; here the dtype of the first floating tensor
    (by name) of rank 0 of a layout that keeps the source's dtypes. None when OUT has none."""
    try:
        manifest = read_manifest(out)
    except (CorruptFileError, NotFoundError):
        return None
    layouts = (manifest or {}).get("layouts", {})
    for key in sorted(layouts):
        entry = layouts[key]
        if entry.get("dtype", "keep") != "keep" or not entry.get("ranks"):
            continue
        try:
            rank_file = open_rank_file(os.path.join(out, entry.get("dir", key), entry["ranks"][0]["file"]))
        except (CorruptFileError, NotFoundError):
            continue
        for t in sorted(rank_file.tensors, key=lambda t: t.name):
            try:
                d = torch_dtype(t.dtype)
            except ValueError:
                continue
            if d.is_floating_point:
                return d
    return None


def keep_in_fp32_as_from_pretrained(model: nn.Module, dtype: torch.dtype) -> List[str]:
    """from_pretrained loads the state-dict entries of the model's `_keep_in_fp32_modules`
    (fp16 only) and `_keep_in_fp32_modules_strict` (fp16 and bf16) in fp32 (its dtype plan,
    regex-searched on each name); from_config does not. The same here, on parameters (meta)
    and persistent buffers; returns the names cast."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return []
    from transformers.core_model_loading import build_glob_alternation

    alternation, _, _ = build_glob_alternation(list(plan.keys()))
    cast = []
    persistent = persistent_buffer_names(model)
    for mname, m in model.named_modules():
        for pname, p in list(m._parameters.items()):
            full = f"{mname}.{pname}" if mname else pname
            if p is not None and p.is_floating_point() and p.dtype != torch.float32 and alternation.search(full):
                m._parameters[pname] = nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
                cast.append(full)
        for bname, b in list(m._buffers.items()):
            full = f"{mname}.{bname}" if mname else bname
            if (b is not None and full in persistent and b.is_floating_point() and b.dtype != torch.float32
                    and alternation.search(full)):
                m._buffers[bname] = b.to(torch.float32)
                cast.append(full)
    return cast


def empty_model(out: str, dtype="auto", model_class=None, revision=None, peft_config=None,
                adapter_name: str = "default") -> nn.Module:
    """Builds the Hugging Face model described by OUT/config.json with parameters on the
    meta device and buffers computed for real, ready for fully_shard → to_empty → load.
    OUT may also be a model id in the local Hugging Face cache (reshard.resolve_source).

    With `peft_config` (a peft.LoraConfig) the model is wrapped by peft.get_peft_model, and
    PEFT's initialisation of the adapters (the values it gives them on an unsharded model in
    the same random state) is kept for reshard.load, which writes each rank's part of it."""
    import transformers
    from accelerate import init_empty_weights

    out = resolve_source(out, revision)
    if os.path.isfile(out):  # a rank file, a weight file: the directory to pass
        from .layout import path_hint

        hint = path_hint(out)
        raise NotFoundError(f"reshard.empty_model: {out} is " + (hint if hint else
                            "a file; pass the directory that holds config.json (a reshard output or a "
                            "Hugging Face checkpoint)"))
    if os.path.isdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        from .layout import path_hint

        hint = path_hint(out)  # a layout directory, a --save-dir of step-* checkpoints: what to pass
        if hint.startswith("a Hugging Face checkpoint"):  # it is one, less its config
            hint = ""
        raise NotFoundError(
            f"reshard.empty_model: {os.path.join(out, 'config.json')} is missing: the model is built from "
            "it. " + (f"This is {hint}" if hint else
                      "Pass a directory reshard convert or reshard.save wrote (they copy the source's "
                      "config.json beside the layouts), a Hugging Face checkpoint directory, or a model id "
                      "in the local Hugging Face cache; to add it to this one, copy config.json from the "
                      "checkpoint it came from"))
    config = transformers.AutoConfig.from_pretrained(out)
    if model_class is None:
        archs = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, archs[0], None) if archs else None
        if model_class is None:
            model_class = transformers.AutoModelForCausalLM
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or \
            weights_dtype(out) or torch.float32
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
    keep_in_fp32_as_from_pretrained(model, dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    untie_as_from_pretrained(model, out)
    init_buffers_as_from_pretrained(model)
    model._reshard_buffers = buffer_values(model)
    model._reshard_unsaved = compute_unsaved_params(model)
    model._reshard_build_dtype = dtype
    if peft_config is not None:
        from .adapters import wrap

        model = wrap(model, peft_config, adapter_name)
    prepare_quietly()  # the copy engine's set-up overlaps fully_shard / to_empty
    return model


def untie_as_from_pretrained(model: nn.Module, out: str) -> None:
    """A tied pair that OUT holds apart, with different values (reshard.ties), is untied as
    from_pretrained unties it: the target gets a parameter of its own (meta, to be loaded), the
    pair leaves all_tied_weights_keys, and a tie_word_embeddings config says False (so that a
    later tie_weights() does not tie it again). Warns as transformers does."""
    import warnings

    from .ties import differing_tied_pairs, untie_message

    ties = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(ties, dict) or not ties:
        return
    differ = differing_tied_pairs(out, [(str(t), str(s)) for t, s in ties.items()],
                                  getattr(model, "base_model_prefix", "") or "")
    if not differ:
        return
    warnings.warn(untie_message(differ, out) + ": reshard.empty_model builds them untied, as from_pretrained "
                  "does; update the config with tie_word_embeddings=False to silence this warning", stacklevel=3)
    embeddings = set()
    if hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings"):
        inp, outp = model.get_input_embeddings(), model.get_output_embeddings()
        embeddings = {id(getattr(inp, "weight", None)), id(getattr(outp, "weight", None))} - {id(None)}
    for target, source in differ:
        owner_name, _, attr = target.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        src = model.get_parameter(source)
        if id(src) in embeddings and getattr(model.config, "tie_word_embeddings", False):
            model.config.tie_word_embeddings = False
        setattr(owner, attr, nn.Parameter(torch.empty_like(src, device="meta"), requires_grad=src.requires_grad))
        ties.pop(target, None)


def reference_class(model: nn.Module):
    """The Hugging Face class of `model` (FSDP2 swaps in a dynamic subclass)."""
    from transformers import PreTrainedModel

    return next(c for c in type(model).__mro__
                if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP"))


def build_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype reshard.empty_model built `model` in (None for models built otherwise)."""
    for m in (model, getattr(model, "_fsdp_wrapped_module", None)):
        dtype = getattr(m, "_reshard_build_dtype", None) if m is not None else None
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def require_fsdp2_sharded(model: nn.Module, what: str) -> None:
    """Raises UnsupportedError naming the fully_shard'ed modules of `model` whose parameters are
    not in their sharded state now. FSDP2 leaves them gathered after a forward without backward
    (an eval, generate; the root always, and every module with reshard_after_forward=False);
    named_parameters() then lists the gathered tensors, which reshard() discards: bytes
    written into them (a load) or read from them as shards (a save) would be lost or wrong."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    gathered = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None and not group.is_sharded:
            gathered.append(name or "the root module")
    if gathered:
        more = f" and {len(gathered) - 3} more" if len(gathered) > 3 else ""
        raise UnsupportedError(
            f"{what}: the parameters of {', '.join(gathered[:3])}{more} are gathered, not sharded (FSDP2 "
            "leaves them so after a forward without backward, e.g. an eval or generate, and with "
            "reshard_after_forward=False): call model.reshard() first")
