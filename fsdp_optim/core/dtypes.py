"""dtype names as checkpoints record them ('float32'), and the dtypes optimizer state may have."""

from __future__ import annotations

import torch


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



def dtype_from_str(name: object, *, where: str) -> torch.dtype:
    """The dtype a file or record names (``"float32"``); anything else, ``None`` included, is a ``ValueError``."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in ALLOWED_DTYPES:
        raise ValueError(f"{where}: expected the name of a real dtype such as 'float32', found {name!r}")
    return dtype


ALLOWED_DTYPES = frozenset(
    {
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64, torch.bool,
    }
)  # fmt: skip
