"""Numbers as users write them: sizes, bandwidths, durations and counts, and
the one byte formatter.

Sizes written as strings are
decimal for ``KB``/``MB``/``GB``/``TB`` (the ZeRO paper's GB is 10⁹ bytes) and
binary for ``KiB``/``MiB``/``GiB``/``TiB``; bandwidths may be written in bytes
(``300GB/s``) or bits (``200Gb/s``).

>>> parse_bytes("80GB"), fmt_bytes(1536), fmt_bytes(80e9, decimal=True)
(80000000000.0, '1.50 KiB', '80.0 GB')
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

import numpy as np

_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_NUMBER = r"[+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
_SIZE = re.compile(rf"^\s*(?P<num>{_NUMBER})\s*(?P<unit>[A-Za-z]*)\s*$")
_DURATION = re.compile(rf"^\s*({_NUMBER})\s*(s|ms|us|µs|min|h|)\s*$")
_COUNT = re.compile(rf"^\s*({_NUMBER})\s*([kKmMbBtT]?)\s*$")
_SECONDS = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60, "h": 3600}
_COUNTS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}

#: The units a size may be written in (named by every size error).
UNITS_HELP = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
BAD_SIZE = (
    "{what}: cannot read {value!r} as {kind}. Write a number with one of the units {units}{extra}, e.g. {example}."
)
#: A bandwidth must carry a unit: a bare ``300`` is as likely Gb/s as bytes/s.
SIZE_NEEDS_UNIT = (
    "{what}: {value!r} has no unit; write the size with one of the units " + UNITS_HELP + ", e.g. '80GB' or '16GiB'."
)
BANDWIDTH_NEEDS_UNIT = (
    "{what}: {value!r} has no unit; a bandwidth is ambiguous without one. Write it with one of the units "
    + UNITS_HELP
    + " (b for bits), per second, e.g. '300GB/s' or '200Gb/s'."
)
BAD_DURATION = "{what}: cannot read {value!r} as a duration; write e.g. '10s', '250ms' or '2min'."
BAD_COUNT = "{what}: cannot read {value!r} as a count; write e.g. 7e9, '7B' or '350M'."


def is_whole_number(value: Any) -> bool:
    """An ``int`` or NumPy integer (``np.int64(2)`` as much as ``2``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real_number(value: Any) -> bool:
    """A real number (Python or NumPy, ``np.float32(1.0)`` included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def number(value: Any, what: str) -> float:
    """A finite float from a number (not a bool); ``TypeError``/``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{what}: expected a number, got {value!r} ({type(value).__name__}).")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{what}: expected a finite number, got {value!r}.")
    return x


def parse_bytes(value: Any, what: str = "size", *, rate: bool = False) -> float:
    """Bytes from a number or a string such as ``"80GB"``, ``"80 GiB"``,
    ``"1.5e9"``; with ``rate=True`` (bandwidths) also ``"300GB/s"`` and bits,
    ``"200Gb/s"``.

    >>> parse_bytes("80GB"), parse_bytes("1KiB"), parse_bytes("200Gb/s", rate=True)
    (80000000000.0, 1024.0, 25000000000.0)
    """
    if not isinstance(value, str):
        return number(value, what)
    text = re.sub(r"\s*(/\s*s|ps)$", "", value.strip()) if rate else value.strip()
    m = _SIZE.match(text)
    unit = m.group("unit") if m else ""
    bits = rate and unit.endswith("b")
    prefix = unit[:-1] if unit.endswith("B") or bits else unit
    scale = _SI.get(prefix.lower(), _IEC.get(prefix.lower())) if prefix == unit[:-1] or not unit else None
    if m is None or scale is None:
        raise ValueError(
            BAD_SIZE.format(
                what=what,
                value=value,
                kind="a bandwidth" if rate else "a size in bytes",
                units=UNITS_HELP,
                extra=" (b for bits), per second" if rate else "",
                example="'300GB/s' or '200Gb/s'" if rate else "'80GB' or '16GiB'",
            )
        )
    return float(m.group("num")) * scale / (8 if bits else 1)


def parse_bandwidth(value: Any, what: str = "bandwidth") -> float:
    """Bytes per second from a string with a unit (``"300GB/s"``,
    ``"200Gb/s"``); a bare number in a string (``"300"``) is refused, since
    the command line cannot tell bytes from bits. Numbers pass as bytes/s.

    >>> parse_bandwidth("300GB/s")
    300000000000.0
    """
    if isinstance(value, str) and _SIZE.match(value) and not _SIZE.match(value).group("unit"):  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        raise ValueError(BANDWIDTH_NEEDS_UNIT.format(what=what, value=value))
    return parse_bytes(value, what, rate=True)


def parse_size_argument(value: str, what: str) -> float:
    """Bytes from a command-line size: a unit is required (``"80GB"``), since
    ``--device-memory 80`` read as 80 bytes would silently plan for nothing;
    only ``"0"`` may stand alone.

    >>> parse_size_argument("16GiB", "--device-memory")
    17179869184.0
    """
    m = _SIZE.match(value.strip())
    if m and not m.group("unit") and float(m.group("num")) != 0:
        raise ValueError(SIZE_NEEDS_UNIT.format(what=what, value=value))
    return parse_bytes(value, what)


def parse_seconds(value: Any, what: str = "time") -> float:
    """Seconds from a number or ``"10s"``, ``"250ms"``, ``"2min"``, ``"1h"``.

    >>> parse_seconds("250ms")
    0.25
    """
    if not isinstance(value, str):
        return number(value, what)
    m = _DURATION.match(value)
    if not m:
        raise ValueError(BAD_DURATION.format(what=what, value=value))
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_count(value: Any, what: str = "num_params") -> float:
    """A count from a number or ``"7e9"``, ``"7B"``, ``"350M"``, ``"1.5T"``.

    >>> parse_count("7B"), parse_count("350M")
    (7000000000.0, 350000000.0)
    """
    if not isinstance(value, str):
        return number(value, what)
    m = _COUNT.match(value)
    if not m:
        raise ValueError(BAD_COUNT.format(what=what, value=value))
    return float(m.group(1)) * _COUNTS[m.group(2).lower()]


def fmt_bytes(n: float, *, decimal: bool = False) -> str:
    """Bytes for people: binary by default (``1536`` -> ``'1.50 KiB'``), or
    decimal as the ZeRO paper and ``--device-memory 80GB`` write them
    (``decimal=True``: ``'80.0 GB'``).

    >>> fmt_bytes(512), fmt_bytes(3 * 2**30), fmt_bytes(1.5e12, decimal=True), fmt_bytes(999, decimal=True)
    ('512 B', '3.00 GiB', '1.5 TB', '999 B')
    """
    if decimal:
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
            if abs(n) >= scale:
                return f"{n / scale:.1f} {unit}"
        return f"{n:.0f} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
