"""Plain value checks that every settings module uses: whole numbers, booleans, and a close key name.

They import nothing of settings/, so any module may import them (settings.pool_options, which
the model imports, included).
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Callable


def integer(value: Any, default: Any, low: int, high: int, error: Callable[[str], None]) -> int | None:
    if value is None or value == "":
        return default
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        error(f"expected a whole number, found {value!r}")
        return None
    if not low <= value <= high:
        error(f"{value} is out of range; use a number from {low} to {high}")
        return None
    return value


def boolean(value: Any, default: bool, error: Callable[[str], None]) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("true", "false"):
        return str(value).strip().lower() == "true"
    error(f"expected true or false, found {value!r}")
    return default


def suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(sorted(choices))}"


