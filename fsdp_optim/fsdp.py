"""``fsdp_optim.FullyShardedDataParallel``: fairscale's FSDP that runs on CPU and has portable optimizer state.

Orchestration only: the layout comes from :mod:`.layout`, the maths from :mod:`.flatten` and
:mod:`.fullstate`, the bytes move through :mod:`.transport`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Literal

import torch
from fairscale.nn import FullyShardedDataParallel as _FairscaleFSDP

from . import _host
from .fullstate import build_full_state, saved_optimizer, shard_full_state
from .layout import describe
from .local import LocalState, check_agreement, check_optimizer, live_groups, read_local_state, summary_digest
from .transport import Transfer, all_gather_digests, all_gather_objects, broadcast_from_each_rank, gather_flat_tensors
from .flatten import StateKind, assemble

__all__ = ["FullyShardedDataParallel"]

_FAIRSCALE_PARAMS = inspect.signature(_FairscaleFSDP.__init__)


class FullyShardedDataParallel(_FairscaleFSDP):
    """fairscale's ``FullyShardedDataParallel`` with the same constructor, plus:

    - it runs without CUDA: with the module on CPU and a gloo process group, ``compute_device`` defaults
      to the CPU and fairscale's stream calls become no-ops (see :mod:`fsdp_optim._host`); with CUDA
      present nothing changes;
    - :meth:`gather_full_optim_state_dict` and :meth:`get_shard_from_optim_state_dict` move optimizer
      state between this sharded form and one full, world-size-independent dict.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            _host.enable()
            bound = _FAIRSCALE_PARAMS.bind_partial(None, module, *args, **kwargs).arguments
            if bound.get("compute_device") is None:
                kwargs["compute_device"] = torch.device("cpu")
        super().__init__(module, *args, **kwargs)

    def _setup_streams(self) -> None:
        super()._setup_streams()
        if _host.is_enabled() and self._is_root and not self._streams:
            # The dict is shared with every child instance, so filling it in place reaches them too.
            for name in ("fp32_to_fp16", "all_gather", "post_backward"):
                self._streams[name] = _host.new_stream()

    # -- optimizer state ---------------------------------------------------------------------------

    def gather_full_optim_state_dict(
        self,
        optim: torch.optim.Optimizer,
        *,
        recipient_rank: int | None = 0,
        transport: Literal["tensor", "object"] = "tensor",
    ) -> dict[str, Any] | None:
        """Collect the sharded optimizer state into one full dict, in terms of the unwrapped model.

        A collective over this instance's process group: every rank must call it. Call it on the root
        instance, with the optimizer built over its ``parameters()``; no forward pass is needed.

        Args:
            optim: the sharded optimizer. Read only: neither it nor its state is modified.
            recipient_rank: rank (in this instance's process group) that receives the dict; ``None`` for
                every rank.
            transport: ``"tensor"`` (default) sends each rank's real shard elements once, point to
                point, into fresh memory on the recipient; ranks other than the recipient allocate
                nothing. ``"object"`` pickles each rank's shards with one ``broadcast_object_list`` per
                rank, so every rank receives everything (slower; kept for comparison).

        Returns:
            On the recipient(s) the full dict (all tensors on CPU; format in :mod:`fsdp_optim.fullstate`)::

                {"state": {id: {"step": tensor(7.), "exp_avg": Tensor[*shape], ...}},
                 "param_groups": [{"lr": ..., "params": [ids]}],
                 "param_names": {id: "fully.qualified.name"},
                 "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": W, "scalar_keys": [...]}}

            ``None`` on other ranks.

        Cost (``"tensor"``): one all-gather of an 8-byte digest of each rank's state summary (the
        summaries themselves only if ranks disagree), then one message per (flat parameter, tensor state
        key, rank holding real elements), carrying the state's bytes once, and a final barrier.
        """
        world_size = self.world_size
        if recipient_rank is not None and not (isinstance(recipient_rank, int) and 0 <= recipient_rank < world_size):
            raise ValueError(f"recipient_rank: expected None or an int in [0, {world_size}), found {recipient_rank!r}")
        if transport not in ("tensor", "object"):
            raise ValueError(f"transport: expected 'tensor' or 'object', found {transport!r}")
        if self._is_root is False:
            raise ValueError("gather_full_optim_state_dict must be called on the root FSDP instance")
        layout, params = describe(self)
        layout.check_world_sizes()
        local = read_local_state(layout, params, optim.state_dict(), optim.param_groups)

        if transport == "object":
            received = broadcast_from_each_rank((local.summary, _shards(local)), self.process_group)
            check_agreement(layout, [summary for summary, _ in received])
            if recipient_rank is not None and self.rank != recipient_rank:
                return None
            flat_tensors = _assemble_objects(layout, local, [shards for _, shards in received])
        else:
            if world_size > 1:
                digests = all_gather_digests(summary_digest(local.summary), self.process_group)
                if len(set(digests)) > 1:  # only then pay for the full summaries, to say what differs
                    check_agreement(layout, all_gather_objects(local.summary, self.process_group))
            transfers, keys = _transfers(layout, local)
            gathered = gather_flat_tensors(transfers, recipient=recipient_rank, group=self.process_group)
            if gathered is None:
                return None
            flat_tensors = dict(zip(keys, gathered))

        flat_states = {
            i: {
                key: flat_tensors[(i, key)] if kind is StateKind.SHARDED else local.state[i][key]
                for key, kind, _ in local.summary[i]
            }
            for i in local.state
        }
        return build_full_state(layout, local.groups, flat_states, optimizer=type(optim).__name__)

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], *, optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """This rank's piece of a full dict, ready for ``optim.load_state_dict``. Local: no collective.

        Works at any world size and any wrapping of the same model: the full dict names parameters by
        their unwrapped names. Before cutting, it checks that every parameter is present with the
        right shape and dtype, that no param group splits a flat parameter, that nested units are
        sharded like the root (or not at all), and raises ``ValueError`` naming the parameter with
        what was expected and what was found. The input is never modified; every returned tensor is new.

        Args:
            full_optim_state_dict: from :meth:`gather_full_optim_state_dict`, or a plain optimizer's
                ``state_dict()`` with a ``"param_names"`` map added.
            optim: the sharded optimizer it will be loaded into. When given, param ids follow its
                param groups' order and its group membership is checked against the dict's; otherwise
                the ids follow ``self.parameters()`` order within each of the dict's groups.

        Returns ``{"state": {local_id: {key: padded shard or scalar}}, "param_groups": [...]}``.
        """
        layout, params = describe(self)
        position = {id(p): i for i, p in enumerate(self.parameters())}
        groups = None
        if optim is not None:
            if isinstance(full_optim_state_dict, Mapping):
                check_optimizer(saved_optimizer(full_optim_state_dict), optim, "the full optimizer state dict")
            groups = live_groups(optim, params)
        return shard_full_state(
            layout,
            full_optim_state_dict,
            live_groups=groups,
            param_positions=[position.get(id(p), len(position)) for p in params],
            trainable=[p.requires_grad for p in params],
        )


def _transfers(layout: Any, local: LocalState) -> tuple[list[Transfer], list[tuple[int, str]]]:
    transfers, keys = [], []
    for i in sorted(local.state):
        flat = layout.flat_params[i]
        bounds = tuple(flat.bounds(r) for r in range(flat.world_size))
        for key, kind, dtype in local.summary[i]:
            if kind is StateKind.SHARDED:
                transfers.append(Transfer(flat.numel, dtype, bounds, local.state[i][key].detach()))
                keys.append((i, key))
    return transfers, keys


def _shards(local: LocalState) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, key): local.state[i][key].detach()
        for i, entries in local.summary.items()
        for key, kind, _ in entries
        if kind is StateKind.SHARDED
    }


def _assemble_objects(
    layout: Any, local: LocalState, per_rank: list[dict[tuple[int, str], torch.Tensor]]
) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for (i, key), own in _shards(local).items():
        flat = layout.flat_params[i]
        if flat.world_size == 1:
            out[(i, key)] = own[: flat.numel].to("cpu", copy=True)
        else:
            out[(i, key)] = assemble(flat, [shards[(i, key)] for shards in per_rank])
    return out
