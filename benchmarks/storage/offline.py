"""Offline tools from the store, in the parent process (no process group): ``reshard`` of a whole checkpoint to
another world size, store to store, and ``fsdp-optim consolidate`` of it into one file on the store, each against
its floor: every object of the source fetched (``floors.download``) and then the bytes the tool wrote put with
``floors.upload`` (the same object sizes, found by listing what the tool wrote).

Methods interleaved, median of ``repeats`` calls after ``warmup`` rounds; the server compacts what the call before
replaced before each call (untimed). The tools reach the store through the AWS environment of the endpoint
(``AWS_ENDPOINT_URL``...), as a user's CLI would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import redirect_stdout
from io import StringIO
from typing import Any
from unittest.mock import patch

import torch

import fsdp_optim
from fsdp_optim.cli import main as cli_main
from fsdp_optim.disk.storage import ObjectStore

from ..measure import Measurement
from ..peak import rounds
from . import floors


def _fetch_all(store: ObjectStore) -> None:
    for name, obj in store.listing().items():
        floors.download(store.fs, store.key(name), obj.size)


def _put_sizes(store: ObjectStore, sizes: dict[str, int], noise: bytes) -> None:
    """Put objects of ``sizes`` made of ``noise`` (incompressible, like the state: a store that compresses zeros
    would make a floor of zeros too fast)."""
    for name, size in sizes.items():
        floors.upload(store.fs, store.key(name), noise[:size])


def measure(source: ObjectStore, out: ObjectStore, *, world_size: int, warmup: int, repeats: int, env: dict[str, str], compact: Callable[[], None]) -> dict[str, Any]:
    """``{"offline_reshard", "floor_reshard", "offline_consolidate", "floor_consolidate": Measurement}`` (times only)."""
    resharded, full = out.child("resharded"), out.child("full")
    floor = out.child("floor")

    def reshard() -> None:
        fsdp_optim.reshard(source.url, world_size, resharded.url, overwrite=True)

    def consolidate() -> None:
        with redirect_stdout(StringIO()):
            code = cli_main(["consolidate", source.url, "-o", f"{full.url}/full.pt", "--overwrite"])
        assert code == 0, f"fsdp-optim consolidate exited with {code}"

    with patch.dict(os.environ, env):
        reshard()
        consolidate()  # once, untimed: the sizes of what they write, for the floors
        reshard_sizes = {n: o.size for n, o in resharded.listing().items()}
        full_sizes = {n: o.size for n, o in full.listing().items()}
        noise = torch.randn(max([*reshard_sizes.values(), *full_sizes.values()]) // 4 + 1).numpy().tobytes()

        def floor_of(sizes: dict[str, int]) -> Callable[[], None]:
            def call() -> None:
                _fetch_all(source)
                _put_sizes(floor, sizes, noise)

            return call

        methods: dict[str, Callable[[], None]] = {
            "floor_reshard": floor_of(reshard_sizes),
            "offline_reshard": reshard,
            "floor_consolidate": floor_of(full_sizes),
            "offline_consolidate": consolidate,
        }
        times = rounds(methods, warmup=warmup, repeats=repeats, before=lambda _: compact())
    written = {"reshard": sum(reshard_sizes.values()), "consolidate": sum(full_sizes.values())}
    read = sum(o.size for o in source.listing().values())
    return {
        name: Measurement(t, 0, None, None, extra={"read_bytes": read, "written_bytes": written[name.split("_", 1)[1]]})
        for name, t in times.items()
    }
