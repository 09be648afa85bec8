"""Object-storage benchmark (issue 25): whole checkpoints saved to, loaded from and resharded on an S3 server.

``python -m benchmarks.storage`` (``__main__.py``) starts one SeaweedFS server (``server.py``), runs a gloo job per
world size (``benchmarks/job.py``'s ``run_whole`` on the store: saves and loads against the upload and download floors of ``floors.py`` and
DCP's fsspec writer and reader), then the offline tools from the store (``offline.py``), and writes the tables
(``report.py``).
"""
