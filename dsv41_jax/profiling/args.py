"""Command-line helpers the benchmark scripts share (no JAX: a script may parse before JAX starts)."""

from __future__ import annotations

from dsv41_jax.planner.options import WORLDS


def comma_ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"1,8,32"`` → [1, 8, 32]; ValueError naming ``flag`` for a non-integer, none, or one below ``minimum``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{flag} values must be at least {minimum}, got {text!r}")
    return values


def rank_of_worlds(text: str) -> list[int]:
    """``--rank-of "2,4"`` → [2, 4] (empty text: none); ValueError unless each is one of the planner's WORLDS."""
    worlds = comma_ints(text, "--rank-of") if text.strip() else []
    if any(w not in WORLDS for w in worlds):
        raise ValueError(f"--rank-of takes {', '.join(map(str, WORLDS))}, got {worlds}")
    return worlds


def world_label(row: dict) -> str:
    """A result row's world column: W, or 1/W for one rank's share of world W on one device (``--rank-of``)."""
    return f"1/{row['rank_of']}" if row.get("rank_of") else str(row["world"])
