"""Real fairseq (``fairseq-fixed==0.12.3.1``) end to end: data, training, resuming, validating, FSDP2.

Every fairseq step runs fairseq's own command-line code in its own process with a timeout, through
``python -m fsdp_optim.fairseq_launch`` (host execution and fairseq's one CPU patch) under ``torchrun``:

- :func:`make_data`: a small synthetic corpus (written here, no download) binarised by ``fairseq-preprocess``;
- :func:`train`: ``fairseq-train`` of a tiny ``transformer_lm`` (two decoder layers, each its own FSDP unit,
  plus the root: three nested units) with ``--ddp-backend fully_sharded --use-sharded-state`` (and, given
  ``whole``, the launcher's ``--fsdp-optim-checkpoints``: our whole checkpoints beside fairseq's); run as this
  file, so that right after fairseq's ``Trainer.load_checkpoint`` each rank records its live model shard
  (``local_state_dict()``) and optimizer state into ``live-<rank>.pt`` (nothing else is changed);
- :func:`validate`: ``fairseq-validate`` of a consolidated checkpoint;
- :func:`plain_model`: fairseq's model built from a consolidated whole checkpoint's saved cfg, unwrapped,
  loading its weights with ``strict=True``, and the fairseq checkpoint file that ``fairseq-validate`` reads;
- :func:`fsdp2_resume`: a rank function for ``run_ranks``: fairseq's model, unwrapped, under FSDP2
  (``fully_shard``) loads a DCP export and checks it against the consolidated checkpoint.
"""

from __future__ import annotations

import functools
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
INSTALL = 'python -m pip install -q "torch==2.13.0" && bash .ci/install-fairseq (docs/migrating.md "With fairseq / metaseq")'
ARCH = [
    "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "2",
    "--decoder-embed-dim", "32", "--decoder-input-dim", "32", "--decoder-output-dim", "32",
    "--decoder-ffn-embed-dim", "60", "--decoder-attention-heads", "2", "--share-decoder-input-output-embed",
    "--tokens-per-sample", "32", "--sample-break-mode", "none", "--max-tokens", "256",
]  # fmt: skip
TRAIN = [
    *ARCH, "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.003", "--lr-scheduler", "inverse_sqrt",
    "--warmup-updates", "5", "--clip-norm", "1.0", "--cpu", "--ddp-backend", "fully_sharded", "--use-sharded-state",
    "--distributed-backend", "gloo", "--min-params-to-wrap", "1", "--num-workers", "0", "--seed", "1",
    "--log-format", "simple", "--log-interval", "5", "--no-epoch-checkpoints", "--save-interval-updates", "10",
    "--validate-interval-updates", "10", "--keep-interval-updates", "-1",
]  # fmt: skip
VALID_LOSS = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+) .*?num_updates (\d+)")
VALID_LOSS_ALONE = re.compile(r"valid on 'valid' subset \| loss ([0-9.]+)")  # fairseq-validate's line
TIMEOUT_S = 240


