"""The main job: train under FSDP, save the whole training state, resume at another world size, verify.

Run it as users run FSDP jobs::

    torchrun --nproc_per_node 4 -m fsdp_optim.demo

Any world size works, on any machine: NCCL with one GPU per local rank when this node has a GPU for every local
rank, otherwise gloo on the CPU (``--device`` chooses; the first line says which and why). Steps:

1. train a small model with nested FSDP units and Adam at the launched world size ``W``, reading a small synthetic
   dataset through a real ``DataLoader`` and ``ResumableSampler`` (global batch ``8 * W``, per-rank batch 8);
2. time the gather of the full optimizer state (both transports), then save the whole training state
   (weights, buffers, optimizer state, the loop's step, the data position) as one sharded checkpoint with
   ``save_checkpoint(..., data=sampler)``;
3. resume on a process group of ``max(1, W // 2)`` ranks with a different FSDP nesting, keeping the global batch
   (per-rank batch 16): ``load_checkpoint(..., data=sampler)`` re-cuts every rank's weight and optimizer shards
   from the checkpoint and starts each rank at its share of the next global batch; keep training;
4. resume once more on one process without FSDP: ``consolidate`` the checkpoint offline into the unwrapped
   model's ``state_dict()`` and a plain ``torch.optim.Adam`` state dict;
5. compare both resumed runs with an uninterrupted unwrapped run on one process (the same global batches: the
   sampler at one rank), weights and optimizer state and the loss of every step, and exit non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim import consolidate, gather_full_optim_state_dict, load_checkpoint, save_checkpoint
from fsdp_optim.demo_data import VOCAB, Loader, stream, synthetic_loader

DIM = 96


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the head: keep the first logits small

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _wrap(model: TinyLM, every: int, group: dist.ProcessGroup) -> FSDP:
    """Wrap every ``every``-th layer in its own FSDP unit, then the root, all on ``group``."""
    kwargs = dict(process_group=group, process_group_reduce_scatter=group)
    for i in range(0, len(model.layers), every):
        model.layers[i] = FSDP(model.layers[i], **kwargs)
    return FSDP(model, **kwargs)


def choose_device(choice: str, local_ranks: int) -> tuple[torch.device, str, str]:
    """``(device, backend, why)``: a GPU per local rank under NCCL when there are enough, else the CPU under gloo."""
    gpus = torch.cuda.device_count()
    enough = gpus >= local_ranks
    if choice == "cuda" and not enough:
        raise SystemExit(f"--device cuda: expected a GPU for each of the {local_ranks} local ranks, found {gpus}")
    if choice == "cpu":
        return torch.device("cpu"), "gloo", "asked for"
    if choice == "auto" and not enough:
        why = f"{gpus} GPU(s) for {local_ranks} local ranks: NCCL needs one GPU per rank" if gpus else "no GPU here"
        return torch.device("cpu"), "gloo", why
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", local_rank), "nccl", f"one of {gpus} GPU(s) per local rank"


def train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    loader: Loader,
    steps: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """``steps`` steps on the loader's next global batches; each step's loss over its global batch (the ranks' mean
    over ``group``: their batches are equal)."""
    losses = []
    for inputs, targets in stream(*loader, steps):
        optim.zero_grad()
        loss = F.cross_entropy(model(inputs.to(device)).float().reshape(-1, VOCAB), targets.to(device).reshape(-1))
        loss.backward()
        optim.step()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
            total /= dist.get_world_size(group)
        losses.append(total.item())
    return losses


def timed_gather(
    model: FSDP,
    optim: torch.optim.Optimizer,
    transport: Literal["tensor", "object"],
    repeats: int,
    group: dist.ProcessGroup,
) -> tuple[dict | None, float]:
    times, full = [], None
    for _ in range(repeats + 1):  # the first call warms up
        dist.barrier(group)
        start = time.perf_counter()
        full = model.gather_full_optim_state_dict(optim, transport=transport)
        times.append(time.perf_counter() - start)
    return full, statistics.median(times[1:]) * 1e3


def plural(ranks: int) -> str:
    return f"{ranks} rank" + ("s" if ranks != 1 else "")


def _state_bytes(full: dict) -> int:
    return sum(v.numel() * v.element_size() for s in full["state"].values() for v in s.values() if torch.is_tensor(v))


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in b)


def compare_optim(full: dict, plain: dict) -> float:
    if full["param_groups"] != plain["param_groups"]:
        raise AssertionError("param groups differ from the uninterrupted run")
    return max(max_diff(full["state"][pid], entry) for pid, entry in plain["state"].items())


@dataclass
class Job:
    """Where this process stands: its rank in the launched world, the checkpoint directory, the steps."""

    args: argparse.Namespace
    rank: int
    world: int
    backend: str
    device: torch.device  # where the models train: a GPU of this rank's own under NCCL, else the CPU
    out: str
    temporary: bool  # out was made here (no --out): main() removes it at the end
    batch: int  # global batch: divisible by the world size and by the resumed world size
    first: range  # steps before the checkpoint
    second: range  # steps after it

    @property
    def checkpoint(self) -> str:
        """The whole checkpoint of the step the resumes start from."""
        return os.path.join(self.out, f"step-{self.first.stop:08d}")

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


def start(argv: Sequence[str] | None) -> Job:
    """Parse the options, join the process group ``torchrun`` launched, agree on a checkpoint directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps before the checkpoint, and again after it")
    parser.add_argument(
        "--out", default=None, help="checkpoint directory, kept (default: a temporary one, removed at the end)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed gathers per transport")
    # Adam turns last-bit differences of near-zero gradients into updates of up to ~lr/10, so parameters
    # get a looser bound than the optimizer state; losing the state moves parameters by ~lr per step.
    parser.add_argument("--param-tolerance", type=float, default=1e-3)
    parser.add_argument("--state-tolerance", type=float, default=1e-5)
    parser.add_argument("--loss-tolerance", type=float, default=1e-4, help="largest relative loss difference")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto (default): a GPU per local rank under NCCL when this node has enough, else the CPU under gloo",
    )
    args = parser.parse_args(argv)
    # fairscale 0.4.13 calls APIs that torch 2.13 deprecates (TypedStorage, _reduce_scatter_base).
    for message in (".*TypedStorage.*", ".*_reduce_scatter_base.*", ".*_all_gather_base.*"):
        warnings.filterwarnings("ignore", message=message)
    device, backend, why = choose_device(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    box = [args.out or (tempfile.mkdtemp(prefix="fsdp_optim_demo_") if rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    out = box[0]
    if not isinstance(out, str):
        raise RuntimeError(f"expected rank 0 to broadcast the checkpoint directory, found {out!r}")
    os.makedirs(out, exist_ok=True)
    steps, temporary = args.steps, args.out is None
    job = Job(args, rank, world, backend, device, out, temporary, 8 * world, range(steps), range(steps, 2 * steps))
    job.say(f"fsdp_optim demo on {'GPUs' if device.type == 'cuda' else 'the CPU'} ({backend}): {why}")
    return job


def train_gather_and_save(job: Job) -> list[float]:
    """Steps 1-2: train at the launched world size, time the gather, save the whole state as a sharded checkpoint."""
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("expected the default process group to exist (start() joins it), found None")
    model = _wrap(build_model().to(job.device), every=1, group=world)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = synthetic_loader(job.batch, job.world, job.rank)
    losses = train(model, optim, loader, len(job.first), job.device, world)
    params = sum(p.numel() for p in build_model().parameters())
    units = sum(isinstance(m, FSDP) for m in model.modules())
    job.say(f"  {plural(job.world)}, {params / 1e6:.2f}M parameters in {units} FSDP units, Adam")
    job.say(f"  trained steps {job.first.start}-{job.first.stop - 1} at {plural(job.world)} (global batch {job.batch} "
            f"from a DataLoader with ResumableSampler); loss {losses[-1]:.4f}")  # fmt: skip
    full, tensor_ms = timed_gather(model, optim, "tensor", job.args.repeats, world)
    _, object_ms = timed_gather(model, optim, "object", job.args.repeats, world)
    if full is not None:  # rank 0, the recipient
        job.say(
            f"  gathered the full optimizer state: {_state_bytes(full) / 2**20:.1f} MiB, {len(full['param_names'])} "
            f"parameters; median latency {tensor_ms:.1f} ms (tensor transport) vs {object_ms:.1f} ms "
            f"(broadcast_object_list), {object_ms / tensor_ms:.1f}x"
        )
    start = time.perf_counter()
    # data=: the data position, once for the job; in extra too, for the resume on one process from consolidate's file.
    extra = {"step": job.first.stop, "loss": losses[-1], "data": loader[0].state_dict()}
    save_checkpoint(model, optim, job.checkpoint, extra=extra, data=loader[0])
    files = len(os.listdir(job.checkpoint))
    job.say(
        f"  saved the whole training state (weights, optimizer, step, data position) to {job.checkpoint}: {files} "
        f"files, no rank gathered the model; {1e3 * (time.perf_counter() - start):.0f} ms"
    )
    return losses


def resume_on_fewer_ranks(job: Job) -> tuple[dict, dict, list[float]] | None:
    """Step 3: half the ranks, every 2nd layer its own unit, the same global batch; load_checkpoint re-cuts every
    shard and puts the sampler at the next global batch; train on."""
    resumed_world = max(1, job.world // 2)
    group = dist.new_group(ranks=list(range(resumed_world)))  # collective: every rank creates it
    resumed = None
    if job.rank < resumed_world:
        model = _wrap(build_model().to(job.device), every=2, group=group)
        optim = torch.optim.Adam(model.parameters(), lr=3e-3)
        # Works on any fairscale FSDP root (ours, fairscale's own, a subclass), at any world size and nesting.
        loader = synthetic_loader(job.batch, resumed_world, job.rank)  # per-rank batch job.batch / resumed_world
        extra = load_checkpoint(model, optim, job.checkpoint, data=loader[0])
        if extra["step"] != job.second.start:
            raise RuntimeError(f"expected the checkpoint of step {job.second.start}, found {extra['step']}")
        losses = train(model, optim, loader, len(job.second), job.device, group)
        model_state = model.state_dict()  # a collective: every rank of the group
        gathered = gather_full_optim_state_dict(model, optim)
        if gathered is not None:  # rank 0, the recipient
            resumed = (model_state, gathered, losses)
        job.say(
            f"  resumed at {plural(resumed_world)} (every 2nd layer its own unit) from step {extra['step']}, steps "
            f"{job.second.start}-{job.second.stop - 1}, global batch {job.batch}; loss {losses[-1]:.4f}"
        )
    dist.barrier()
    return resumed


def _verify(job: Job, first: list[float], resumed: tuple[dict, dict, list[float]]) -> bool:
    """Steps 4-5 (rank 0): resume on one process without FSDP; compare both resumes with uninterrupted training."""
    device, steps = job.device, len(job.first) + len(job.second)
    reference = build_model().to(device)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=3e-3)
    expected = train(reference, reference_optim, synthetic_loader(job.batch, 1, 0), steps, device)  # same batches
    whole = consolidate(job.checkpoint)  # offline: {"model": state_dict(), "optimizer": full dict, "extra": ...}

    def resume_plain(with_optimizer: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
        model = build_model().to(device)
        model.load_state_dict(whole["model"])  # strict: every name of the unwrapped model, tied weights included
        optim = torch.optim.Adam(model.parameters(), lr=3e-3)
        if with_optimizer:
            optim.load_state_dict(whole["optimizer"])  # a plain optimizer loads it as is
        loader = synthetic_loader(job.batch, 1, 0)
        loader[0].load_state_dict(whole["extra"]["data"])  # the position, at one rank: the same next global batch
        return model, optim, train(model, optim, loader, len(job.second), device)

    plain, plain_optim, plain_losses = resume_plain(with_optimizer=True)
    control, _, _ = resume_plain(with_optimizer=False)  # negative control: a fresh optimizer must fail the check
    checks = {
        f"resumed at {plural(max(1, job.world // 2))} (FSDP)": (resumed[0], resumed[1]),
        "resumed on 1 process (no FSDP)": (plain.state_dict(), plain_optim.state_dict()),
    }
    ok = True
    for what, (params, optim_state) in checks.items():
        param_diff = max_diff(params, reference.state_dict())
        state_diff = compare_optim(optim_state, reference_optim.state_dict())
        good = param_diff <= job.args.param_tolerance and state_diff <= job.args.state_tolerance
        ok = ok and good
        job.say(
            f"  {what}: max |param diff| {param_diff:.2e}, max |optimizer state diff| {state_diff:.2e} -> "
            f"{'OK' if good else 'MISMATCH'}"
        )
    job.say(
        f"  (control: resuming with a fresh optimizer instead gives max |param diff| "
        f"{max_diff(control.state_dict(), reference.state_dict()):.2e}; bounds: params {job.args.param_tolerance:.0e}, "
        f"state {job.args.state_tolerance:.0e})"
    )
    ok = compare_losses(job, first + resumed[2], plain_losses, expected) and ok
    job.say("continuity verified against uninterrupted training" if ok else "continuity check FAILED")
    return ok


def compare_losses(job: Job, fsdp: list[float], plain: list[float], expected: list[float]) -> bool:
    """Step by step: the loss of every global batch against the uninterrupted run's; the largest relative difference."""
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    second = expected[len(job.first) :]
    runs = {
        f"{plural(job.world)}, then {plural(max(1, job.world // 2))} (FSDP)": [*map(rel, fsdp, expected)],
        "then 1 process (no FSDP)": [*map(rel, plain, second)],
    }
    ok = True
    for what, diffs in runs.items():
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        good = diffs[worst] <= job.args.loss_tolerance
        ok = ok and good
        job.say(
            f"  loss per step, {what}: largest relative difference from the uninterrupted run "
            f"{diffs[worst]:.2e} (step {worst + len(expected) - len(diffs)}) over {len(diffs)} steps -> "
            f"{'OK' if good else 'MISMATCH'}"
        )
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    job = start(argv)
    try:
        first = train_gather_and_save(job)
        resumed = resume_on_fewer_ranks(job)
        box = [_verify(job, first, resumed) if resumed is not None else None]  # rank 0 belongs to the resumed group
        dist.broadcast_object_list(box, src=0)
    finally:
        dist.destroy_process_group()  # every rank is past its last read of job.out
        if job.temporary and job.rank == 0:  # rank 0 made it; --out is the user's to keep
            shutil.rmtree(job.out, ignore_errors=True)
    return 0 if box[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
