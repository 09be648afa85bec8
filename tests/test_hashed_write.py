"""A sync save at its floor: each piece of a rank file is written by a thread while the caller hashes it, and the file
is the same, byte for byte, as one written and hashed in turn."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from fsdp_optim.core.checksums import chunk_digests
from fsdp_optim.disk.hashed_write import HashingWriter
from fsdp_optim.formats.sharded.rank_file import host_pieces, write_rank_tensors
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.job.copiers import HostCopier
from fsdp_optim.job.stager import Ring

META = {"format": "fsdp_optim", "kind": "shard", "version": "3"}
CHUNK = 64 << 10


class _ThreadLog(io.FileIO):
    """A real file that notes which thread made each write of a megabyte or more."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "w+b")
        self.writers: list[str] = []

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        if len(data) >= 1 << 20:
            self.writers.append(threading.current_thread().name)
        return super().write(data)


def _tensors() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return {
        "float32": [torch.randn(700_000, generator=g), torch.randn(5, generator=g), torch.randn(600_001, generator=g)],
        "bfloat16": [torch.randn(1_500_000, generator=g).to(torch.bfloat16)],
    }


@pytest.mark.parametrize("ring", [False, True])
def test_a_rank_file_is_written_on_a_thread_while_hashed_and_is_exact(tmp_path: Path, ring: bool) -> None:
    tensors = _tensors()
    sizes = {name: sum(p.numel() for p in parts) for name, parts in tensors.items()}
    pieces = Ring(HostCopier(), slots=3, slot_bytes=2 << 20).pieces if ring else host_pieces
    with _ThreadLog(tmp_path / "r.safetensors") as file:
        write_rank_tensors(file, tensors, sizes, META, CHUNK, pieces=pieces)
        writers = file.writers
    assert writers and threading.current_thread().name not in writers, f"the large writes ran on {writers}"
    data = (tmp_path / "r.safetensors").read_bytes()
    header = read_rank_header(lambda count, offset: data[offset : offset + count], len(data), "r")
    checksums = json.loads(header.metadata["checksums"])
    for name, parts in tensors.items():
        _, numel, at = header.tensors[name]
        whole = torch.cat(parts)
        found = torch.frombuffer(bytearray(data[at : at + whole.nbytes]), dtype=whole.dtype)
        assert torch.equal(found, whole), f"tensor {name} differs from what was written"
        assert tuple(checksums[name]) == chunk_digests(whole, CHUNK // whole.element_size()), f"{name}'s checksums"
    reference = io.BytesIO()
    with HashingWriter(reference, overlap_bytes=1 << 62):  # every piece written then hashed, on this thread
        write_rank_tensors(reference, tensors, sizes, META, CHUNK)
    assert reference.getvalue() == data, "the overlapped writer wrote other bytes than a sequential one"


def test_a_failed_write_is_raised_by_put_once_the_hash_is_done(tmp_path: Path) -> None:
    hashed: list[int] = []
    with open(tmp_path / "f", "wb") as f, HashingWriter(f, overlap_bytes=1) as writer:
        f.close()  # a write now fails (ValueError: I/O on a closed file)
        with pytest.raises(ValueError, match="closed file"):
            writer.put(memoryview(b"x" * 100), lambda raw: hashed.append(len(raw)))
    assert hashed == [100], f"the piece was hashed while its write failed: {hashed}"
