"""Offline work on checkpoints: no process group, no model, no fairscale.

``open_source`` (``sources.py``) is the one place that decides what kind of input a path or dict is;
``operations.py`` holds ``consolidate`` / ``reshard`` over the sources it returns.
"""

from fsdp_optim.offline.operations import resolve_layout

__all__ = ["resolve_layout"]
