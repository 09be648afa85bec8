"""``fsdp-optim inspect`` and ``verify``: what a checkpoint holds, and whether every file of it is intact."""

from __future__ import annotations

import argparse
from typing import Any

from fsdp_optim.cli.arguments import Outcome

__all__ = ["run_inspect", "run_verify"]


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
    import json

    return json.dumps(report, indent=1).splitlines()


def run_verify(args: argparse.Namespace) -> list[str] | Outcome:
    import json

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
