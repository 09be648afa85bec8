"""fairseq / metaseq shard sets: ``paths`` (a set's file names), ``loading`` (reading a file without running its
code), ``files`` (what a rank file holds, its checked outline), ``optimizers`` (which optimizer a set recorded),
``checks`` (what its records must agree on), ``shards`` (``ShardSet`` as a source), ``recut`` (consolidate and
reshard)."""
