"""Benchmarks for fsdp_optim. Entry point: ``python -m benchmarks`` (``list``, ``run``, ``report``; see ``__main__.py``);
the benchmarks are listed once, in ``registry.py``."""
