"""The words of ``consolidate`` and ``reshard``'s ``wrote <output>: ...`` line: what an opened input's write
returned (:mod:`fsdp_optim.offline.opened.written`), said for a person."""

from __future__ import annotations

from fsdp_optim.disk.text import human_bytes
from fsdp_optim.offline.opened.written import (
    Consolidation,
    FairseqCheckpoint,
    FullDictFile,
    Resharding,
    ShardFiles,
    WholeFileWritten,
)


def consolidated_words(done: Consolidation) -> str:
    """What ``consolidate`` wrote, after ``wrote <output>: ``."""
    if isinstance(done, FullDictFile):
        return f"{done.params} params, {done.with_state} with state, {human_bytes(done.size)}"
    if isinstance(done, WholeFileWritten):
        optim = ("none (saved with optim=None)" if done.optimizer_params is None
                 else f"{done.optimizer_params} params with state")  # fmt: skip
        return (
            f"{{'model', 'optimizer', 'extra'}}: model {done.params} params ({human_bytes(done.param_bytes)}), "
            f"{_count(done.tied_names, 'tied name')}, {_count(done.buffers, 'buffer')}; "
            f"optimizer {optim}; extra of rank {done.rank}; {human_bytes(done.size)}"
        )
    if isinstance(done, FairseqCheckpoint):
        model = "" if done.model_tensors is None else f", model: {done.model_tensors} tensors"
        return (
            f"a consolidated fairseq checkpoint ({', '.join(done.keys)}); {done.optim_key}: "
            f"{done.params} params, {done.with_state} with state{model}; {human_bytes(done.size)}"
        )
    what = "the optimizer's full dict" if done.optimizer_only else "{'model', 'optimizer', 'extra'}"
    return f"{what} of {done.label}, {human_bytes(done.size)}"


def resharded_words(done: Resharding) -> str:
    """What ``reshard`` wrote, after ``wrote <out>: ``."""
    if isinstance(done, ShardFiles):
        return f"{len(done.names)} shard files {done.names[0]} .. {done.names[-1]}, {human_bytes(done.size)}"
    line = f"{done.rank_files} rank files, {human_bytes(done.rank_bytes)}"
    if done.side_files is not None:  # a whole checkpoint: weights in the rank files, side files carried
        line += f" (weights included), {done.side_files} side files, {human_bytes(done.side_bytes)}"
    return line


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
