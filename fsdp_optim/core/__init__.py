"""The pure core: layouts, records, flatten maths, the planner, argument checks.

Imports nothing of fsdp_optim above it, never ``torch.distributed`` or fairscale, and touches no file.
A new check on what a source holds goes in ``plan.py``; on an argument, in ``preconditions.py``.
"""
