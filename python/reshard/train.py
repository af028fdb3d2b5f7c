"""``python -m reshard.train`` (and ``torchrun -m reshard.train``): the example trainer,
reshard/examples/train.py, under its historical name."""

from .examples.train import *  # noqa: F401,F403 - the trainer's helpers, as before
from .examples.train import cli

if __name__ == "__main__":
    cli()
