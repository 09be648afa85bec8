"""``fsdp-optim``: inspect, verify, compare, consolidate, reshard and convert checkpoints (the optimizer state, or
the whole training state), with no process group.

    fsdp-optim inspect PATH [--units] [--json]
    fsdp-optim consolidate SRC -o FILE [--overwrite] [--layout PATH] [--optimizer NAME] [--no-model] [--rank R]
    fsdp-optim reshard SRC --world-size M -o DIR [--layout PATH] [--optimizer NAME] [--param-names FILE]
    fsdp-optim convert SRC -o FILE|DIR [--overwrite] [--layout PATH] [--optimizer NAME] [--param-names FILE]
                       [--to full|named|dcp|safetensors] [--optim-key KEY (--to dcp; default optimizer)]
    fsdp-optim verify PATH [--deep [--layout PATH]] [--json]
    fsdp-optim diff A B [--atol X] [--rtol Y] [--json]
    fsdp-optim list ROOT [--json] [--quick] [--memory-dir DIR|default]

``convert`` without ``--to`` writes what ``-o``'s extension names (``.safetensors``: the named safetensors file;
``.pt``/``.pth`` or any other: the full dict); a ``--to`` the extension contradicts is a usage error (exit 2).

Sources: a sharded checkpoint directory of ours, a full dict file, a fairscale-native dict file, and a
fairseq/metaseq shard set (``use_sharded_state``: any ``*-shard<r>.pt`` file of the set, or the path before
``-shard``; ``--allow-global module.Class`` allows a class its ``cfg`` holds, see
:mod:`fsdp_optim.formats.fairseq.loading`).
A shard set is consolidated into one fairseq-shaped checkpoint (every key kept, ``last_optimizer_state`` our
full dict, ``model`` the full weights unless ``--no-model``, as fairseq's own consolidation keeps them) and
resharded into shard files of the same format. A whole checkpoint (``save_checkpoint``) is consolidated into one
file ``{"model": the unwrapped model's state_dict(), "optimizer": the full dict, "extra": rank 0's (--rank R)}``.
``verify`` checks every file of a checkpoint or shard set (present, of its size, checksums matching) and exits 1
naming each damaged file. ``list`` shows the step directories of a :class:`~fsdp_optim.CheckpointManager` root
(complete / torn / damaged and why, world size, what each holds, bytes) and exits 0 (1 for a checkpoint given as
the root: ``inspect``/``verify`` read one). ``-o FILE`` never replaces an existing file without ``--overwrite``.

A plain (non-FSDP) optimizer's ``state_dict()`` names no parameters: ``convert`` and ``reshard`` take it with
``--param-names FILE`` (a JSON list of the model's ``named_parameters()`` names, or ``{name: shape}``), as
:func:`~fsdp_optim.name_optimizer_state` does in Python.

A fairscale-native dict (from fairscale's own ``gather_full_optim_state_dict``) names no parameters, so
every verb but ``inspect`` needs ``--layout`` for it and converts it with :func:`~fsdp_optim.from_fairscale`.

``diff`` compares two sources of one model (any formats, world sizes and nesting) per parameter and state key
and exits as ``diff(1)`` does: 0 when they are equal (bit for bit, or within ``--atol``/``--rtol``), 1 when they
differ, 2 for trouble (bad input, then with one line on stderr; bad usage). ``verify --deep`` also reads the state
for what a resumed run would trip on and exits 1 naming each finding's parameter and state key.

Exit codes: 0 done; 1 bad input (one line on stderr: ``fsdp-optim: error: ...``; ``diff``: 2, as diff(1)); 2 bad
usage (argparse: a flag's value out of range, such as ``--world-size 0``; an option the target does not take; an
``-o`` name the input cannot be written as, :class:`~fsdp_optim.cli.outcome.UsageError`);
70 an internal error (with its traceback); 130 interrupted (Ctrl-C: one line on stderr, ``interrupted; ...``,
saying what was left as it was; no traceback). A Ctrl-C that comes once the verb's work is done (its report being
printed, the interpreter exiting) is ignored: the exit is the verb's own. Under ``torchrun`` every process exits
with the same code and process 0 alone prints the error line (also written into ``torchrun``'s error file, which its
failure report shows). Every file is read with ``torch.load(..., weights_only=True)``. Progress bars appear on a
terminal only.

A dispatcher: torch and the package's modules are imported by the verb that needs them, so ``--help``
and argument errors cost no more than starting Python, and no verb imports fairscale or the collectives.
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

from fsdp_optim.cli.parser import build_parser

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 70, 130
# API parameter names as the command line spells them, for the "name: ..." prefix of an error.
_FLAGS = {
    "world_size": "--world-size",
    "layout": "--layout",
    "out_dir": "-o/--output",
    "param_order": "--layout",
    "allow_globals": "--allow-global",
    "optimizer": "--optimizer",
    "rank": "--rank",
    "with_model": "--with-model",
    "max_shard_size": "--max-shard-size",
    "param_names": "--param-names",
}


# ---------------------------------------------------------------------------------------------------
# inspect


# ---------------------------------------------------------------------------------------------------
# the other verbs


_parser = build_parser  # the grammar, for tests and docs that print --help


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
        from fsdp_optim.cli.outcome import UsageError

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
    from fsdp_optim.cli.outcome import Outcome

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
