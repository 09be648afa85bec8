"""Offline work on checkpoints: no process group, no model, no fairscale (the one way in: ``sources.open_source``)."""


__all__ = []
