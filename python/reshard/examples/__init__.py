"""Programs built on reshard's API: ``python -m reshard.examples.train`` (also
``python -m reshard.train``), the small FSDP2/FSDP1 trainer that the README, the demo and the
recipes run."""
