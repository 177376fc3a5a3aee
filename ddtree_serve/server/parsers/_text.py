"""Marker search over a growing text buffer, holding back a possible partial marker at the end."""

from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest occurrence of any marker: (index, marker), or (-1, None)."""
    best_i, best_m = -1, None
    for marker in markers:
        i = text.find(marker)
        if i != -1 and (best_i == -1 or i < best_i):
            best_i, best_m = i, marker
    return best_i, best_m
