"""Offline work on checkpoints: no process group, no model, no fairscale.

``open_source`` (``sources.py``) is the one place that decides what kind of input a path or dict is;
``operations.py`` holds ``consolidate`` / ``reshard`` over the sources it returns.
"""


__all__ = []
