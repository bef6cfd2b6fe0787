"""Byte counts as people write them: ``"6GiB"``, ``"512MiB"``, ``"8GB"``, ``"1.5GiB"`` or a plain int."""
from __future__ import annotations

import math
import re
from typing import Any

#: Each unit's bytes: SI (powers of 1000) and IEC (powers of 1024), case as written or lower.
UNITS = {"": 1, "b": 1,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

_SPELLING = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Any) -> int:
    """A number of bytes from an int or a string with an SI or IEC unit.

    Args:
      value: an int (bytes), or a string such as ``"6GiB"`` (6 * 2**30), ``"8GB"``
        (8 * 10**9), ``"512MiB"``, ``"1.5GiB"`` or ``"1000"``.

    Returns:
      The bytes, rounded down to a whole byte.

    Raises:
      ValueError: a negative or non-finite number, an unknown unit, or not a number at all.

    Example:
      >>> parse_bytes("6GiB"), parse_bytes("8GB"), parse_bytes(512)
      (6442450944, 8000000000, 512)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"a memory limit is an int of bytes or a string such as '6GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a memory limit cannot be negative, got {value}")
        return value
    if value.strip().startswith("-"):
        raise ValueError(f"a memory limit cannot be negative, got {value!r}")
    found = _SPELLING.match(value)
    if found is None:
        raise ValueError(f"cannot read {value!r} as bytes: write a number and a unit, e.g. '6GiB', '512MiB' or '8GB'")
    number, unit = float(found.group(1)), found.group(2).lower()
    if unit not in UNITS:
        raise ValueError(f"unknown unit {found.group(2)!r} in {value!r}: use one of B, KB, MB, GB, TB "
                         "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
    if not math.isfinite(number):
        raise ValueError(f"a memory limit must be finite, got {value!r}")
    return int(number * UNITS[unit])
