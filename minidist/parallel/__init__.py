"""Parallelism built by hand on the collective engine: one file per idea (mesh, data, tensor,
pipeline, ZeRO, parameter server). Every layout is tested against one process on the full batch."""
