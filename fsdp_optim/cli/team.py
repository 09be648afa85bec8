"""``fsdp-optim`` run by ``torchrun`` (``torchrun --nproc_per_node N -m fsdp_optim VERB ...``): the processes join
one team (:func:`fsdp_optim.job.team.team_of_job`). ``reshard`` and ``verify`` (``--deep`` too) of our sharded
checkpoint are split across them (:mod:`fsdp_optim.offline.parallel`), and so is ``consolidate -o FILE.safetensors``
of one (each process writes its share of the one file) and ``diff`` when both sides are read by ranges, as
:func:`fsdp_optim.offline.parallel.entry.splits` decides for the API too; every other verb runs on process 0 while the
others wait for it (:func:`~fsdp_optim.offline.parallel.shared.alone`). Process 0 prints the verb's report; every
process exits with its code, and with its error when it failed. Without ``torchrun`` (no ``RANK``/``WORLD_SIZE`` of
2 or more), nothing here runs."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdp_optim.cli.arguments import Outcome

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team

__all__ = ["run_in_team"]


def run_in_team(args: argparse.Namespace, run: Callable[[argparse.Namespace], Any]) -> Any:
    """``run(args)`` as the module docstring says: by this process alone unless ``torchrun`` started it."""
    from fsdp_optim.job.launcher import launched

    if not launched():
        return run(args)
    from fsdp_optim.job.team import team_of_job
    from fsdp_optim.job.transport import group_initialized, shut_down

    joined = not group_initialized()
    team = team_of_job()
    assert team is not None, "launched() means a team of 2 or more"
    if joined:
        # The group we joined stays up until the process exits: torn down here, a second verb in this process
        # could rejoin through the last one's store before process 0 closed it, and dial its closed ports.
        atexit.unregister(shut_down)  # registered once, however many verbs this process runs
        atexit.register(shut_down)
    try:
        result = _split_or_alone(team, args, run)
        code = team.from_first(result.code if isinstance(result, Outcome) else 0)
    finally:
        team.close()
    return result if team.rank == 0 else Outcome((), code)


def _split_or_alone(team: Team, args: argparse.Namespace, run: Callable[[argparse.Namespace], Any]) -> Any:
    from fsdp_optim.cli.inspect import run_diff, run_verify
    from fsdp_optim.cli.verbs import checked_opening, run_consolidate, run_reshard
    from fsdp_optim.offline.parallel.entry import splits
    from fsdp_optim.offline.parallel.shared import alone

    if args.run is run_reshard and args.param_names is None and splits("reshard", args.source, output=args.output):
        return _reshard(team, args)
    if args.run is run_consolidate and splits("consolidate", args.source, output=args.output):
        from fsdp_optim.offline.parallel.onefile import consolidate_across  # each process writes its share

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
