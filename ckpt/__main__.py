"""`python -m ckpt` is the `ckpt` command."""

from ckpt.cli import main

main()
