"""fairseq / metaseq shard sets: ``files`` (what a set is on disk), ``checks`` (what its records must agree
on), ``shards`` (``ShardSet`` as a source, consolidate and reshard)."""
