"""The order in which a benchmark runs its methods: rotated by one from prompt to prompt (or
chunk to chunk), so that machine noise, warm caches and thermal drift hit every method alike
rather than always favouring the one that runs first."""

from __future__ import annotations


def rotated(items: list, shift: int) -> list:
    """items rotated left by `shift`: rotated([a, b, c], 1) -> [b, c, a]."""
    shift %= len(items)
    return items[shift:] + items[:shift]