def run(argv: list[str], log: Path, *, timeout: float = TIMEOUT_S) -> str:
    """Run ``argv`` from the repository root with the tests and the package importable; return its output.
    Raises naming the command and the end of its output when it fails or outlives ``timeout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"{exc.stdout or ''}\n{exc.stderr or ''}")
        raise AssertionError(f"{' '.join(argv)}: still running after {timeout}s (log: {log})") from exc
    text = done.stdout + done.stderr
    log.write_text(text)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {done.returncode} (log: {log})\n{text[-4000:]}")
    return text


def valid_losses(text: str) -> dict[int, str]:
    """``{num_updates: loss}`` of every validation fairseq logged, the loss as printed (3 decimals)."""
    return {int(updates): loss for loss, updates in VALID_LOSS.findall(text)}


def corpus(path: Path, lines: int, seed: int) -> None:
    """Sentences of a small grammar (subject, verb, object with dependencies), learnable in a few updates."""
    rng = random.Random(seed)
    subjects, verbs, objects = ([f"{c}{i}" for i in range(n)] for c, n in (("s", 12), ("v", 10), ("o", 20)))
    with open(path, "w") as f:
        for _ in range(lines):
            s = rng.randrange(len(subjects))
            v = (s + rng.randint(0, 1)) % len(verbs)
            o = (2 * v + rng.randint(0, 2)) % len(objects)
            words = [subjects[s], verbs[v], objects[o], "and", objects[o], verbs[v], subjects[s]]
            f.write(" ".join(words + rng.sample(objects, 2)) + "\n")


def make_data(root: Path) -> Path:
    corpus(root / "train.txt", 1500, seed=1)
    corpus(root / "valid.txt", 150, seed=2)
    data = root / "data-bin"
    argv = ["--only-source", "--trainpref", root / "train.txt", "--validpref", root / "valid.txt"]
    run([sys.executable, "-m", "fairseq_cli.preprocess", *map(str, argv), "--destdir", str(data), "--workers", "1"],
        root / "preprocess.log")  # fmt: skip
    return data


def train(
    data: Path, save_dir: Path, world_size: int, max_update: int, *, restore: Path | None = None,
    whole: Path | None = None,
) -> str:  # fmt: skip
    """fairseq-train at ``world_size`` (torchrun, this file as the launcher) until ``max_update``; its output.
    ``whole``: also our whole checkpoint at each of fairseq's saves, ``whole/step-NNNNNNNN``."""
    argv = [str(data), *TRAIN, "--save-dir", str(save_dir), "--max-update", str(max_update)]
    if restore is not None:
        argv += ["--restore-file", str(restore)]
    if whole is not None:
        argv += ["--fsdp-optim-checkpoints", str(whole)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    log = save_dir.parent / f"{save_dir.name}.log"
    return run([*torchrun, __file__, "train", *argv], log)


def validate(data: Path, checkpoint: Path) -> str:
    argv = [str(data), "--path", str(checkpoint), "--task", "language_modeling", "--cpu", "--max-tokens", "256"]
    argv += ["--tokens-per-sample", "32", "--sample-break-mode", "none", "--num-workers", "0", "--log-format", "simple"]
    return run([sys.executable, "-m", "fsdp_optim.fairseq_launch", "validate", *argv], checkpoint.with_suffix(".log"))


def fsdp_optim(*argv: Any, log: Path) -> str:
    return run([sys.executable, "-m", "fsdp_optim", *map(str, argv)], log)


def plain_model(consolidated: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """From ``fsdp-optim consolidate`` of a whole checkpoint the launcher wrote (``{"model", "optimizer",
    "extra"}``): fairseq's model built by ``task.build_model`` from the cfg in ``extra``, no FSDP, loading
    ``consolidated["model"]`` with ``strict=True``; and that model as the fairseq checkpoint file
    ``checkpoint_utils.load_model_ensemble_and_task`` reads (``cfg``, ``model``, and the ``optimizer_history`` /
    ``extra_state`` its upgrade step requires; no optimizer state, which validating does not read)."""
    from fairseq import tasks
    from omegaconf import OmegaConf

    extra = consolidated["extra"]
    cfg = OmegaConf.create(extra["cfg"])
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    model.load_state_dict(consolidated["model"], strict=True)
    history = {"criterion_name": "CrossEntropyCriterion", "optimizer_name": extra["optimizer"],
               "lr_scheduler_state": extra["lr_scheduler"], "num_updates": extra["num_updates"]}  # fmt: skip
    state = {"train_iterator": extra["train_iterator"], "val_loss": extra["val_loss"], "epoch": extra["epoch"]}
    return model, {"cfg": extra["cfg"], "model": model.state_dict(), "optimizer_history": [history],
                   "extra_state": state}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Inside fairseq-train: record the live state right after fairseq loaded a checkpoint


def _record_loads() -> None:
    from fairseq.trainer import Trainer

    load_checkpoint = Trainer.load_checkpoint

    def recording(self: Any, filename: str, *args: Any, **kwargs: Any) -> Any:
        extra = load_checkpoint(self, filename, *args, **kwargs)
        if extra is not None:  # a checkpoint was loaded: what the job now holds, before any update
            live = {"model": self.model.local_state_dict(), "optim": self.optimizer.state_dict()}
            torch.save(live, Path(self.cfg.checkpoint.save_dir) / f"live-{self.data_parallel_rank}.pt")
        return extra

    Trainer.load_checkpoint = recording


# ---------------------------------------------------------------------------------------------------
# FSDP2 resume from the DCP export (a run_ranks rank function)


def _plain_model(consolidated: Path) -> torch.nn.Module:
    """fairseq's own model for the consolidated checkpoint, unwrapped, its weights set to other values."""
    from fairseq import checkpoint_utils

    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(consolidated)])
    model = models[0]
    # fairseq's models override load_state_dict without torch's `assign`, which set_state_dict passes.
    model.load_state_dict = functools.partial(torch.nn.Module.load_state_dict, model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # the load must overwrite every parameter
    return model


def fsdp2_resume(rank: int, world_size: int, consolidated: Path, dcp_dir: Path) -> dict[str, Any]:
    """Load the DCP export into fairseq's model under FSDP2 and AdamW; compare with the consolidated file;
    take one training step. Returns rank 0's comparison counts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _plain_model(consolidated)
    for layer in model.decoder.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.001)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd}  # convert --to dcp's keys
    # fairseq's Adam has no foreach, maximize, ...: keep the loader's values for those (README).
    dcp.load(state, checkpoint_id=str(dcp_dir), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim_full = get_state_dict(model, optim, options=full)
    expected = torch.load(consolidated, map_location="cpu", weights_only=False)
    checked = _compare(weights, optim_full, expected) if rank == 0 else {}
    tokens = torch.randint(4, 40, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(tokens)[0].float().mean().backward()
    optim.step()  # the resumed job trains on
    return checked


def _compare(weights: dict, optim_full: dict, expected: dict) -> dict[str, Any]:
    """Every weight and every optimizer state of the FSDP2 job equals the consolidated checkpoint's."""
    for name, value in weights.items():
        assert torch.equal(value, expected["model"][name]), f"FSDP2 model: {name} differs from the consolidated"
    ours = expected["last_optimizer_state"]
    by_name = {ours["param_names"][pid]: entries for pid, entries in ours["state"].items()}
    for name, entries in optim_full["state"].items():
        for key, value in entries.items():
            want = by_name[name][key]
            assert torch.equal(torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)) \
                if key == "step" else torch.equal(value, want), f"FSDP2 optimizer: {name} {key} differs"
    return {"weights": len(weights), "optim_params": len(optim_full["state"])}


if __name__ == "__main__":  # fairseq-train / fairseq-validate under torchrun, recording what each load gives
    from fsdp_optim import fairseq_launch

    _record_loads()
    fairseq_launch.main()
