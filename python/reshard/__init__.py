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
"""

from ._C import ReshardError, build_info  # noqa: F401
from .api import (LoadReport, empty_model, find_rank_file, fsdp1_param_init_fn, load,  # noqa: F401
                  prepare)
from .save import SaveReport, load_optimizer, save  # noqa: F401

__version__ = build_info()["version"]
