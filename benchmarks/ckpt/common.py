"""What every checkpoint method shares: exact comparisons, per-rank probes, sizes on disk, durable writes.

``measure.measure`` checks a result on the recipient only, and no collective may run inside its timing
loop. A load, though, must be checked on every rank (each holds its own shard), and an asynchronous save
has a second time (until durable) that only its untimed ``finish`` sees. :class:`Probes` wraps a
:class:`~benchmarks.measure.Method` so that each rank checks its own result locally (first call only,
after ``finish``) and records its durable times; :meth:`Probes.merge` then brings every rank's notes and
times to rank 0 with one ``all_gather_object``, after the loop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import models
from ..measure import Measurement, Method, NotAvailable, measure, release_memory


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def difference(found: Any, expected: Any, where: str = "") -> str:
    """"" when ``found`` equals ``expected`` exactly (keys, types, dtypes, shapes, bits); else the first difference."""
    if torch.is_tensor(expected) or torch.is_tensor(found):
        if not (torch.is_tensor(found) and torch.is_tensor(expected)):
            return f"{where}: {type(found).__name__}, expected {type(expected).__name__}"
        a, b = local(found), local(expected)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}"
        if not torch.equal(a, b):
            return f"{where}: values differ (max |diff| {float((a.double() - b.double()).abs().max()):.3g})"
        return ""
    if isinstance(expected, Mapping):
        if not isinstance(found, Mapping):
            return f"{where}: {type(found).__name__}, expected a dict"
        if set(found) != set(expected):
            missing, extra = sorted(set(expected) - set(found), key=str), sorted(set(found) - set(expected), key=str)
            return f"{where}: keys missing {missing[:4]}, unexpected {extra[:4]}"
        for key in expected:
            text = difference(found[key], expected[key], f"{where}/{key}")
            if text:
                return text
        return ""
    if isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(found) != len(expected):
            return f"{where}: {found!r:.60}, expected {expected!r:.60}"
        for k, (a, b) in enumerate(zip(found, expected)):
            text = difference(a, b, f"{where}[{k}]")
            if text:
                return text
        return ""
    return "" if found == expected and type(found) is type(expected) else f"{where}: {found!r:.40}, expected {expected!r:.40}"


def wrong(text: str) -> str:
    return f"wrong output: {text}" if text else ""


@dataclass
class _Probe:
    check: Callable[[Any], str] | None
    note: str | None = None  # None until the first call was checked
    durable_s: list[float] = field(default_factory=list)


class Probes:
    """Rank-local checks and durable times of the methods of one ``measure`` call (see the module docstring)."""

    def __init__(self) -> None:
        self._probes: dict[str, _Probe] = {}

    def wrap(
        self,
        name: str,
        method: Method,
        check: Callable[[Any], str] | None = None,
        *,
        durable: Callable[[Any], Any] | None = None,
    ) -> Method:
        """``method`` whose result every rank checks with ``check`` (first call); ``durable(result)`` waits
        (untimed) until an asynchronous save is on disk, and the time since the call started is recorded."""
        probe = self._probes[name] = _Probe(check)
        held: dict[str, Any] = {}

        def call() -> Any:
            held["start"] = time.perf_counter()
            held["result"] = method.call()
            return held["result"]

        def finish() -> None:
            result = held.pop("result", None)
            if durable is not None:
                durable(result)
                probe.durable_s.append(time.perf_counter() - held["start"])
            if method.finish is not None:
                method.finish()
            if probe.note is None and probe.check is not None:
                try:
                    probe.note = probe.check(result)
                except Exception as exc:  # the benchmark's own check must not make a method n/a
                    traceback.print_exc()
                    probe.note = f"result not checked ({type(exc).__name__}: {exc})"[:200]

        return replace(method, call=call, finish=finish)

    def merge(self, results: dict[str, Measurement | NotAvailable] | None, warmup: int) -> None:
        """Collective: every rank's first failing note, and the slowest rank's durable time per timed call,
        into ``results`` (rank 0's ``measure`` output; ``None`` elsewhere)."""
        mine = {name: (p.note or "", p.durable_s) for name, p in self._probes.items()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if results is None:
            return
        for name in self._probes:
            value = results.get(name)
            if not isinstance(value, Measurement):
                continue
            bad = [(r, theirs[name][0]) for r, theirs in enumerate(everyone) if theirs[name][0]]
            if bad and not value.note:
                rank, note = bad[0]
                value.note = note if len(bad) == len(everyone) else f"{note} (rank {rank})"
            times = [theirs[name][1][warmup:] for theirs in everyone]
            if all(times):
                value.extra["durable_s"] = [max(t[k] for t in times) for k in range(min(map(len, times)))]


@dataclass(frozen=True)
class Job:
    """What every job (``gather``, ``ckpt``, ``whole``, ``storage``) is configured with; each adds its own fields.

    ``build(wrap, rank)`` makes the model with ``wrap`` (``models.wrap_fairscale`` / ``wrap_fsdp2``) and trains it
    ``steps`` Adam steps; ``measure(methods, probes)`` measures them with the job's warm-up and repeats."""

    model: models.ModelSpec
    steps: int  # Adam steps before anything is saved
    warmup: int
    repeats: int

    def build(self, wrap: Any, rank: int, device: torch.device | None = None) -> tuple[Any, torch.optim.Optimizer]:
        device = device or torch.device("cpu")
        model = wrap(self.model, device)
        optim = models.train(model, self.model, self.steps, rank, device)
        optim.zero_grad(set_to_none=True)  # DCP initialises a fresh optimizer only when grads are None; not gathered
        return model, optim

    def measure(self, methods: dict[str, Method], probes: Probes | None = None, **kw: Any) -> dict[str, Measurement | NotAvailable]:
        return measure_probed(methods, probes, **{"warmup": self.warmup, "repeats": self.repeats, **kw})


def publish(references: dict[str | Path, Any]) -> None:
    """Collective: rank 0 saves each reference (what a job of another world size checks its load against) to its
    path; every rank waits for it."""
    if dist.get_rank() == 0:
        for path, obj in references.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, path)
    dist.barrier()


@contextlib.contextmanager
def phase(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time the ``with`` block into ``timings[name]`` (seconds): a job's phases, for its log."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


def measure_probed(
    methods: dict[str, Method], probes: Probes | None, *, warmup: int, repeats: int
) -> dict[str, Measurement | NotAvailable]:
    """Collective: :func:`~benchmarks.measure.measure` of ``methods``, ``probes`` (if any) merged into the results,
    then memory released; the results on rank 0, ``{}`` elsewhere."""
    results = measure(methods, warmup=warmup, repeats=repeats)
    if probes is not None:
        probes.merge(results, warmup)
    release_memory()
    return results or {}


def measured_and_removed(disk: dict[str, int], name: str, path: Path) -> Callable[[], None]:
    """A method's untimed ``finish`` on rank 0: the bytes its output holds into ``disk[name]``, then the output removed."""

    def finish() -> None:
        if dist.get_rank() == 0:
            disk[name] = disk_bytes(path)
            remove(path)

    return finish


def disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of a file, or of every file under a directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: str | os.PathLike[str]) -> None:
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Loads:
    """Where a job's loads read: its own checkpoint, another world size's (with the reference it must equal)."""

    same_dir: Path
    other_dir: Path | None
    other_reference: Path | None
    probes: Probes


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    """This rank's parameter shards (a DTensor's local shard), copied: what a same-W whole-state load must restore."""
    return [local(p.detach()).clone() for p in model.parameters()]


def same_as(model: nn.Module, weights: list[torch.Tensor], optim: torch.optim.Optimizer) -> Callable[[Any], str]:
    """A check of a same-W whole-state load: the model's shards equal ``weights``, the loaded optimizer equals ``optim``."""

    def check(loaded: torch.optim.Optimizer) -> str:
        found = [local(p.detach()) for p in model.parameters()]
        return wrong(difference(found, weights, "weights") or difference(loaded.state_dict(), optim.state_dict(), "optim"))

    return check


def load_method(name: str, model: nn.Module, load: Callable[[torch.optim.Optimizer], None], check: Callable[[Any], str], probes: Probes, *,
                zero: bool = True) -> Method:  # fmt: skip
    """``load(fresh_adam)`` into ``model``, the fresh Adam (and, with ``zero``, the zeroed parameters: a whole-state load
    that skipped anything shows in the check) made untimed before each call; returns the loaded optimizer. Every rank
    checks the first call with ``check``."""
    fresh: list[torch.optim.Optimizer] = []

    def prepare() -> None:
        if zero:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        fresh[:] = [torch.optim.Adam(model.parameters(), lr=models.LR)]

    def call() -> torch.optim.Optimizer:
        load(fresh[0])
        return fresh[0]

    return probes.wrap(name, Method(call, prepare=prepare, finish=fresh.clear), check)


def reloads(name: str, model: nn.Module, optim: torch.optim.Optimizer, load: Callable[[torch.optim.Optimizer], None], probes: Probes) -> Method:
    """A same-W whole-state load (``load_method``): it must give back the live weight shards and ``optim`` exactly."""
    return load_method(name, model, load, same_as(model, snapshot(model), optim), probes)


def fresh_load_methods(prefix: str, model: Any, optim: torch.optim.Optimizer, load_into: Callable[[torch.optim.Optimizer, Path], None],
                       other_wrong: Callable[[torch.optim.Optimizer, Any], str], where: Loads) -> dict[str, Method]:  # fmt: skip
    """``{prefix}_load_same`` (and ``{prefix}_load_other``): ``load_into`` a fresh Adam of ``model`` (``load_method``,
    parameters as they are). The same-W result must equal the live ``optim``; ``other_wrong(loaded, reference full
    dict)`` says what is wrong with the other-W result ("" when right)."""

    def same_as_live(loaded: torch.optim.Optimizer) -> str:
        return wrong(difference(loaded.state_dict(), optim.state_dict(), "state_dict"))

    def same_as_other(loaded: torch.optim.Optimizer) -> str:
        return other_wrong(loaded, torch.load(where.other_reference, mmap=True, weights_only=True))  # type: ignore[arg-type]

    methods, same = {}, f"{prefix}_load_same"
    methods[same] = load_method(same, model, lambda target: load_into(target, where.same_dir), same_as_live, where.probes, zero=False)
    if where.other_dir is not None:
        other = f"{prefix}_load_other"
        methods[other] = load_method(other, model, lambda target: load_into(target, where.other_dir), same_as_other, where.probes, zero=False)  # type: ignore[arg-type]
    return methods
