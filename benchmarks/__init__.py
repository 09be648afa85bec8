"""Benchmarks for fsdp_optim. Entry point: ``python -m benchmarks.gather`` (see its docstring)."""
