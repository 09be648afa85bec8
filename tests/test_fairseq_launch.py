"""``python -m fsdp_optim.fairseq_launch``: the arguments it hands fairseq under ``torchrun`` and the flag it takes
out of them. Pure: no process is started (the real run under torchrun is ``tests/test_fairseq_real.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def test_launcher_passes_torchrun_environment_to_fairseq() -> None:
    from fsdp_optim.fairseq_launch import distributed_args, main

    env = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert distributed_args(["data-bin", "--cpu"], env) == [
        "data-bin", "--cpu", "--distributed-init-method", "env://", "--distributed-rank", "1",
        "--distributed-world-size", "3", "--distributed-no-spawn",
    ]  # fmt: skip
    assert distributed_args(["data-bin"], {"RANK": "0"}) == ["data-bin"]  # not under torchrun: fairseq decides
    given = ["data-bin", "--distributed-init-method", "tcp://h:1"]
    assert distributed_args(given, env) == given  # the caller's own settings win
    with pytest.raises(SystemExit, match=r"\{train,validate\} FAIRSEQ_ARGS.*found \['generate'\]"):
        main(["generate", "data-bin"])


def test_launcher_takes_its_checkpoint_flag_out_of_fairseqs_arguments() -> None:
    from fsdp_optim.fairseq_launch import checkpoints_arg, plain_json

    assert checkpoints_arg(["data-bin", "--cpu"]) == (["data-bin", "--cpu"], None)
    for given in (["data-bin", "--fsdp-optim-checkpoints", "ours", "--cpu"], ["data-bin", "--fsdp-optim-checkpoints=ours", "--cpu"]):
        assert checkpoints_arg(given) == (["data-bin", "--cpu"], Path("ours"))
    with pytest.raises(SystemExit, match=r"expected a directory, found --cpu"):
        checkpoints_arg(["--fsdp-optim-checkpoints", "--cpu"])
    with pytest.raises(SystemExit, match=r"expected once, found 2 times"):
        checkpoints_arg(["--fsdp-optim-checkpoints", "a", "--fsdp-optim-checkpoints=b"])
    assert plain_json({"betas": (0.9, 0.98), 1: float("inf"), "n": None, "enum": Path("x")}) == {
        "betas": [0.9, 0.98], "1": "inf", "n": None, "enum": "x"}  # fmt: skip
    assert plain_json(torch.tensor(2.5)) == 2.5
