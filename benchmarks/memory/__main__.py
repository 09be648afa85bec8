"""``python -m benchmarks.memory OPERATION|all [--small] [--layers N] [--repeat R] [--workdir DIR] [--json FILE]``.

Each operation builds its sources once in ``--workdir`` (reused when they are there; by default a temporary
directory, removed at the end), measures its rows and prints a table; ``--json`` writes it (``all``: ``FILE`` names a folder, one
``<operation>.json`` each). Rows that run in a fresh interpreter come back through ``peak.fresh``, which runs
``python -m benchmarks.memory --measure OPERATION ROW ...`` (the module's ``measure``). ``--small``: each
operation's smallest sources, to check that it runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..peak import reply

# operation -> what it measures (its module is benchmarks/memory/<operation>.py)
OPERATIONS = {
    "dcp_export": "to_dcp: files, time and peak memory against the per-tensor writer, DCP's one-file writer and dcp.save",
    "named_safetensors": "to_safetensors and load_full_state against torch.save/load and safetensors' save_file/load_file",
    "diff": "diff of two sources against reading both",
    "checkpoint": "offline consolidate and reshard of a sharded checkpoint, by mapping bound, against loading every file",
    "fairseq": "reshard, to_dcp and consolidate of a fairseq/metaseq shard set against metaseq's load-everything reshard",
    "verify": "verify of a sharded checkpoint against reading and hashing every rank file",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:  # in a fresh interpreter, for peak.fresh
        reply(**importlib.import_module(f"benchmarks.memory.{argv[1]}").measure(*argv[2:]))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n")[0])
    p.add_argument("operation", choices=[*OPERATIONS, "all"])
    p.add_argument("--small", action="store_true", help="each operation's smallest sources")
    p.add_argument("--layers", type=int, default=None, help="layers (units) of the state; default: the operation's")
    p.add_argument("--repeat", type=int, default=None, help="rounds of the rows; default: the operation's")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in OPERATIONS if args.operation == "all" else [args.operation]:
        print(f"== {name}: {OPERATIONS[name]}", flush=True)
        module = importlib.import_module(f"benchmarks.memory.{name}")
        tmpfs = getattr(module, "TMPFS", False) and os.path.isdir("/dev/shm")  # where only the CPU cost is measured
        work = (args.workdir / name) if args.workdir else Path(tempfile.mkdtemp(prefix=f"memory_{name}_", dir="/dev/shm" if tmpfs else None))
        work.mkdir(parents=True, exist_ok=True)
        try:
            result = module.run(work, args)
        finally:
            if not args.workdir:  # a --workdir keeps the sources for the next run
                shutil.rmtree(work, ignore_errors=True)
        if args.json:
            out = args.json / f"{name}.json" if args.operation == "all" else args.json
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
