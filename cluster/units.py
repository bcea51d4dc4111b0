"""Human-friendly sizes on the command line: 512MiB, 2GB, 1048576."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912. Decimal (KB, MB, GB) and binary (KiB, MiB, GiB) suffixes."""
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1048576, 512MiB, 2GB)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"byte size must be at least 1 byte, got {text!r}")
    return int(value)


def byte_size(text: str) -> int:
    """parse_bytes as an argparse type: its message, under the flag's name."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of byte sizes (one per worker), as an argparse type."""
    return tuple(byte_size(part) for part in text.split(","))
