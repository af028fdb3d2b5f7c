"""Tied parameters the checkpoint holds apart. transformers' from_pretrained unties a tied pair
(``all_tied_weights_keys``, e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight`` under
``tie_word_embeddings``) when the checkpoint holds both names with different values (it warns
"both are present in the checkpoints with different values, so we will NOT tie them"). A model
built tied from such a config would load one of the two into both: ``reshard.empty_model``
builds it untied as from_pretrained does, and ``reshard.load`` refuses a model that still ties
them.

Decided from the headers of one complete FSDP2 or DTensor layout of OUT, all of its rank files
(no data read, the same answer on every rank): two entries with the same shape, dtype, rows
and chunks hold the same values exactly when every chunk's XXH3-64 is equal in every file.
For OUT a Hugging Face checkpoint (safetensors or torch .bin files, where the core reads their
bytes): the two tensors' bytes compared in slices of 64 MiB, read only when the files hold both
names (save_pretrained writes one name of a tie it keeps; torch.save writes both, pointing at
one storage: equal without reading). For OUT with no such layout (FSDP1 layouts only) but the model manifest its
conversion captured (OUT/reshard-model.json, formats/model-manifest.md): the capture built the
model from the source as from_pretrained does, so the pair held apart there (two parameters,
not one with both names) is a pair whose values differ."""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Tuple


def _layout_files(out: str) -> Optional[List[str]]:
    from .layout import read_manifest

    manifest = read_manifest(out) if os.path.isdir(out) else None
    if not manifest:
        return None
    for key, lay in sorted(manifest.get("layouts", {}).items()):
        if lay.get("kind") in ("fsdp2", "dtensor") and lay.get("complete") and not lay.get("parts") \
                and len(lay.get("ranks", [])) == lay.get("world_size"):
            return [os.path.join(out, lay.get("dir", key), r["file"]) for r in lay["ranks"]]
    return None


def _checkpoint_bytes(out: str) -> Optional[Dict[str, tuple]]:
    """Tensor name -> (dtype, shape, weight file, offset, byte count) of the Hugging Face
    checkpoint directory OUT, as the core reads it (safetensors or torch .bin files); None when
    OUT is not one (or cannot be read: the load's own checks say what is wrong with it)."""
    from ._C import checkpoint_tensor_bytes
    from .errors import ReshardError

    if not os.path.isdir(out):
        return None
    try:
        rows = checkpoint_tensor_bytes(out)
    except (ReshardError, RuntimeError, ValueError, OSError):
        return None
    return {name: (dtype, list(shape), path, offset, nbytes) for name, dtype, shape, path, offset, nbytes in rows}


def _same_bytes(a: tuple, b: tuple) -> bool:
    """The byte ranges a and b ((path, offset, count)) hold the same bytes: compared in slices
    of 64 MiB (bit for bit: a NaN equals itself, as torch.equal of one storage would say)."""
    (pa, oa, n), (pb, ob, _) = a, b
    if (pa, oa) == (pb, ob):
        return True  # one storage under two names (torch.save of a tied model)
    step = 64 << 20
    fa = os.open(pa, os.O_RDONLY)
    try:
        fb = fa if pb == pa else os.open(pb, os.O_RDONLY)
        try:
            for at in range(0, n, step):
                k = min(step, n - at)
                if os.pread(fa, k, oa + at) != os.pread(fb, k, ob + at):
                    return False
            return True
        finally:
            if fb != fa:
                os.close(fb)
    finally:
        os.close(fa)


def _hf_pairs_differ(out: str, pairs, prefix: str, shapes=None) -> Optional[List[Tuple[str, str]]]:
    """differing_tied_pairs for OUT a Hugging Face checkpoint directory (safetensors or .bin
    files); None when it is not one. Both names of a .bin's tie point at one storage (equal);
    otherwise the two tensors' bytes are compared."""
    from .load import file_key

    where = _checkpoint_bytes(out)
    if not where:
        return None
    differ = []
    for target, source in pairs:
        a, b = file_key(target, where, prefix), file_key(source, where, prefix)
        if a is None or b is None or a == b:
            continue
        (dta, sha, pa, oa, na), (dtb, shb, pb, ob, nb) = where[a], where[b]
        if shapes is not None and target in shapes and sha != list(shapes[target]):
            continue  # another model: the load's own refusal says so
        if dta != dtb or sha != shb or na != nb or not _same_bytes((pa, oa, na), (pb, ob, nb)):
            differ.append((target, source))
    return differ


def _manifest_pairs_apart(out: str, pairs, prefix: str) -> Optional[List[Tuple[str, str]]]:
    """The pairs OUT's model manifest holds as two parameters; None without one (or unreadable:
    the load's own checks say what is wrong with it)."""
    import json

    path = os.path.join(out, "reshard-model.json") if os.path.isdir(out) else ""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            params = json.load(f).get("params", [])
        param_of = {n: i for i, p in enumerate(params) for n in p.get("names", [])}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    from .load import file_key

    apart = []
    for target, source in pairs:
        a, b = file_key(target, param_of, prefix), file_key(source, param_of, prefix)
        if a is not None and b is not None and param_of[a] != param_of[b]:
            apart.append((target, source))
    return apart


def differing_tied_pairs(out: str, pairs: Iterable[Tuple[str, str]], prefix: str = "",
                         shapes: Optional[Dict[str, List[int]]] = None) -> List[Tuple[str, str]]:
    """Of `pairs` (target, source) of model names, those OUT holds both of with different values
    (or different shapes or dtypes); [] when it holds one or neither, or cannot say. `shapes`
    (target name -> the model's shape): a pair whose entry in OUT has another shape is skipped,
    left to the load's own "another model" refusal."""
    from .engine import open_rank_file
    from .load import file_key

    pairs = list(pairs)
    if not pairs:
        return []
    files = _layout_files(out)
    if not files:
        hf = _hf_pairs_differ(out, pairs, prefix, shapes)
        if hf is None:
            hf = _manifest_pairs_apart(out, pairs, prefix)
        return hf or []
    first: Dict[str, object] = {t.name: t for t in open_rank_file(files[0]).tensors}
    both = []
    for target, source in pairs:
        a, b = file_key(target, first, prefix), file_key(source, first, prefix)
        if a is not None and b is not None and a != b and \
                (shapes is None or target not in shapes or list(first[a].global_shape) == list(shapes[target])):
            both.append((target, source, a, b))
    if not both:  # the usual case (save_pretrained stores one name of a tie): one header read
        return []
    entries = [first] + [{t.name: t for t in open_rank_file(f).tensors} for f in files[1:]]
    differ = []
    for target, source, a, b in both:
        for e in entries:
            x, y = e.get(a), e.get(b)
            if x is None or y is None or x.flat is not None or y.flat is not None:
                break  # not both here as whole entries: nothing to say
            if (x.dtype, list(x.global_shape), list(x.local_shape), x.shard) != \
                    (y.dtype, list(y.global_shape), list(y.local_shape), y.shard) or \
                    list(x.chunk_xxh3) != list(y.chunk_xxh3):
                differ.append((target, source))
                break
    return differ


def untie_message(pairs: List[Tuple[str, str]], out: str) -> str:
    names = "; ".join(f"{t} and {s}" for t, s in pairs)
    return (f"{out} holds {names} with different values, but the model ties them (its config: "
            "tie_word_embeddings, or the model's own tied keys); from_pretrained unties them in this case "
            "(\"both are present in the checkpoints with different values, so we will NOT tie them\")")
