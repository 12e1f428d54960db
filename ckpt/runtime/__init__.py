"""Per-rank runtime: plugin manager, hookspecs, checkpoint thread, images, virtual-ID tables."""
