"""Exact JSON form of the values a manifest holds (hyperparameters, scalar states): what makes ``manifest.json``
lossless.

Pure: no file access. :func:`to_json` turns a :meth:`Manifest.to_dict` tree into JSON-safe values and
:func:`from_json` turns them back into the very same tree (types included), so ``Manifest.to_dict/from_dict``
stays the one schema for both formats. Plain JSON covers ``None``, ``bool``, ``int``, ``str``, lists, dicts
with ``str`` keys and finite ``float`` (``json`` writes ``repr(float)``, which reads back bit-exactly).
Everything else is an object with one reserved key::

    (0.9, 0.999)            -> {"$tuple": [0.9, 0.999]}
    float("inf")            -> {"$float": "inf"}                  # also "-inf", "nan"
    complex(1, 2)           -> {"$complex": [1.0, 2.0]}
    tensor(3.)              -> {"$tensor": {"dtype": "float32", "shape": [], "hex": "00004040"}}  # raw little-endian
    {"$x": 1}               -> {"$dict": {"$x": 1}}               # a dict whose keys look reserved

Anything else (a tensor of another kind, a dict keyed by non-strings, an object) is refused with a
``ValueError`` naming where it is and what it is. Tensors are stored up to :data:`MAX_TENSOR_BYTES`:
hyperparameters and scalar states are small; shard-sized state belongs in the rank files.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.disk.text import escape

__all__ = ["MAX_TENSOR_BYTES", "from_json", "to_json"]

MAX_TENSOR_BYTES = 4096
_TAGS = ("$tuple", "$float", "$complex", "$tensor", "$dict")


def to_json(value: Any, where: str) -> Any:
    """``value`` as JSON-safe values (see the module docstring); ``where`` names it in errors."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, complex):
        return {"$complex": [to_json(value.real, where), to_json(value.imag, where)]}
    if isinstance(value, tuple):
        return {"$tuple": [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            bad = next(k for k in value if not isinstance(k, str))
            raise ValueError(
                f"{where}: a dict keyed by {type(bad).__name__} ({bad!r}); a JSON manifest holds str keys "
                "only"
            )
        out = {k: to_json(v, f"{where}['{k}']") for k, v in value.items()}
        return {"$dict": out} if any(k.startswith("$") for k in value) else out
    if torch.is_tensor(value):
        return {"$tensor": _tensor_to_json(value, where)}
    raise ValueError(
        f"{where}: a {type(value).__name__}, which a JSON manifest cannot hold exactly; expected None, bool, int, "
        "float, complex, str, a small dense CPU tensor, or lists/tuples/dicts of them"
    )


def _tensor_to_json(t: torch.Tensor, where: str) -> dict[str, Any]:
    t = t.detach().cpu()
    if t.layout is not torch.strided or t.is_quantized or t.is_complex() or t.is_meta:
        raise ValueError(f"{where}: a {t.layout} {t.dtype} tensor; a JSON manifest holds dense real tensors only")
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"{where}: a tensor of {nbytes} bytes; a JSON manifest holds tensors up to {MAX_TENSOR_BYTES} "
            "bytes"
        )
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1).reshape(-1)
    return {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "hex": bytes(raw.tolist()).hex()}


def from_json(value: Any, where: str) -> Any:
    """The value :func:`to_json` was given, from what ``json.loads`` read (checked: a crafted file is refused)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [from_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON value, found {type(value).__name__}")
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: from_json(v, f"{where}['{k}']") for k, v in value.items()}
    if len(value) != 1 or tags[0] not in _TAGS:
        raise ValueError(
            f"{where}: expected one of the tags {list(_TAGS)} alone in an object, found keys "
            f"{sorted(value)[:5]}"
        )
    tag, body = tags[0], value[tags[0]]
    if tag == "$dict":
        if not isinstance(body, dict):
            raise ValueError(f"{where}: '$dict' holds a {type(body).__name__}, expected an object")
        return {k: from_json(v, f"{where}['{k}']") for k, v in body.items()}
    if tag == "$tuple":
        if not isinstance(body, list):
            raise ValueError(f"{where}: '$tuple' holds a {type(body).__name__}, expected a list")
        return tuple(from_json(v, f"{where}[{i}]") for i, v in enumerate(body))
    if tag == "$float":
        if body not in ("inf", "-inf", "nan"):
            raise ValueError(f"{where}: '$float' is {body!r}, expected 'inf', '-inf' or 'nan'")
        return float(body)
    if tag == "$complex":
        if not (isinstance(body, list) and len(body) == 2 and all(isinstance(v, (int, float, dict)) for v in body)):
            raise ValueError(f"{where}: '$complex' is {body!r}, expected [real, imag]")
        re, im = (from_json(v, where) for v in body)
        return complex(re, im)
    return _tensor_from_json(body, where)


def _tensor_from_json(body: Any, where: str) -> torch.Tensor:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "hex"}:
        found = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{where}: '$tensor' must be an object with 'dtype', 'shape', 'hex', found {found}")
    dtype = dtype_from_str(body["dtype"], where=where)
    shape, text = body["shape"], body["hex"]
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(s) is int and 0 <= s for s in shape):
        raise ValueError(f"{where}: tensor shape {escape(repr(shape), limit=80)}, expected at most 8 non-negative ints")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"{where}: tensor of shape {shape} declares {nbytes} bytes; a JSON manifest holds up to "
            f"{MAX_TENSOR_BYTES}"
        )
    if not isinstance(text, str) or len(text) != 2 * nbytes:
        found = f"{len(text) // 2} bytes" if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{where}: tensor {dtype_to_str(dtype)}{shape} needs {nbytes} bytes of 'hex', found {found}")
    try:
        raw = torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)
    except ValueError:
        raise ValueError(f"{where}: tensor 'hex' is not hexadecimal") from None
    if sys.byteorder != "little" and dtype.itemsize > 1:
        raw = raw.reshape(-1, dtype.itemsize).flip(1).reshape(-1)
    return raw.view(dtype).reshape(shape).clone()
