"""The walk over objects a file or a caller hands over: bounded (depth, references), iterative, refusing cycles;
every tensor strided, dense, inside its storage, of an allowed dtype; a state dict's skeleton typed (ids, keys,
param groups). In-memory dicts may share memory and hold views; files may not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.dtypes import ALLOWED_DTYPES
from fsdp_optim.core.limits import MAX_DEPTH, MAX_NODES
from fsdp_optim.disk.text import escape


def _show_path(where: str, path: tuple[Any, ...]) -> str:
    return where + "".join(f"[{escape(repr(k), limit=60)}]" for k in path)



_CONTAINERS = frozenset({dict, list, tuple})



_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})



_LEAVES = frozenset({int, float, str, bool, type(None), torch.Tensor, torch.nn.Parameter})



@dataclass
class _Tensor:
    tensor: torch.Tensor
    path: tuple[Any, ...]
    references: int = 1
    tied: int = 0  # further references as other names of the ``tied`` dict (see :func:`check_tree`)



def check_tree(
    obj: Any,
    where: str,
    *,
    disjoint: bool = True,
    in_memory: bool = False,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
    tied: str | None = None,
    shared: bool = False,
) -> list[torch.Tensor]:
    """Walk ``obj`` once (see the module docstring) and check every tensor; return the distinct tensors.
    Raises ``ValueError`` naming the place.

    ``disjoint``: also refuse multi-element tensors that share memory. Views of one buffer that overlap
    would let a small file stand for many times its size (every view read or copied in turn); readers
    check it once they know the file is theirs (a model's ``state_dict`` with tied weights is not).

    ``in_memory``: ``obj`` is what a caller holds, not what a file declares. Views (transposed, strided,
    expanded) and tensors shared or referenced twice cost nothing to read and are accepted (readers copy
    where needed); only each tensor's kind is checked (dtype, layout, not meta, not a subclass).

    ``tied``: a top-level key whose dict may name one tensor more than once (a model's ``state_dict()`` with tied
    parameters, as consolidate writes it); the reader takes such a tensor once, under its first name.

    ``shared``: accept, for now, tensors referenced more than once or sharing memory (every other check holds): a
    reader that must first say what a file is (a model's ``state_dict()`` with tied weights is "not a checkpoint",
    not "shares memory") walks it again without ``shared`` once it knows the file is one of ours.
    """
    tensors = _Walk(where, max_depth, max_nodes, tied).run(obj)
    for seen in tensors.values():  # where a tensor is, is spelled out only for an error
        problem = _kind_problem(seen.tensor) or (None if in_memory else _layout_problem(seen.tensor))
        if problem is None and not (in_memory or shared) and seen.references > 1 and seen.tensor.numel() > 1:
            problem = f"one tensor of {seen.tensor.numel()} elements referenced {seen.references} times"
        if problem is not None:
            raise ValueError(f"{_show_path(where, seen.path)}: {problem}")
    if disjoint and not (in_memory or shared):
        _check_disjoint(list(tensors.values()), where)
    return [seen.tensor for seen in tensors.values()]



class _Walk:
    """One iterative, memoized, bounded walk of a loaded object (no recursion: depth is data here)."""

    def __init__(self, where: str, max_depth: int, max_nodes: int, tied: str | None = None) -> None:
        self.where, self.max_depth, self.max_nodes, self.tied = where, max_depth, max_nodes, tied
        self.sizes: dict[int, int] = {}  # id -> references under it (itself included), for finished containers
        self.tensors: dict[int, _Tensor] = {}
        self.open_ids: set[int] = set()
        self.total = 0
        # Frames: [container, its path, iterator over (key, child), references so far]
        self.stack: list[list[Any]] = []

    def run(self, obj: Any) -> dict[int, _Tensor]:
        if self.visit(obj, ()) is None:
            self.enter(obj, ())
            self.add(1)
        while self.stack:
            frame = self.stack[-1]
            node, path, items, _ = frame
            step = next(items, None)
            if step is None:
                self.stack.pop()
                self.open_ids.discard(id(node))
                self.sizes[id(node)] = frame[3]
                if self.stack:
                    self.stack[-1][3] += frame[3]
                continue
            key, child = step
            if isinstance(node, Mapping) and self.visit(key, (*path, key)) is None:
                raise ValueError(f"{_show_path(self.where, path)}: has a container as a key")
            counted = self.visit(child, (*path, key))
            if counted is None:
                self.add(1)
                self.enter(child, (*path, key))
            else:
                self.add(counted)  # a shared container counts all its references again, without a second walk
                frame[3] += counted
        return self.tensors

    def visit(self, node: Any, path: tuple[Any, ...]) -> int | None:
        """Count a leaf or a memoized container; ``None`` for a container to descend into."""
        kind = type(node)
        if kind in _CONTAINERS or (kind not in _LEAVES and isinstance(node, (Mapping, list, tuple, set, frozenset))):
            key = id(node)
            if key in self.open_ids:
                raise ValueError(f"{_show_path(self.where, path)}: a container that contains itself (a cycle)")
            if key in self.sizes:
                return self.sizes[key]
            if len(path) >= self.max_depth:
                raise ValueError(f"{_show_path(self.where, path)}: nested deeper than {self.max_depth} levels")
            return None
        if kind in _TENSORS or (kind not in _LEAVES and torch.is_tensor(node)):
            seen = self.tensors.get(id(node))
            if seen is None:
                self.tensors[id(node)] = _Tensor(node, path)
            elif self._tied(seen.path) and self._tied(path):
                seen.tied += 1
            else:
                seen.references += 1
        elif isinstance(node, int) and not isinstance(node, bool) and not -(1 << 63) <= node < (1 << 64):
            raise ValueError(f"{_show_path(self.where, path)}: an integer of {node.bit_length()} bits")
        return 1

    def _tied(self, path: tuple[Any, ...]) -> bool:
        return self.tied is not None and len(path) == 2 and path[0] == self.tied and isinstance(path[1], str)

    def enter(self, node: Any, path: tuple[Any, ...]) -> None:
        self.open_ids.add(id(node))
        if isinstance(node, Mapping):
            items: Iterator[tuple[Any, Any]] = ((k, v) for k, v in node.items())
        elif isinstance(node, (set, frozenset)):
            items = ((None, v) for v in node)
        else:
            items = enumerate(node)
        self.stack.append([node, path, items, 1])

    def add(self, count: int) -> None:
        self.total += count
        if self.total > self.max_nodes:
            raise ValueError(
                f"{self.where}: holds more than {self.max_nodes} objects counting every reference (shared objects "
                "once per reference); the bound is fsdp_optim.core.limits.MAX_NODES"
            )



def _kind_problem(t: torch.Tensor) -> str | None:
    if type(t) not in _TENSORS:
        return f"a tensor subclass ({type(t).__name__}), expected a plain tensor"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}), expected a plain tensor of real numbers"
    if t.layout is not torch.strided:
        return f"a sparse tensor (layout {t.layout}), expected a dense (strided) tensor"
    if t.is_nested:
        return "a nested tensor, expected a dense tensor"
    if t.is_meta:
        return f"a meta tensor (a shape {tuple(t.shape)} without data)"
    if t.dtype not in ALLOWED_DTYPES:
        kind = "complex" if t.dtype.is_complex else "unsupported"
        return f"a {kind} tensor ({t.dtype}); optimizer state here is real numbers"
    return None



def _layout_problem(t: torch.Tensor) -> str | None:
    numel = t.numel()
    if numel <= 1:
        return None if numel == 0 or t.storage_offset() * t.element_size() < t.untyped_storage().nbytes() else (
            f"its element at offset {t.storage_offset()} lies outside its storage"
        )
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride != expected:
            return (
                f"declares shape {tuple(t.shape)} with strides {tuple(t.stride())} over "
                f"{t.untyped_storage().nbytes()} bytes of storage; expected a dense, non-overlapping tensor "
                f"({'a zero stride repeats elements' if stride == 0 else 'its elements overlap or leave gaps'})"
            )
        expected *= size
    nbytes = t.untyped_storage().nbytes()
    if (t.storage_offset() + numel) * t.element_size() > nbytes:
        return f"{numel} elements at offset {t.storage_offset()} lie outside its storage of {nbytes} bytes"
    return None



def _check_disjoint(tensors: list[_Tensor], where: str) -> None:
    """Refuse two multi-element tensors sharing memory (views of one buffer must not overlap)."""
    spans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for n, seen in enumerate(tensors):
        t = seen.tensor
        if t.numel() > 1:
            start = int(t.storage_offset()) * t.element_size()
            key = (str(t.device), t.untyped_storage().data_ptr())
            spans.setdefault(key, []).append((start, start + int(t.numel()) * t.element_size(), n))
    for runs in spans.values():
        runs.sort()
        for (_, stop, a), (start, _, b) in zip(runs, runs[1:]):
            if start < stop:
                raise ValueError(
                    f"{_show_path(where, tensors[b].path)}: shares memory with {_show_path(where, tensors[a].path)}; "
                    "tensors of optimizer state must not overlap"
                )



def check_state_dict(obj: object, where: str, *, in_memory: bool = False) -> None:
    """:func:`check_tree` plus the skeleton of an optimizer state dict (ours, a plain optimizer's or
    fairscale's), for the keys present: ``state`` maps ids (ints or strings) to dicts keyed by strings,
    ``param_groups`` is a list of dicts keyed by strings whose ``params`` lists ids, ``param_names`` and
    ``param_id_map`` map ids, ``uncollected_local_ids`` is a list. What the values mean is the engine's job.
    ``in_memory``: a dict the caller holds (see :func:`check_tree`); a file's went through the gate already."""
    check_tree(obj, where, in_memory=in_memory)
    if not isinstance(obj, Mapping):
        return
    for key, kind in (("state", Mapping), ("param_groups", (list, tuple)), ("param_names", Mapping),
                      ("param_id_map", Mapping), ("uncollected_local_ids", (list, tuple))):  # fmt: skip
        if key in obj and not isinstance(obj[key], kind):
            expected = "a dict" if kind is Mapping else "a list"
            raise ValueError(f"{where}['{key}']: a {type(obj[key]).__name__}, expected {expected}")
    for pid, entries in obj.get("state", {}).items():
        _check_id(pid, f"{where}['state']")
        if not isinstance(entries, Mapping) or not all(type(key) is str for key in entries):
            here = f"{where}['state'][{escape(repr(pid), limit=60)}]"
            if not isinstance(entries, Mapping):
                raise ValueError(f"{here}: a {type(entries).__name__}, expected a dict of state keys")
            _check_keys(entries, here)
    for key in ("param_names", "param_id_map"):
        for pid in obj.get(key, {}):
            _check_id(pid, f"{where}['{key}']")
    for k, group in enumerate(obj.get("param_groups", ())):
        here = f"{where}['param_groups'][{k}]"
        if not isinstance(group, Mapping):
            raise ValueError(f"{here}: a {type(group).__name__}, expected a dict")
        _check_keys(group, here)
        params = group.get("params")
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"{here}['params']: a {type(params).__name__}, expected a list of ids")
        for pid in params:
            _check_id(pid, f"{here}['params']")



def _check_id(pid: object, where: str) -> None:
    if type(pid) is not int and (not isinstance(pid, (int, str)) or isinstance(pid, bool)):
        raise ValueError(
            f"{where}: parameter id {escape(repr(pid), limit=80)} is a {type(pid).__name__}, expected an int"
        )



def _check_keys(d: Mapping[Any, Any], where: str) -> None:
    for key in d:
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {escape(repr(key), limit=80)} is a {type(key).__name__}, expected a string")
