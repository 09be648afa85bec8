"""An output's journal as typed entries: what a writer journals is written to its lock file as the same JSON line
as before (``{"journal": {...}}``, members in a fixed order), and what a killed writer left is read back typed,
a member of the wrong type as absent; a killed reshard's journal is acted on by the next writer."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.locks import lock_output, lock_path


def test_an_entry_is_one_json_line_of_the_lock_file(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with lock_output(out, purpose="test") as lock:
        lock.journal(JournalEntry(save_id="ab" * 16, world_size=2, staging=".ckpt.x", replaces=("a", "b")))
        lines = lock_path(out).read_text().splitlines()
        assert json.loads(lines[-1]) == {
            "journal": {"save_id": "ab" * 16, "world_size": 2, "staging": ".ckpt.x", "replaces": ["a", "b"]}
        }
        assert lines[-1] == json.dumps(json.loads(lines[-1])), "the line is the entry's JSON, members in order"
        assert lock.entries[-1].replaces == ("a", "b")


def test_a_killed_writers_journal_is_read_back_typed(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    left = [
        {"save_id": "cd" * 16, "world_size": 3, "replaces": ["x", 7], "moved": ["y"]},
        {"file": "out.pt", "tag": 5, "world_size": True, "files": "not a list", "other": 1},
    ]
    lock_path(out).write_text("".join(json.dumps({"journal": e}) + "\n" for e in left) + '{"journal": {"tor')
    with lock_output(out, purpose="test") as lock:
        assert lock.previous == [
            JournalEntry(save_id="cd" * 16, world_size=3, replaces=("x",), moved=("y",)),
            JournalEntry(file="out.pt"),
        ]
