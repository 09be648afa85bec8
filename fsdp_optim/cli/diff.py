"""``fsdp-optim diff A B``: a short summary table of :func:`fsdp_optim.diff` (``--json``: the whole record).

Exit codes, as ``diff(1)`` and ``cmp(1)``: 0 equal (bit for bit, or within ``--atol``/``--rtol``), 1 different, 2
trouble: bad input (then one line on stderr, ``fsdp-optim: error: ...``, as every verb's) or bad usage.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from fsdp_optim.cli.arguments import Outcome, allow_global, count, tolerance

if TYPE_CHECKING:
    from fsdp_optim.offline.diff_report import DiffReport, DiffRow

EXIT_EQUAL, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2  # as diff(1) and cmp(1)


def add_diff(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "diff",
        help="compare two sources of one model per parameter and state key (exit 0 equal, 1 different, 2 trouble)",
        description="Compare the optimizer state of A and B, whatever their formats, world sizes and nesting: per "
        "parameter and state key, bitwise equality, max abs / rel error, max ULP distance, NaN and Inf counts; "
        "hyperparameters, steps, and what is on one side only; a whole checkpoint's weights, buffers and extra "
        "tensors too. Reads one tensor of each side at a time.",
    )
    p.add_argument("a", help="a sharded checkpoint directory, full dict file, named safetensors file or shard set")
    p.add_argument("b", help="the same kinds as A (the reference of relative errors)")
    p.add_argument("--atol", type=tolerance, default=0.0, help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--rtol", type=tolerance, default=0.0, help="tolerance relative to |B| (default 0: bitwise)")
    p.add_argument("--json", action="store_true", help="print the whole report (every row) as JSON")
    p.add_argument("--limit", type=count(0), default=20, metavar="N", help="rows of differences shown (default 20)")
    allow_global(p)
    p.set_defaults(run=run_diff)


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
