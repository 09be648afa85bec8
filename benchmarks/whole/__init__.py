"""The whole-state checkpoint benchmark's parts (``python -m benchmarks.whole_state`` runs them through
``benchmarks/job.py``'s ``run_whole``): ``ours`` / ``dcp`` / ``fullsd`` (the methods timed; the floors are
``ckpt/floors.py``'s), ``offline``, ``report`` (rows, targets, tables)."""
