"""zkvrun: torchrun-style launcher for the scheduler node and per-rank workers."""
