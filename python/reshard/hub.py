"""Checkpoints named by Hugging Face model id: resolved through the local Hugging Face hub
cache by the C++ core's rule (reshard::ResolveSource, the same as the CLI's SRC), never over
the network. A path that exists locally wins over a model id of the same spelling."""

from __future__ import annotations

import os
from typing import Optional, Union

from . import _C


def resolve_source(source: Union[str, "os.PathLike[str]"], revision: Optional[str] = None) -> str:
    """The directory (or file) to read for `source`: `source` itself when it exists, else the
    snapshot of model id `source` ("Org/Name") at `revision` (a ref such as "main", the default,
    or a commit hash) in the Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub). Raises reshard.NotFoundError, naming `hf download`, when it is
    not cached."""
    return _C.resolve_source(os.fspath(source), revision)["path"]


def describe_source(source: Union[str, "os.PathLike[str]"], revision: Optional[str] = None) -> dict:
    """resolve_source with the details: {'path', 'from_cache', 'model_id', 'revision', 'commit'}."""
    return _C.resolve_source(os.fspath(source), revision)


def hub_cache_dir() -> str:
    """The Hugging Face hub cache directory reshard looks model ids up in."""
    return _C.hf_hub_cache_dir()
