from setuptools import find_packages, setup

setup(
    name="fsdp_optim",
    version="0.1.0",
    description="Portable, world-size-independent optimizer state for fairscale FullyShardedDataParallel",
    packages=find_packages(include=["fsdp_optim", "fsdp_optim.*"]),
    python_requires=">=3.10",
    # torch is pinned exactly: a CPU wheel of this version is what our machines and CI carry.
    install_requires=["torch==2.13.0", "fairscale==0.4.13", "tqdm"],
    entry_points={"console_scripts": ["fsdp-optim = fsdp_optim.cli:main"]},
    extras_require={
        "test": ["pytest", "parameterized", "hypothesis"],
        "bench": ["matplotlib"],
    },
)
