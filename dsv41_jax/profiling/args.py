"""Command-line helpers the benchmark scripts share (no JAX: a script may parse before JAX starts)."""

from __future__ import annotations


def comma_ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"1,8,32"`` → [1, 8, 32]; ValueError naming ``flag`` for a non-integer, none, or one below ``minimum``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{flag} values must be at least {minimum}, got {text!r}")
    return values
