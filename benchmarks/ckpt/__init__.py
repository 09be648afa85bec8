"""The checkpoint benchmarks' parts (``python -m benchmarks.checkpoint`` runs them through ``benchmarks/job.py``'s
``run_optim``): ``ours`` / ``dcp`` / ``floors`` (the methods timed, optimizer state only and, ``whole_*``, the whole
state), ``train`` (throughput with checkpoints), ``common`` (``Job``, ``Probes``, loads into fresh optimizers), ``report``
(rows, targets, tables, plot); ``python -m benchmarks.ckpt.profile`` profiles ours. All but ``train`` and ``report``
serve the whole-state and storage benchmarks too."""
