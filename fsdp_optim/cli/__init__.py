"""``fsdp-optim``: inspect, verify, compare, consolidate, reshard and convert checkpoints (the optimizer state, or
the whole training state), with no process group. docs/cli.md shows every verb, its output and its exit codes;
``fsdp-optim VERB --help`` every flag (:mod:`fsdp_optim.cli.parser`).

This module is the dispatcher: it parses, runs the verb, prints its lines and maps what it raised to an exit code:
0 done; 1 bad input (one line on stderr, ``fsdp-optim: error: ...``; a verb may set its own code, ``diff``'s 2); 2 bad
usage (argparse's, or a :class:`~fsdp_optim.cli.arguments.UsageError` only the opened input reveals); 70 an internal
error (with its traceback); 130 interrupted (Ctrl-C: one line saying what was left as it was; a Ctrl-C once the
verb's work is done is ignored).

Run by ``torchrun`` (``torchrun --nproc_per_node N -m fsdp_optim VERB ...``), the processes join one team
(:func:`fsdp_optim.job.team.team_of_job`). ``reshard`` and ``verify`` (``--deep`` too) of our sharded checkpoint are
split across them (:mod:`fsdp_optim.offline.parallel`), and so is ``consolidate -o FILE.safetensors`` of one (each
process writes its share of the one file) and ``diff`` when both sides are read by ranges, as
:func:`fsdp_optim.offline.parallel.entry.splits` decides for the API too; every other verb runs on process 0 while the
others wait for it (:func:`~fsdp_optim.offline.parallel.alone.alone`). Every process exits with the same code and
process 0 alone prints the verb's report, or its error line.
torch and the package's modules are imported by the verb that needs them, so ``--help`` and argument errors cost no
more than starting Python, and no verb imports fairscale or the collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fsdp_optim.cli.arguments import Outcome, UsageError
from fsdp_optim.cli.parser import build_parser

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 70, 130
# API parameter names as the command line spells them, for the "name: ..." prefix of an error.
_FLAGS = {"out_dir": "-o/--output", "param_order": "--layout", "allow_globals": "--allow-global"} | {
    name: "--" + name.replace("_", "-")
    for name in ("world_size", "layout", "optimizer", "rank", "with_model", "max_shard_size", "param_names")
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check = getattr(args, "check", None)  # a usage check that needs more than one flag (exit 2, as argparse's)
    problem = check(args) if check is not None else None
    if problem is not None:
        args.usage_error(problem)  # the verb's parser: its usage line, the message, exit 2
    interrupts = _Interrupts()
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupts) if on_main_thread else None
    try:
        return _run(args, interrupts)
    finally:
        if on_main_thread:
            # The program itself (no argv: the console script, python -m) exits next: a Ctrl-C from here on would
            # kill it silently with 130 after its work was reported done, so it is ignored; a caller gets its
            # handler back.
            signal.signal(signal.SIGINT, signal.SIG_IGN if argv is None and interrupts.done else previous)


class _Interrupts:
    """The SIGINT handler of a run: the first Ctrl-C raises ``KeyboardInterrupt`` (the writers' cleanup runs as
    it unwinds) and is remembered, so an error a library made of it (torch's writer turns it into a
    ``RuntimeError``) still reads as an interrupt; a later Ctrl-C is ignored, so that cleanup finishes. Once the
    verb has returned (``done``: its work is done, only its report is left to print), a Ctrl-C is ignored."""

    def __init__(self) -> None:
        self.seen = False
        self.done = False

    def __call__(self, signum: int, frame: object) -> None:  # noqa: ARG002 - the handler signature
        if not self.seen and not self.done:
            self.seen = True
            raise KeyboardInterrupt


def _run_verb(args: argparse.Namespace) -> Any:
    """``args.run(args)``; an ``-o`` URL is written to a local path first and published when the verb succeeds
    (:func:`fsdp_optim.offline.publish.checkpoint_output`; a verb that writes rank files may start their uploads
    through ``args.after_file``), and the lines name the URL."""
    from fsdp_optim.cli.verbs import uploads_itself
    from fsdp_optim.offline.publish import checkpoint_output

    url = getattr(args, "output", None)
    if not isinstance(url, str) or uploads_itself(args):
        return args.run(args)
    inputs = [getattr(args, name, None) for name in ("source", "layout")]
    overwrite = bool(getattr(args, "overwrite", False))
    with checkpoint_output(url, overwrite=overwrite, inputs=inputs, keep_checkpoint=True) as (local, file_done):
        args.output, args.after_file = str(local), file_done  # (a local output: itself, as given)
        result = args.run(args)
    args.output = url
    if isinstance(result, list):
        return [line.replace(str(local), url) for line in result]
    return result


def _run(args: argparse.Namespace, interrupts: _Interrupts) -> int:
    from fsdp_optim.disk.text import escape  # names and messages may carry a file's text: no terminal controls

    output = getattr(args, "output", None)
    before = _signature(output)
    try:
        result = _run_in_team(args, _run_verb)
    except BaseException as exc:
        if interrupts.seen or isinstance(exc, KeyboardInterrupt):
            _say_error(escape(f"interrupted; {_left(output, before)}", limit=2000), exc)
            return EXIT_INTERRUPTED
        if isinstance(exc, UsageError):
            usage_error = getattr(args, "usage_error", None)
            if usage_error is not None:
                usage_error(str(exc))  # the verb's usage line, the message, exit 2 (SystemExit)
            _say_error(f"fsdp-optim: error: {escape(_one_line(exc), limit=2000)}", exc)
            return EXIT_USAGE
        if isinstance(exc, (ValueError, TypeError, OSError, NotImplementedError, ImportError)):
            _say_error(f"fsdp-optim: error: {escape(_one_line(exc), limit=2000)}", exc)
            return getattr(exc, "exit_code", EXIT_BAD_INPUT)  # a verb's own code for bad input (diff: 2)
        if not isinstance(exc, Exception):
            raise
        traceback.print_exc()
        print("fsdp-optim: internal error (please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL
    interrupts.done = True  # the work is done: a Ctrl-C from here on does not undo it, nor cut its report
    lines, code = (result.lines, result.code) if isinstance(result, Outcome) else (result, EXIT_OK)
    try:
        for line in lines:
            print(escape(line, limit=1 << 20), flush=True)
    except BrokenPipeError:  # `fsdp-optim inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def _say_error(line: str, exc: BaseException) -> None:
    """The one line of a failed verb on stderr: under ``torchrun`` by process 0 alone (the processes agreed on the
    error and exit with the same code, so the others stay silent), unless this process lost contact with the others
    (process 0 may be the one that died: then each survivor says so). Each process also writes the line into the
    error file ``torchrun`` names (``TORCHELASTIC_ERROR_FILE``), so that the launcher's own report of a non-zero exit
    (which it prints for any failed process, and which no flag turns off) names the error, not a traceback hint."""
    from fsdp_optim.job.launcher import launched

    team = launched()
    lost = isinstance(exc, ConnectionError) or "lost contact with another process" in str(exc)
    if not team or os.environ.get("RANK") == "0" or lost:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if team else None
    if error_file:
        import json
        import time

        with contextlib.suppress(OSError):  # the report is a courtesy: the exit code says the outcome
            with open(error_file, "w") as file:
                json.dump({"message": line, "timestamp": int(time.time())}, file)


def _signature(output: Any) -> tuple[int, int, int, int] | None:
    """What identifies ``output``'s current content cheaply (``None``: nothing there, or no output)."""
    if not isinstance(output, str) or not os.path.lexists(output):
        return None
    st = os.lstat(output)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _left(output: Any, before: tuple[int, int, int, int] | None) -> str:
    """What an interrupt left: every writer stages its output and commits last, removing what it staged when
    interrupted, so the output is as it was before, unless the interrupt came after the commit (a file moved in
    whole: then it is said that it was written)."""
    if output is None:
        return "nothing was written"
    now = _signature(output)
    if now is not None and now != before and os.path.isfile(output):
        return f"{output} was written (whole) before the interrupt; only the report of the work was cut short"
    if before is not None:
        return f"{output} was left as it was"
    return f"nothing was written to {output}"


