"""Pure rules of the memory tier: where replicas go, which step the surviving nodes hold whole, who sends what.

A job's ranks sit on nodes (``nodes[r]``: rank r's node name). Nodes are ordered by their first rank; rank ``r``,
the ``i``-th rank of node ``a``, replicates its files to the ``i``-th rank (modulo that node's size) of nodes
``a+1 .. a+replicas`` (modulo the node count)::

    nodes = ["0", "0", "1", "1", "2", "2"], replicas = 1
    replica_peers(nodes, 1) == ((2,), (3,), (4,), (5,), (0,), (1,))

After a failure, each live rank reports what its node holds (:class:`Holding` per complete step); a step is
restorable when every one of its files is held by the node of at least one live rank. Every rank computes the
same answer from the same all-gathered reports: no further agreement is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Chosen", "Fetch", "Holding", "choose_step", "fetch_plan", "node_ranks", "replica_peers", "sources_of"]


@dataclass(frozen=True)
class Holding:
    """One complete step in one node's memory: the step's files (``{name: bytes}``, every rank and side file of
    the save) and those of them this node holds, each present with its recorded size."""

    step: int
    save_id: str
    dirname: str  # the step directory's name inside the node directory
    world_size: int  # the saved world size
    files: tuple[tuple[str, int], ...]  # (name, bytes) of every file of the step, sorted
    held: frozenset[str]


@dataclass(frozen=True)
class Chosen:
    """The step every rank restores: its files and, per file, the live ranks whose node holds it."""

    step: int
    save_id: str
    dirname: str
    world_size: int
    files: tuple[tuple[str, int], ...]
    holders: tuple[tuple[str, tuple[int, ...]], ...]  # (file name, live ranks whose node holds it), sorted

    def holder_ranks(self) -> dict[str, tuple[int, ...]]:
        return dict(self.holders)


@dataclass(frozen=True)
class Fetch:
    """Bytes ``[start, stop)`` of one file sent point to point: from ``src`` (its node holds the file) to ``dst``
    (its node lacks it; it reads them from memory, verifying each chunk as it reads it)."""

    src: int
    dst: int
    file: str
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def node_ranks(nodes: Sequence[str]) -> dict[str, list[int]]:
    """``{node: its ranks, ascending}``, nodes in order of their first rank (dicts keep insertion order)."""
    out: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        out.setdefault(node, []).append(rank)
    return out


def replica_peers(nodes: Sequence[str], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the ranks (on other nodes) that keep a replica of its files; at most ``node count - 1`` each."""
    by_node = node_ranks(nodes)
    order = list(by_node)
    copies = min(replicas, len(order) - 1)
    peers = []
    for rank, node in enumerate(nodes):
        a, i = order.index(node), by_node[node].index(rank)
        targets = (by_node[order[(a + k) % len(order)]] for k in range(1, copies + 1))
        peers.append(tuple(t[i % len(t)] for t in targets))
    return tuple(peers)


def sources_of(peers: Sequence[Sequence[int]], rank: int) -> tuple[int, ...]:
    """The ranks whose replicas ``rank`` receives, ascending (the order both sides post their messages in)."""
    return tuple(src for src, targets in enumerate(peers) if rank in targets)


def choose_step(holdings: Sequence[Sequence[Holding]]) -> Chosen | None:
    """The newest step (then the greatest save id) whose every file some live rank's node holds; None if none.

    ``holdings[r]``: what live rank r's node holds (the ranks of one node report the same)."""
    union: dict[tuple[int, str], set[str]] = {}
    first: dict[tuple[int, str], Holding] = {}
    for report in holdings:
        for h in report:
            union.setdefault((h.step, h.save_id), set()).update(h.held)
            first.setdefault((h.step, h.save_id), h)
    whole = [key for key, held in union.items() if {name for name, _ in first[key].files} <= held]
    if not whole:
        return None
    h = first[max(whole)]
    holders = {name: tuple(r for r, rep in enumerate(holdings) if _holds(rep, h, name)) for name, _ in h.files}
    return Chosen(h.step, h.save_id, h.dirname, h.world_size, h.files, tuple(sorted(holders.items())))


def _holds(report: Sequence[Holding], chosen: Holding, name: str) -> bool:
    return any(h.step == chosen.step and h.save_id == chosen.save_id and name in h.held for h in report)


def fetch_plan(
    chosen: Chosen,
    nodes: Sequence[str],
    needs: Sequence[Sequence[tuple[str, int, int]]],
    has: Mapping[str, frozenset[str]],
) -> tuple[Fetch, ...]:
    """The byte ranges to send so that every rank r gets what its load reads: of ``needs[r]`` (``(file, start,
    stop)`` in the order its load uses them, from its plans), those of files its node lacks (``has[node]``: the
    files of the step that node holds).

    Each range comes from the holder rank with the fewest bytes to move so far (those it receives, those it was
    given to send; then the lowest rank), so the ranks of the nodes holding a file share its sending, and a rank
    that receives much sends little. Listed by receiving rank, then in its order of use: the order in which both
    sides post their messages. Every rank computes the same plan from the same inputs, with no message."""
    holders = chosen.holder_ranks()
    missing = [[(n, a, b) for n, a, b in ranges if n not in has.get(nodes[dst], frozenset())]
               for dst, ranges in enumerate(needs)]  # fmt: skip
    moved = {dst: sum(b - a for _, a, b in ranges) for dst, ranges in enumerate(missing)}
    out = []
    for dst, ranges in enumerate(missing):
        for name, start, stop in ranges:
            if not holders.get(name):
                raise ValueError(f"{name}: rank {dst} needs it, but no live rank's node holds it (holders: none)")
            src = min(holders[name], key=lambda r: (moved.get(r, 0), r))
            moved[src] = moved.get(src, 0) + stop - start
            out.append(Fetch(src, dst, name, start, stop))
    return tuple(out)
