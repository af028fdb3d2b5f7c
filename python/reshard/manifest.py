"""``python -m reshard.manifest``: the old name of reshard.model_manifest (the model's
parameter order, captured for FSDP1 layouts; formats/model-manifest.md)."""

import sys

from .model_manifest import *  # noqa: F401,F403
from .model_manifest import main

if __name__ == "__main__":
    sys.exit(main())
