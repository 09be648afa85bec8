"""An opened input describes and reads; the CLI words its text: ``write_consolidated`` / ``write_resharded`` return
records of what they wrote (``offline/opened/written.py``), and ``cli/verbs.py`` alone turns them into the verbs'
``wrote ...`` lines (docs/cli.md and the CLI tests check those lines end to end)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_type_hints

import pytest

from fsdp_optim.cli.verbs import consolidated_words, resharded_words
from fsdp_optim.formats.kinds import Kind
from fsdp_optim.offline.opened import class_of
from fsdp_optim.offline.opened.base import Opened
from fsdp_optim.offline.opened.written import (
    Consolidation,
    FairseqCheckpoint,
    FullDictFile,
    RankFiles,
    Resharding,
    RewrittenFile,
    ShardFiles,
    WholeFileWritten,
)

OPENED = Path(__file__).resolve().parents[1] / "fsdp_optim" / "offline" / "opened"


@pytest.mark.parametrize("cls", [Opened, *dict.fromkeys(map(class_of, Kind))], ids=lambda c: c.__name__)
def test_every_opened_class_returns_a_record_of_what_it_wrote(cls: type[Opened]) -> None:
    assert get_type_hints(cls.write_consolidated)["return"] == Consolidation, f"{cls.__name__}.write_consolidated"
    assert get_type_hints(cls.write_resharded)["return"] == Resharding, f"{cls.__name__}.write_resharded"


def test_the_opened_inputs_word_no_text_for_a_person() -> None:
    for path in sorted(OPENED.glob("*.py")):
        imported = {a.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                    for a in node.names}  # fmt: skip
        assert "human_bytes" not in imported, f"{path.name} words sizes for a person: the CLI's job (cli/verbs.py)"


@pytest.mark.parametrize(
    ("done", "line"),
    [
        (FullDictFile(18, 16, 2048), "18 params, 16 with state, 2.0 KiB (2048 B)"),
        (WholeFileWritten(6, 1868, 0, 1, 6, 0, 11824),
         "{'model', 'optimizer', 'extra'}: model 6 params (1.8 KiB (1868 B)), 0 tied names, 1 buffer; optimizer 6 "
         "params with state; extra of rank 0; 11.5 KiB (11824 B)"),
        (WholeFileWritten(2, 100, 1, 2, None, 1, 100),
         "{'model', 'optimizer', 'extra'}: model 2 params (100 B), 1 tied name, 2 buffers; optimizer none (saved "
         "with optim=None); extra of rank 1; 100 B"),
        (FairseqCheckpoint(("model", "last_optimizer_state", "cfg"), "last_optimizer_state", 4, 3, 5, 100),
         "a consolidated fairseq checkpoint (model, last_optimizer_state, cfg); last_optimizer_state: 4 params, 3 "
         "with state, model: 5 tensors; 100 B"),
        (FairseqCheckpoint(("last_optimizer_state",), "last_optimizer_state", 4, 3, None, 100),
         "a consolidated fairseq checkpoint (last_optimizer_state); last_optimizer_state: 4 params, 3 with state; "
         "100 B"),
        (RewrittenFile("whole.pt", False, 100), "{'model', 'optimizer', 'extra'} of whole.pt, 100 B"),
        (RewrittenFile("whole.pt", True, 100), "the optimizer's full dict of whole.pt, 100 B"),
    ],
)  # fmt: skip
def test_consolidate_words(done: Consolidation, line: str) -> None:
    assert consolidated_words(done) == line, f"{done}"


@pytest.mark.parametrize(
    ("done", "line"),
    [
        (RankFiles(4, 4992, None, 0), "4 rank files, 4.9 KiB (4992 B)"),
        (RankFiles(3, 6552, 3, 600), "3 rank files, 6.4 KiB (6552 B) (weights included), 3 side files, 600 B"),
        (ShardFiles(("m-shard0.pt", "m-shard1.pt"), 100), "2 shard files m-shard0.pt .. m-shard1.pt, 100 B"),
    ],
)
def test_reshard_words(done: Resharding, line: str) -> None:
    assert resharded_words(done) == line, f"{done}"