def _one_line(exc: BaseException) -> str:
    """The error on one line, an API parameter named at its start spelled as the command line's flag."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return re.sub(r"^(\w+):", lambda m: f"{_FLAGS.get(m.group(1), m.group(1))}:", message)


def _run_in_team(args: argparse.Namespace, run: Callable[[argparse.Namespace], Any]) -> Any:
    """``run(args)``: by this process alone unless ``torchrun`` started it (the module docstring says how then)."""
    from fsdp_optim.job.launcher import launched

    if not launched():
        return run(args)
    from fsdp_optim.job.team import team_of_job
    from fsdp_optim.job.transport import shut_down

    team = team_of_job()
    assert team is not None, "launched() means a team of 2 or more"
    try:
        result = _split_or_alone(team, args, run)
        code = team.from_first(result.code if isinstance(result, Outcome) else 0)
    finally:
        shut_down()
    return result if team.rank == 0 else Outcome((), code)


def _split_or_alone(team: Team, args: argparse.Namespace, run: Callable[[argparse.Namespace], Any]) -> Any:
    from fsdp_optim.cli.inspect import run_diff, run_verify
    from fsdp_optim.cli.verbs import checked_opening, run_consolidate, run_reshard
    from fsdp_optim.offline.parallel.alone import alone
    from fsdp_optim.offline.parallel.entry import splits
    from fsdp_optim.offline.parallel.onefile import consolidate_across

    if args.run is run_reshard and args.param_names is None and splits("reshard", args.source, output=args.output):
        return _reshard(team, args)
    if args.run is run_consolidate and splits("consolidate", args.source, output=args.output):
        # -o FILE.safetensors of our sharded checkpoint: every process writes its share of the one file
        what = consolidate_across(team, lambda: checked_opening(args), args.output, rank=args.rank,
                                  no_model=args.no_model, inputs=(args.source, args.layout), overwrite=args.overwrite,
                                  bar=sys.stderr.isatty())  # fmt: skip
        return [f"wrote {args.output}: {what}"]
    reads = (args.run is run_verify and splits("verify", args.path)) or (
        args.run is run_diff and splits("diff", args.a, args.b)
    )
    if reads:
        args.parallel = True  # each reads its share
        with contextlib.redirect_stdout(sys.stdout if team.rank == 0 else io.StringIO()):
            return run(args)
    return alone(team, lambda: run(args), str(args.verb))


def _reshard(team: Team, args: argparse.Namespace) -> list[str]:
    """``fsdp-optim reshard`` split across ``team``; its report line, as one process words it."""
    from fsdp_optim.cli.verbs import resharded_words
    from fsdp_optim.formats.sharded.locate import read_manifest
    from fsdp_optim.offline.opened.written import RankFiles
    from fsdp_optim.offline.parallel.entry import reshard_in_team

    manifest = reshard_in_team(team, args.source, args.world_size, args.output, layout=args.layout,
                               optimizer=args.optimizer, allow_globals=args.allow_global, overwrite=args.overwrite,
                               replace_existing=False, buffers=args.buffers, bar=sys.stderr.isatty())  # fmt: skip
    done = read_manifest(manifest)
    sides = done.training.files if done.training is not None else None
    written = RankFiles(len(done.files), sum(f.nbytes for f in done.files), None if sides is None else len(sides),
                        sum(f.nbytes for f in sides or ()))  # fmt: skip
    return [f"wrote {args.output}: {resharded_words(written)}"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
