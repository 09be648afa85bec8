"""The whole-state checkpoint benchmark's parts (``python -m benchmarks.whole_state`` runs them): ``job`` (one gloo
job), ``ours`` / ``dcp`` / ``fullsd`` / ``floors`` (the methods timed), ``report`` (rows, targets, tables)."""
