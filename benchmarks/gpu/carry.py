"""``python -m benchmarks.gpu.carry DEST``: copy the pure-Python packages the GPU machine's image lacks into ``DEST``.

``.ci/gpu-check --prepare`` runs this here, where the test extra is installed; the device call then carries
``DEST`` (``.gpu/``, ignored by git) and ``.ci/gpu-check`` puts it on ``PYTHONPATH`` there. Each package is copied
as its folder, without ``__pycache__`` (the machine's Python differs). It fails (exit status 1, one line naming the
package and what to do) when one is not importable here, is a single module instead of a folder, or holds compiled
extensions (they would not load on the machine's Python): checked before anything is written, ``DEST`` unchanged.
A copy that holds no Python file fails too, and ``DEST`` is then removed, so that a half carry never travels.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

CARRIED = ("fairscale", "parameterized")  # what the tests and the package import that the image lacks
COMPILED = ("*.so", "*.pyd", "*.dylib")


class CarryError(RuntimeError):
    """A package cannot be carried: what, and what to do."""


def package_folder(name: str) -> Path:
    """The folder of the importable package ``name`` here."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise CarryError(f"{name} is not importable here ({sys.executable}): install the test extra "
                         '(python -m pip install -c constraints.txt -e ".[test]") and run --prepare again')  # fmt: skip
    if not spec.submodule_search_locations:
        raise CarryError(f"{name} is a single module at {spec.origin}, expected a package folder to copy")
    folder = Path(next(iter(spec.submodule_search_locations)))
    compiled = [str(p.relative_to(folder)) for pattern in COMPILED for p in folder.rglob(pattern)]
    if compiled:
        raise CarryError(f"{name} at {folder} holds compiled files {compiled[:3]}: not pure Python, cannot travel")
    return folder


def carry(dest: Path, names: tuple[str, ...] = CARRIED) -> dict[str, int]:
    """Replace ``dest`` with a copy of each package; returns the Python files copied per package."""
    folders = {name: package_folder(name) for name in names}  # every check before anything is written
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    counts: dict[str, int] = {}
    try:
        for name, folder in folders.items():
            shutil.copytree(folder, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            counts[name] = sum(1 for _ in (dest / name).rglob("*.py"))
            if counts[name] == 0 or not (dest / name / "__init__.py").is_file():
                raise CarryError(f"{name}: the copy in {dest / name} holds {counts[name]} Python files, no __init__.py")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.carry", description=__doc__.split("\n")[0])
    parser.add_argument("dest", type=Path, help="the folder to fill (.gpu)")
    args = parser.parse_args(argv)
    try:
        counts = carry(args.dest)
    except (CarryError, OSError) as exc:
        print(f"gpu-check --prepare FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"gpu-check --prepare: carried {', '.join(f'{n} ({c} files)' for n, c in counts.items())} into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
