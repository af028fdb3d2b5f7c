"""reshard: load pre-sharded FSDP checkpoints straight into an already-sharded model.

    torch.cuda.set_device(local_rank); reshard.prepare()   # optional: copy engine set up early
    model = reshard.empty_model(OUT)          # meta-device Hugging Face model, buffers real
    for layer in model.model.layers: fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cuda")
    report = reshard.load(model, OUT)         # every rank reads only its own rank file

OUT is what `reshard convert SRC -o OUT --world-size N` wrote, or what
`reshard.save(model, OUT, optimizer=opt, step=s)` wrote from a training job (then
`reshard.load_optimizer(opt, model, OUT)` restores the optimizer too).

Modules by role: engine (the copy engine: prepare, moving bytes), load (FSDP2 and plain
models), load_fsdp1 (FullyShardedDataParallel), save, optimizer, model (empty_model,
buffers), check (check_weights), layout (the on-disk rules, from the C++ core), hub
(resolve_source: model ids through the local Hugging Face cache), errors,
model_manifest (`python -m reshard.model_manifest`), examples.train (`python -m
reshard.train`).
"""

from ._C import build_info, format_bytes, format_rate  # noqa: F401
from .check import check_weights  # noqa: F401
from .engine import LoadReport, prepare  # noqa: F401
from .hub import resolve_source  # noqa: F401
from .errors import (BusyError, CorruptFileError, InvalidArgumentError,  # noqa: F401
                     LayoutMismatchError, NotFoundError, ReshardError, ReshardIOError,
                     UnsupportedError)
from .load import find_rank_file, load  # noqa: F401
from .load_fsdp1 import fsdp1_param_init_fn  # noqa: F401
from .model import empty_model  # noqa: F401
from .optimizer import load_optimizer  # noqa: F401
from .save import SaveHandle, SaveReport, save, wait_pending  # noqa: F401

__version__ = build_info()["version"]
