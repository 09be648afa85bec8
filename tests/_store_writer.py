"""A writer job of its own (a subprocess, not a rank): ``python tests/_store_writer.py URL NAME STEPS [options]``.

It starts a one-rank gloo group, trains the test model ``STEPS`` steps and saves a whole checkpoint to ``URL`` with
``extra={"writer": NAME}`` (the endpoint comes from the AWS environment), then prints one JSON line: ``{"ok": true}``
or ``{"ok": false, "type": ..., "error": ...}``. Options:

- ``--state FILE``: write what the checkpoint must consolidate to (the gathered optimizer state) to ``FILE``;
- ``--hold DIR``: just before committing its manifest, create ``DIR/ready-NAME`` and wait for ``DIR/go`` (two
  writers then both commit after both began: a real race of conditional puts);
- ``--overwrite``: save with ``overwrite=True``; ``--refused-first``: first save without it and print whether that
  was refused (``ForeignOutputError``), then save with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models as M  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _dist import free_port  # noqa: E402

import fsdp_optim  # noqa: E402
from fsdp_optim.disk.save import Writer  # noqa: E402  (a store's writer: whose commit the save driver calls last)


def hold_before_commit(directory: Path, name: str) -> None:
    commit = Writer.commit

    def held(self, begun, data):  # type: ignore[no-untyped-def]
        if data is not None:
            (directory / f"ready-{name}").touch()
            while not (directory / "go").exists():
                time.sleep(0.05)
        return commit(self, begun, data)

    Writer.commit = held  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("name")
    parser.add_argument("steps", type=int)
    parser.add_argument("--state")
    parser.add_argument("--hold")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--refused-first", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(args.steps):
        M.train_step(root, optim, *M.local_batch(step, 0, 1))
    if args.state:
        full = root.gather_full_optim_state_dict(optim)
        torch.save({k: v for k, v in full.items() if k != "fsdp_optim"}, args.state)
    if args.hold:
        hold_before_commit(Path(args.hold), args.name)
    result: dict = {"ok": True}
    if args.refused_first:
        try:
            fsdp_optim.save_checkpoint(root, optim, args.url, extra={"writer": args.name})
            result["refused"] = None
        except fsdp_optim.ForeignOutputError as exc:
            result["refused"] = str(exc)
    try:
        overwrite = args.overwrite or args.refused_first
        fsdp_optim.save_checkpoint(root, optim, args.url, extra={"writer": args.name}, overwrite=overwrite)
    except Exception as exc:
        result.update(ok=False, type=type(exc).__name__, error=str(exc))
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # s3fs's event loop thread need not be joined


if __name__ == "__main__":
    main()
