"""``fsdp-optim``: inspect, verify, compare, consolidate, reshard and convert checkpoints (the optimizer state, or
the whole training state), with no process group. docs/cli.md shows every verb, its output and its exit codes;
``fsdp-optim VERB --help`` every flag (:mod:`fsdp_optim.cli.parser`).

This module is the dispatcher: it parses, runs the verb (under ``torchrun``, across the processes:
:mod:`fsdp_optim.cli.team`), prints its lines and maps what it raised to an exit code: 0 done; 1 bad input (one line
on stderr, ``fsdp-optim: error: ...``; a verb may set its own code, ``diff``'s 2); 2 bad usage (argparse's, or a
:class:`~fsdp_optim.cli.arguments.UsageError` only the opened input reveals); 70 an internal error (with its
traceback); 130 interrupted (Ctrl-C: one line saying what was left as it was; a Ctrl-C once the verb's work is done
is ignored). Under ``torchrun`` every process exits with the same code and process 0 alone prints the error line.
torch and the package's modules are imported by the verb that needs them, so ``--help`` and argument errors cost no
more than starting Python, and no verb imports fairscale or the collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from fsdp_optim.cli.arguments import Outcome, UsageError
from fsdp_optim.cli.parser import build_parser

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
        from fsdp_optim.cli.team import run_in_team  # under torchrun: the verb split across the processes

        result = run_in_team(args, _run_verb)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
