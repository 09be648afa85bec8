"""A sync save at its floor: each piece of a rank file is written by a thread while the caller hashes it, and the file
is the same, byte for byte, as one written and hashed in turn."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from fsdp_optim.core.checksums import digests_of_chunks
from fsdp_optim.disk.atomic import OVERLAP_BYTES, HashingWriter
from fsdp_optim.formats.sharded.ranged import rank_layout, write_rank
from fsdp_optim.formats.sharded.rank_file import host_pieces
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.job.stager import HostCopier, Ring

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
    """Parts of whole pieces (8 MiB and more: float32 2.2M = 8.4 MiB) and of small ones, around the ring's slots."""
    g = torch.Generator().manual_seed(3)
    return {
        "float32": [torch.randn(2_200_000, generator=g), torch.randn(5, generator=g), torch.randn(600_001, generator=g)],
        "bfloat16": [torch.randn(4_500_000, generator=g).to(torch.bfloat16)],
    }


@pytest.mark.parametrize("ring", [False, True])
def test_a_rank_file_is_written_on_a_thread_while_hashed_and_is_exact(tmp_path: Path, ring: bool) -> None:
    tensors = _tensors()
    sizes = {name: sum(p.numel() for p in parts) for name, parts in tensors.items()}
    pieces = Ring(HostCopier(), slots=3, slot_bytes=OVERLAP_BYTES).pieces if ring else host_pieces
    with _ThreadLog(tmp_path / "r.safetensors") as file:
        write_rank(file, rank_layout(META, sizes, CHUNK), tensors, pieces=pieces)
        writers = file.writers
    here = threading.current_thread().name
    assert here in writers, f"no smaller piece was written on the caller's thread: {writers}"
    assert len(set(writers) - {here}) == 1, f"the whole 8 MiB pieces were not written on a writer thread: {writers}"
    data = (tmp_path / "r.safetensors").read_bytes()
    header = read_rank_header(lambda count, offset: data[offset : offset + count], len(data), "r")
    checksums = json.loads(header.metadata["checksums"])
    for name, parts in tensors.items():
        _, numel, at = header.tensors[name]
        whole = torch.cat(parts)
        found = torch.frombuffer(bytearray(data[at : at + whole.nbytes]), dtype=whole.dtype)
        assert torch.equal(found, whole), f"tensor {name} differs from what was written"
        assert tuple(checksums[name]) == digests_of_chunks(whole, CHUNK // whole.element_size()), f"{name}'s checksums"
    reference = io.BytesIO()
    with HashingWriter(reference, overlap_bytes=1 << 62):  # every piece written then hashed, on this thread
        write_rank(reference, rank_layout(META, sizes, CHUNK), tensors)
    assert reference.getvalue() == data, "the overlapped writer wrote other bytes than a sequential one"


def test_a_failed_write_is_raised_by_put_once_the_hash_is_done(tmp_path: Path) -> None:
    hashed: list[int] = []
    with open(tmp_path / "f", "wb") as f, HashingWriter(f, overlap_bytes=1) as writer:
        f.close()  # a write now fails (ValueError: I/O on a closed file)
        with pytest.raises(ValueError, match="closed file"):
            writer.put(memoryview(b"x" * 100), lambda raw: hashed.append(len(raw)))
    assert hashed == [100], f"the piece was hashed while its write failed: {hashed}"


def test_pieces_under_overlap_bytes_make_no_thread_hand_off(tmp_path: Path) -> None:
    """One-process reshard's pieces (one shard each, 2.6 MiB at 25M parameters over 3 ranks) are written on the
    caller's thread: a hand-off each cost more context switches and CPU than the hash it hid."""
    g = torch.Generator().manual_seed(4)
    tensors = {"float32": [torch.randn(680_000, generator=g) for _ in range(4)]}  # 2.6 MiB each
    sizes = {"float32": sum(p.numel() for p in tensors["float32"])}
    with _ThreadLog(tmp_path / "r.safetensors") as file:
        write_rank(file, rank_layout(META, sizes, CHUNK), tensors)
        writers = file.writers
    assert writers == [threading.current_thread().name] * 4, f"the 2.6 MiB pieces were written on {writers}"
