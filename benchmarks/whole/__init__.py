"""The whole-state checkpoint benchmark's own parts (``python -m benchmarks.whole_state`` runs them through
``benchmarks/job.py``'s ``run_whole``; ours and DCP's methods are ``ckpt/ours.py``'s and ``ckpt/dcp.py``'s ``whole_*``,
the floors ``ckpt/floors.py``'s): ``fullsd`` (fairscale's full state dicts), ``offline``, ``report`` (rows, targets,
tables)."""
