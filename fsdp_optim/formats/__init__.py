"""Adapters: each format becomes a ``core.plan.Source`` (and, to write it, takes a plan's output); a new format is
one module or folder here (ARCHITECTURE.md lists them). Imports ``core`` and ``disk``; never ``torch.distributed``
(but ``dcp``, for DCP's own API), never fairscale.
"""
