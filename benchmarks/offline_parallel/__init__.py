"""``python -m benchmarks.offline_parallel``: offline verbs by many processes (``fsdp_optim/offline/parallel``).

Two parts, one results file (``benchmarks/results/offline_parallel.{json,md}``):

- **here** (:mod:`.timed`): a synthetic checkpoint on tmpfs (``--gib``, 4 by default) resharded 2 -> 3 by one
  process and by ``torchrun --nproc_per_node 2``, each net of its launcher's own start-up (the same launcher running
  ``inspect``, a verb that reads only the manifest); per process its peak RSS and the input bytes its plan reads;
- **beyond this machine** (:mod:`.simulate`): the real planner (``core/plan.py``, ``core/split.py``,
  ``read_ranges``) on a synthetic metaseq-like layout of 992 rank files and 2.8 TB, split over 64 and 512 processes,
  no data.
"""
