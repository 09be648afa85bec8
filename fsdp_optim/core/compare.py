"""How two tensors of optimizer state differ, element by element: the statistics of one ``diff`` row.

Tensors in, a frozen :class:`TensorStats` out. Two flat tensors ``a``, ``b`` of
``n`` elements give: bitwise equal?, within ``atol``/``rtol`` (``|a - b| <= atol + rtol * |b|``, NaN equal to
NaN, an infinity only to itself), the largest absolute and relative error (relative to ``|b|``), the largest
distance in units in the last place, and the NaN and Inf counts of each side.

ULP distance: a float's bit pattern read as a sign-magnitude integer and mapped to two's complement
(:func:`ordered_bits`) is monotone in the float's value, so the difference of two mapped patterns counts the
representable floats between them (``+0.0`` and ``-0.0`` are both 0, ``inf`` is one past the largest finite).
Elements where either side is NaN take no part in the errors and ULP distance (the counts report them); NaN
against a number is an infinite absolute error.

Cost: an equal pair (the usual case) is one ``memcmp`` of the two tensors' bytes (``torch.equal`` is several
times slower) plus one sum of ``a`` (a finite sum proves every element finite). A pair that differs is compared
in chunks of :data:`CHUNK` elements, its errors in float64, only over the elements whose bits differ (all of a
chunk's when most of them do).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CHUNK", "TensorStats", "compare_tensors", "nonfinite_counts", "ordered_bits"]

CHUNK = 1 << 18  # elements per step of a chunked pass: the temporaries stay a few MiB whatever the tensor

# Same-width integer dtype of each float dtype (the bit pattern), and its sign bit.
_BITS = {
    torch.float64: (torch.int64, 63),
    torch.float32: (torch.int32, 31),
    torch.float16: (torch.int16, 15),
    torch.bfloat16: (torch.int16, 15),
}


@dataclass(frozen=True)
class TensorStats:
    """How ``a`` differs from ``b`` (see the module docstring); ``max_ulp`` is ``None`` for non-float dtypes
    or two dtypes."""

    numel: int
    bitwise_equal: bool
    close: bool  # within atol/rtol
    max_abs: float
    max_rel: float
    max_ulp: int | None
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of float tensor ``x`` as int64 values ordered like the floats (``-0.0`` -> 0)."""
    int_dtype, sign = _BITS[x.dtype]
    bits = x.view(int_dtype).to(torch.int64)
    magnitude = bits & ((1 << sign) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def nonfinite_counts(x: torch.Tensor) -> tuple[int, int]:
    """``(NaN count, Inf count)`` of a 1-D tensor: one sum when every element is finite, else chunked counts."""
    if not x.dtype.is_floating_point or x.numel() == 0 or math.isfinite(float(x.sum())):
        return 0, 0
    nan = inf = 0
    for start in range(0, x.numel(), CHUNK):
        part = x[start : start + CHUNK]
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf


def _memcmp() -> Callable[[int, int, int], int] | None:
    try:
        memcmp = ctypes.CDLL(None).memcmp  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp  # type: ignore[no-any-return]


_MEMCMP = _memcmp()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    if a.numel() == 0:
        return True
    if _MEMCMP is not None and a.is_contiguous() and b.is_contiguous() and a.device.type == b.device.type == "cpu":
        return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    if a.dtype in _BITS:
        return bool(torch.equal(a.view(_BITS[a.dtype][0]), b.view(_BITS[b.dtype][0])))
    return bool(torch.equal(a, b))


def compare_tensors(a: torch.Tensor, b: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0) -> TensorStats:
    """How 1-D tensor ``a`` differs from ``b`` (same number of elements; dtypes may differ)."""
    assert a.dim() == 1 and b.dim() == 1 and a.numel() == b.numel(), (
        f"compare_tensors takes two 1-D tensors of one length, found {tuple(a.shape)} and {tuple(b.shape)}"
    )
    nan_a, inf_a = nonfinite_counts(a)
    if _bits_equal(a, b):
        ulp = 0 if a.dtype in _BITS else None
        return TensorStats(a.numel(), True, True, 0.0, 0.0, ulp, nan_a, nan_a, inf_a, inf_a)
    nan_b, inf_b = nonfinite_counts(b)
    acc = _Errors(a.dtype == b.dtype and a.dtype in _BITS)
    for start in range(0, a.numel(), CHUNK):
        acc.add(a[start : start + CHUNK], b[start : start + CHUNK], atol, rtol)
    ulp = acc.max_ulp if acc.ulp else None
    return TensorStats(a.numel(), False, acc.close, acc.max_abs, acc.max_rel, ulp, nan_a, nan_b, inf_a, inf_b)


class _Errors:
    """The running maxima of a chunked comparison (local to one :func:`compare_tensors` call)."""

    def __init__(self, ulp: bool) -> None:
        self.ulp = ulp
        self.close = True
        self.max_abs = self.max_rel = 0.0
        self.max_ulp = 0

    def add(self, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> None:
        """One chunk; only the elements whose bits differ are looked at (all of them when most differ)."""
        if a.dtype == b.dtype and a.dtype in _BITS:
            int_dtype = _BITS[a.dtype][0]
            differ = a.view(int_dtype) != b.view(int_dtype)
        else:
            differ = a.to(torch.float64) != b.to(torch.float64)
        count = int(differ.sum())
        if count == 0:
            return
        x, y = (a, b) if 2 * count > a.numel() else (a[differ], b[differ])
        xd, yd = x.to(torch.float64), y.to(torch.float64)
        nan_x, nan_y = torch.isnan(xd), torch.isnan(yd)
        same = (xd == yd).logical_or_(nan_x & nan_y)
        err = (xd - yd).abs_().masked_fill_(same, 0.0).nan_to_num_(nan=math.inf, posinf=math.inf)
        self.max_abs = max(self.max_abs, float(err.max()))
        ref = yd.abs_()
        rel = (err / ref).masked_fill_(err == 0, 0.0).nan_to_num_(nan=math.inf, posinf=math.inf)  # x/0: inf, not max
        self.max_rel = max(self.max_rel, float(rel.max()))
        del rel
        if atol > 0 or rtol > 0:
            within = ((err <= ref.mul_(rtol).add_(atol)).logical_and_(torch.isfinite(err))).logical_or_(same)
        else:  # no tolerance: only equal values (+0.0 and -0.0, two NaNs) are close
            within = same
        self.close = self.close and bool(within.all())
        if self.ulp:
            distance = _ulp_distance(x, y).masked_fill_(nan_x.logical_or_(nan_y), 0)
            self.max_ulp = max(self.max_ulp, int(distance.max()))


def _ulp_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|ordered_bits(x) - ordered_bits(y)|``; float64 patterns differ by up to 2**64, so that difference is
    taken in float64 (exact below 2**53 ULPs, and saturating rather than wrapping above)."""
    ox, oy = ordered_bits(x), ordered_bits(y)
    if x.dtype == torch.float64:
        return (ox.to(torch.float64) - oy.to(torch.float64)).abs_()
    return ox.sub_(oy).abs_()
