"""DSM example programs: each runs under `ckpt launch` and checks its answer against plain numpy."""
