"""Adapters: each format becomes a ``core.plan.Source`` (and, to write it, takes a plan's output).

full dicts (``fullstate``), fairscale's gathered dicts (``fairscale``), our sharded checkpoint (``manifest`` +
``checkpoint``), fairseq/metaseq shard sets (``fairseq/``), PyTorch DCP (``dcp``), the full state by parameter
name in one safetensors file (``named_safetensors/``). A new format is one module here. Imports ``core`` and
``disk``; never ``torch.distributed``, never fairscale.
"""
