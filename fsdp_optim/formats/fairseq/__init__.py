"""fairseq / metaseq shard sets: ``paths`` (a set's file names), ``files`` (what a rank file holds, loaded without
running its code, and its checked outline), ``optimizers`` (which optimizer a set recorded),
``checks`` (what its records must agree on), ``shards`` (``ShardSet`` as a source), ``recut`` (consolidate and
reshard)."""
