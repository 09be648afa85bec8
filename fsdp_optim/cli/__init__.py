"""``fsdp-optim``: inspect, consolidate, reshard and convert optimizer checkpoints, with no process group.

    fsdp-optim inspect PATH [--units]
    fsdp-optim consolidate SRC -o FILE [--layout PATH] [--optimizer NAME] [--no-model] [--rank R]
    fsdp-optim reshard SRC --world-size M -o DIR [--layout PATH] [--optimizer NAME]
    fsdp-optim convert SRC -o FILE|DIR [--layout PATH] [--optimizer NAME] [--to full|named|dcp|safetensors]
    fsdp-optim verify PATH

Sources: a sharded checkpoint directory of ours, a full dict file, a fairscale-native dict file, and a
fairseq/metaseq shard set (``use_sharded_state``: any ``*-shard<r>.pt`` file of the set, or the path before
``-shard``; ``--allow-global module.Class`` allows a class its ``cfg`` holds, see :mod:`fsdp_optim.fairseq_format`).
A shard set is consolidated into one fairseq-shaped checkpoint (every key kept, ``last_optimizer_state`` our
full dict, ``model`` the full weights unless ``--no-model``, as fairseq's own consolidation keeps them) and
resharded into shard files of the same format. A whole checkpoint (``save_checkpoint``) is consolidated into one
file ``{"model": the unwrapped model's state_dict(), "optimizer": the full dict, "extra": rank 0's (--rank R)}``.
``verify`` checks every file of a checkpoint or shard set
(present, of its size, checksums matching) and exits 1 naming each damaged file.

A fairscale-native dict (from fairscale's own ``gather_full_optim_state_dict``) names no parameters, so
every verb but ``inspect`` needs ``--layout`` for it and converts it with :func:`~fsdp_optim.from_fairscale`.

Exit codes: 0 done; 1 bad input (one line on stderr: ``fsdp-optim: error: ...``); 2 bad usage (argparse);
70 an internal error (with its traceback). Every file is read with ``torch.load(..., weights_only=True)``.
Progress bars appear on a terminal only.

A dispatcher: torch and the package's modules are imported by the verb that needs them, so ``--help``
and argument errors cost no more than starting Python, and no verb imports fairscale or the collectives.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Sequence

from fsdp_optim.cli.parser import build_parser

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 70
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
}


# ---------------------------------------------------------------------------------------------------
# inspect


# ---------------------------------------------------------------------------------------------------
# the other verbs


_parser = build_parser  # the grammar, for tests and docs that print --help


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lines = args.run(args)
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        from fsdp_optim.disk.text import escape  # names and messages may carry a file's text: no terminal controls

        print(f"fsdp-optim: error: {escape(_one_line(exc), limit=2000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        print("fsdp-optim: internal error (please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL
    from fsdp_optim.disk.text import escape

    try:
        for line in lines:
            print(escape(line, limit=1 << 20), flush=True)
    except BrokenPipeError:  # `fsdp-optim inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    """The error on one line, an API parameter named at its start spelled as the command line's flag."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return re.sub(r"^(\w+):", lambda m: f"{_FLAGS.get(m.group(1), m.group(1))}:", message)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
