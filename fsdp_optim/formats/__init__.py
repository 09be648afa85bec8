"""Adapters: each format becomes a ``core.plan.Source`` (and, to write it, takes a plan's output).

full dicts (``fullstate``), fairscale's gathered dicts (``fairscale``), our sharded checkpoint (``manifest`` +
``checkpoint``), fairseq/metaseq shard sets (``fairseq/``), PyTorch DCP (``dcp``). A new format is one module
here. Imports ``core`` and ``disk``; never ``torch.distributed``, never fairscale.
"""
