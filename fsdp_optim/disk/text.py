"""Text from files and callers, made safe to print (:func:`escape`), and the one error for a file that cannot be
read."""

from __future__ import annotations

from typing import Any


def unreadable(where: Any, reason: str) -> ValueError:
    return ValueError(f"{where}: cannot be read with torch.load(weights_only=True): {reason}")



_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}



def escape(text: str, *, limit: int = 4096) -> str:
    """``text`` with control characters (C0, DEL, C1, bidirectional overrides) shown as escapes, so a
    parameter name cannot move the cursor, recolour or rewrite a terminal; cut to ``limit`` characters."""
    out = []
    for ch in text[:limit]:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069 or code in (0x200E, 0x200F, 0x061C):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out) + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


def human_bytes(n: int) -> str:
    if not 0 <= n < 1 << 60:  # a file's declared sizes: no float of them (10**400 has none)
        return f"{n} B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit} ({n} B)"
        value /= 1024
    raise AssertionError("unreachable")
