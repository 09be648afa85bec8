"""``fsdp-optim inspect``, ``verify`` and ``list``: what a checkpoint holds, whether every file of it is intact, and
the step directories of a :class:`fsdp_optim.CheckpointManager` root; and ``diff A B``, a short summary table of
:func:`fsdp_optim.diff` (``--json``: the whole record), with the exit codes of ``diff(1)`` and ``cmp(1)``: 0 equal (bit
for bit, or within ``--atol``/``--rtol``), 1 different, 2 trouble (bad input, one line on stderr as every verb's, or
bad usage).

``list ROOT`` prints one line per step directory::

    step 12  torn: no manifest: a save that did not finish (4 files: optim-..., ...)   world size ?   -        9.1 KiB
    step 10  damaged: optim-...-rank00001-of-00002.safetensors: chunk 0 ... checksum   world size 2   model+Adam ...
    step  8  complete                                                               world size 2   model+Adam ...

Every file of every step is verified (what ``fsdp-optim verify`` reads), unless ``--quick`` (sizes only: its last
line says so, and ``--json`` has ``"verified": false``). A step a prune began to remove shows as ``being pruned``.
Exits 0 whatever the steps' states: it reports, it does not judge (``verify`` exits 1 on damage). A checkpoint given as
ROOT (a step directory itself) is refused (exit 1), naming ``inspect`` / ``verify``, which read one checkpoint; so is
a missing root: a local directory that is not there, or a store prefix with nothing below it (a missing bucket).

``--memory-dir DIR`` adds what the memory tier of the nodes on this machine holds (complete steps only)::

    memory node-0  step 6  complete  world size 8  holds 4 of 16 files  24.1 MiB
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.cli.arguments import Outcome
from fsdp_optim.disk.text import human_bytes

if TYPE_CHECKING:
    from fsdp_optim.disk.location import Location
    from fsdp_optim.formats.sharded.steps import StepDir
    from fsdp_optim.offline.diff_report import DiffReport, DiffRow

__all__ = ["run_diff", "run_inspect", "run_list", "run_verify"]

EXIT_EQUAL, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2  # diff's, as diff(1) and cmp(1)


def run_inspect(args: argparse.Namespace) -> list[str]:
    """The opened input describes itself: its lines, or (``--json``) the same as one object
    (:mod:`fsdp_optim.offline.report`)."""
    from fsdp_optim.disk.locations import where
    from fsdp_optim.offline.sources import open_source

    path = str(where(args.path))  # as its location spells it (a URL keeps its '//', which Path would fold)
    with open_source(path, allow_globals=args.allow_global, describe_only=True) as opened:
        lines = [f"path: {path}", *opened.describe(path, units=args.units)]
        report: dict[str, Any] = opened.report(path, lines) if args.json else {}
    if not args.json:
        # what it read is not what verify reads (a flipped byte in a tensor is not seen here)
        return [*lines, f"not verified: inspect reads the headers only; `fsdp-optim verify {path}` checks every byte"]
    return json.dumps(report, indent=1).splitlines()


def run_verify(args: argparse.Namespace) -> list[str] | Outcome:
    from fsdp_optim.disk.text import escape
    from fsdp_optim.formats.sharded.verification import LEFTOVER
    from fsdp_optim.offline.verify import report_json, verify

    report = verify(args.path, allow_globals=args.allow_global, deep=args.deep, layout=args.layout,
                    parallel=getattr(args, "parallel", False))  # set under torchrun (cli/team.py)
    if args.json:
        return Outcome(tuple(json.dumps(report_json(report), indent=1).splitlines()), 0 if report.ok else 1)
    lines = [f"path: {report.path}", f"format: {report.kind}", *report.lines()]
    if report.ok:
        deep = "; state: all finite, second moments >= 0, steps and hyperparameters sound" if report.deep else ""
        checked = [f for f in report.files if not f.detail.startswith(LEFTOVER)]
        left = len(report.files) - len(checked)
        verdict = f"verified: {len(checked)} files, every one present, of its size, checksums matching"
        verdict += f"; {left} leftover file(s) of an interrupted save beside it" if left else ""
        return [*lines, verdict + deep]
    print("\n".join(escape(line, limit=1 << 20) for line in lines), flush=True)
    intact = not report.problems and all(f.ok for f in report.files)
    found = len(report.findings)
    what = f"{found} finding{'' if found == 1 else 's'} a resumed run would trip on" if intact else "damaged"
    raise ValueError(f"{args.path}: {what}: {'; '.join(report.damaged())}")


def run_list(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.location import exists, present
    from fsdp_optim.disk.locations import where
    from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint
    from fsdp_optim.formats.sharded.steps import survey_root

    root = where(args.root)  # a local directory, or a prefix of an object store
    memory = _memory(root, getattr(args, "memory_dir", None))
    if not exists(root) and memory is None:
        raise FileNotFoundError(f"{root}: no such directory (expected a CheckpointManager's root)")
    found = survey_root(root, verify=not args.quick)
    if not found and memory is None and not present(root) and not root.prefixes():
        # A store keeps no empty "directories": nothing below the prefix is what a missing local root is.
        raise FileNotFoundError(
            f"{root}: nothing is stored under this prefix (no such bucket, or no object below it); expected a "
            "CheckpointManager's root holding step-NNNNNNNN directories"
        )
    if not found and is_sharded_checkpoint(root):
        raise ValueError(
            f"{root}: a checkpoint (a step directory), not a CheckpointManager root of step directories; "
            f"`fsdp-optim inspect {args.root}` and `fsdp-optim verify {args.root}` read one checkpoint"
        )
    if args.json:
        steps = [_record(d) for d in found]
        return [json.dumps({"root": str(root), "verified": not args.quick, "steps": steps, "memory": memory or []})]
    memory_lines = [
        f"memory {m['node']}  step {m['step']}  complete  world size {m['world_size']}  holds {m['held']} of "
        f"{m['files']} files  {human_bytes(m['bytes'])}"
        for m in memory or []
    ]
    if memory == []:
        directory = _memory_dir(root, args.memory_dir)
        memory_lines = [f"memory tier: no complete step held under {directory}"]
    if not found:
        return [f"{root}: no step directories (step-NNNNNNNN)", *memory_lines]
    width = len(str(max(d.step for d in found)))
    quick = [f"not verified (--quick): sizes only, no checksum read; `fsdp-optim list {args.root}` checks every byte"]
    return [*(_line(d, width) for d in found), *memory_lines, *(quick if args.quick else [])]


def _memory(root: Location, memory_dir: str | None) -> list[dict[str, Any]] | None:
    """What the memory tier under ``memory_dir`` holds, one record per node and complete step; None without it."""
    if memory_dir is None:
        return None
    from fsdp_optim.formats.sharded.memory_tier import read_holdings

    directory = _memory_dir(root, memory_dir)
    nodes = sorted(p for p in directory.glob("node-*") if p.is_dir()) if directory.is_dir() else []
    return [
        {"node": node.name, "step": h.step, "save_id": h.save_id, "world_size": h.world_size,
         "held": len(h.held), "files": len(h.files), "bytes": sum(n for f, n in h.files if f in h.held)}
        for node in nodes for h in read_holdings(node)
    ]  # fmt: skip


def _memory_dir(root: Location, memory_dir: str) -> Path:
    from fsdp_optim.formats.sharded.memory_tier import default_memory_dir

    return default_memory_dir(root) if memory_dir == "default" else Path(memory_dir)


def _line(d: StepDir, width: int) -> str:
    state = d.state if not d.reason else f"{d.state}: {d.reason}"
    world = d.world_size if d.world_size is not None else "?"
    holds = " + ".join((["model"] if d.model else []) + ([f"optimizer ({d.optimizer})"] if d.optimizer else [])) or "-"
    foreign = f"; not ours: {', '.join(d.foreign)}" if d.foreign else ""
    return f"step {d.step:>{width}}  {state}  world size {world}  holds {holds}  {human_bytes(d.nbytes)}{foreign}"


def _record(d: StepDir) -> dict[str, Any]:
    return {
        "step": d.step,
        "path": str(d.path),
        "state": d.state,
        "reason": d.reason,
        "world_size": d.world_size,
        "model": d.model,
        "optimizer": d.optimizer,
        "bytes": d.nbytes,
        "foreign": list(d.foreign),
    }


def run_diff(args: argparse.Namespace) -> Outcome:
    from fsdp_optim.offline.diff import diff

    try:
        report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, allow_globals=args.allow_global,
                      parallel=getattr(args, "parallel", False))  # set under torchrun (cli/team.py)
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        exc.exit_code = EXIT_TROUBLE  # type: ignore[union-attr]  # diff(1)'s: 2 for trouble, not 1 (different)
        raise
    code = EXIT_EQUAL if report.equal else EXIT_DIFFERENT
    if args.json:
        return Outcome(tuple(json.dumps(report.to_json(), indent=1, allow_nan=False).splitlines()), code)
    return Outcome(tuple(summary_lines(report, limit=args.limit)), code)


def summary_lines(report: DiffReport, *, limit: int = 20) -> list[str]:
    """The summary table: the two sources, counts, maxima, the first ``limit`` differing rows, settings, verdict."""
    from fsdp_optim.offline.diff_report import ONLY_A, ONLY_B
    s = report.summary
    tolerance = "bitwise" if report.atol == 0 and report.rtol == 0 else f"atol {report.atol:g}, rtol {report.rtol:g}"
    lines = [
        f"a: {report.a} ({report.kind_a})",
        f"b: {report.b} ({report.kind_b})",
        f"params: {s.params_a} in a, {s.params_b} in b; compared: {s.tensors} tensors ({s.tensors_equal} bitwise "
        f"equal), {s.scalars} scalars; tolerance: {tolerance}",
        f"max abs error: {s.max_abs:.6g}, max rel error: {s.max_rel:.6g}, max ULP distance: {s.max_ulp}",
        f"NaN: {s.nan_a} in a, {s.nan_b} in b; Inf: {s.inf_a} in a, {s.inf_b} in b",
    ]
    differences = report.differences
    if differences:
        lines.append("param | key | status | max abs | max rel | ULP | NaN a/b | Inf a/b | detail")
        lines += [_row(r) for r in differences[:limit]]
        if len(differences) > limit:
            lines.append(f"... and {len(differences) - limit} more (--json lists every row)")
    if report.settings:
        lines.append("settings that differ (group | key | a | b):")
        lines += [f"{'-' if d.group is None else d.group} | {d.key} | {d.a} | {d.b}" for d in report.settings]
    skipped = s.not_compared
    if report.equal:
        lines.append(f"verdict: equal ({tolerance})")
    elif skipped == len(differences) and not report.settings:  # never "equal" over a part it did not compare
        lines.append(f"verdict: not shown equal: every part compared is equal ({tolerance}), but {skipped} part(s) "
                     "could not be compared (the 'not compared' rows say why)")  # fmt: skip
    else:
        one_sided = sum(r.status in (ONLY_A, ONLY_B) for r in differences)
        only = f" ({one_sided} on one side only)" if one_sided else ""
        unseen = f", {skipped} not compared" if skipped else ""
        lines.append(
            f"verdict: different: {len(differences) - skipped} of {len(report.rows)} rows{only}{unseen}, "
            f"{len(report.settings)} setting(s)"
        )
    return lines


def _row(r: DiffRow) -> str:
    ulp = "-" if r.max_ulp is None else str(r.max_ulp)
    return (
        f"{r.param} | {r.key or '-'} | {r.status} | {r.max_abs:.6g} | {r.max_rel:.6g} | {ulp} | "
        f"{r.nan_a}/{r.nan_b} | {r.inf_a}/{r.inf_b} | {r.detail or '-'}"
    )
