"""The checkpoint benchmark's parts (``python -m benchmarks.checkpoint`` runs them through ``benchmarks/job.py``'s
``run_optim``): ``ours`` / ``dcp`` / ``floors`` (the methods timed), ``train`` (throughput with checkpoints), ``common``,
``report`` (rows, targets, tables, plot); ``python -m benchmarks.ckpt.profile`` profiles ours. ``common`` (``Job``,
``Probes``, ``Loads``) and ``floors`` serve the whole-state and storage benchmarks too."""
