"""A/B timing of every entry point against another commit (``python -m benchmarks.engine_ab``): the runner
(``__main__.py``: worktree, S3 server, alternating jobs, report) and the job each side runs (``job.py``).
"""
