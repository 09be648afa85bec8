"""A re-cutting load from an object store fetches its byte ranges ahead, concurrently, a bounded window at a time
(fsdp_optim/disk/prefetch.py, read by a load through ShardedCheckpoint.fetched_ahead), against the real S3 server of tests/_s3.py.

Each range is fetched once, never more than the window plus the range being read is held,
and a range needed again after it was let go is fetched again and verified again (a byte changed in the store in
between is refused). A whole load at another world size through it: tests/test_object_store.py.
"""

from __future__ import annotations

import os
from typing import Any

import _models as M
import pytest
import torch
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.disk.byte_io import read_all
from fsdp_optim.disk.prefetch import StorePrefetch
from fsdp_optim.disk.storage import ObjectStore
from fsdp_optim.formats.sharded.byte_ranges import Span
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.sources import held_readers

KIB = 1024


def _stores(s3_server: Any, fault_proxy: Any, prefix: str) -> tuple[ObjectStore, ObjectStore]:
    """One prefix as the server serves it and as the counting proxy does."""
    url = s3_server.url(prefix)
    return (fsdp_optim.open_store(url, **s3_server.storage_options),
            fsdp_optim.open_store(url, **fault_proxy.storage_options))  # fmt: skip


def test_ranges_are_fetched_once_in_order_within_the_window(s3_server: Any, fault_proxy: Any) -> None:
    data = os.urandom(1 << 20)
    direct, counted = _stores(s3_server, fault_proxy, "window")
    direct.write("blob", data)
    spans = [Span("blob", a, a + 64 * KIB, 1) for a in range(0, 1 << 20, 64 * KIB)]
    fault_proxy.reset_stats()
    most = 0
    with StorePrefetch(counted, spans, window=200 * KIB) as ahead:
        for piece, span in zip(ahead.pieces, spans):
            assert bytes(piece.bytes().numpy()) == data[span.start : span.stop]
            most = max(most, ahead.held)
            piece.used()
        assert ahead.held == 0 and all(p.dropped and p.fetched == 1 for p in ahead.pieces)
    assert most <= 200 * KIB + 64 * KIB, f"held {most} bytes with a 200 KiB window"
    ranges = sorted(r.range for r in fault_proxy.log() if r.method == "GET")  # (concurrent: in any order)
    assert ranges == sorted(f"bytes={s.start}-{s.stop - 1}" for s in spans), "each range fetched once"


def test_a_range_needed_again_is_fetched_again(s3_server: Any) -> None:
    data = os.urandom(256 * KIB)
    store = fsdp_optim.open_store(s3_server.url("again"), **s3_server.storage_options)
    store.write("blob", data)
    with StorePrefetch(store, [Span("blob", 0, 128 * KIB, 1), Span("blob", 128 * KIB, 256 * KIB, 0)]) as ahead:
        first, kept = ahead.pieces
        assert bytes(first.bytes().numpy()) == data[: 128 * KIB]
        first.used()
        assert first.dropped and ahead.held == 128 * KIB  # the other (uses 0) is kept until the end
        assert bytes(first.bytes().numpy()) == data[: 128 * KIB] and first.fetched == 2


def _save(rank: int, world_size: int, store: ObjectStore) -> None:
    root = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, store, extra={"rank": rank})


def test_a_byte_changed_after_its_range_was_let_go_is_refused(s3_server: Any) -> None:
    store = fsdp_optim.open_store(s3_server.url("reverify"), **s3_server.storage_options)
    run_ranks(_save, 2, store)
    ckpt = open_checkpoint(store, lazy=True)
    record = ckpt.manifest.files[0]
    rank_file = ckpt.rank_file(record.rank)
    assert rank_file is not None, "a format-3 checkpoint"
    header = min(base for _, _, base in rank_file.open().tensors.values())
    spans = [Span(record.file, 0, header, 0), Span(record.file, header, record.nbytes, 1)]
    (flat, key), (_, _, numel) = next(iter(ckpt.layout[0].items()))
    with store.prefetch(lambda: spans) as held:  # what a load reads through (ShardedCheckpoint.fetched_ahead)
        files, _ = held_readers(ckpt.manifest.files, lambda name: store / name, held)
        ckpt.provide({0: files[record.rank]})
        out = torch.empty(numel, dtype=torch.float32)
        ckpt.reader(0)(flat, key, 0, numel, out)  # read, verified, and the range let go (its one use)
        assert held[record.file][1].dropped
        damaged = bytearray(read_all(store, record.file, limit=record.nbytes))
        damaged[header] ^= 0xFF
        store.write(record.file, bytes(damaged))
        with pytest.raises(ValueError, match="checksum mismatch"):
            ckpt.reader(0)(flat, key, 0, numel, out)
    ckpt.close()
