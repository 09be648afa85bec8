"""Checkpoint speed on the GPU: ours, PyTorch DCP (as users call it, and with its best staging) and the floors.

``python -m benchmarks.gpu`` on a machine with CUDA (one GPU, W=1, 32 x Linear(4096, 4096) nested, Adam: 537M
parameters, 6.0 GiB of state, files in /dev/shm); ``--small`` (the default without CUDA) runs the same rows on the
CPU with a small model, to show the benchmark works and how the CPU paths compare. Modules: :mod:`.models` (the two
models and their training step), :mod:`.rows` (every timed row), :mod:`.floors` (what the hardware allows),
:mod:`.loop` (training with async saves), :mod:`.__main__` (configuration, table, JSON).
"""
