"""The checkpoint benchmark's parts (``python -m benchmarks.checkpoint`` runs them): ``job`` (one gloo job),
``ours`` / ``dcp`` / ``floors`` (the methods timed), ``train`` (throughput with checkpoints), ``common``,
``report`` / ``tables`` (rows, targets, tables); ``python -m benchmarks.ckpt.profile`` profiles ours."""
