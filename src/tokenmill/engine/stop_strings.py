"""Stop-string matching across token boundaries."""

from __future__ import annotations

from typing import Optional


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> Optional[tuple[int, str]]:
    """Earliest stop string that ends inside the newest `num_new_chars` characters of `text`.

    Returns (index where it starts, the stop string), or None. Only the tail that new text could
    have completed is searched, so the check is O(new + longest stop) per token.
    """
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        window_start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, window_start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string.

    That tail may still turn into a stop string, so it must not be shown to the user yet.
    """
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
