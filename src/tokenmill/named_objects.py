"""Objects named on the command line as `module:Attribute` (a logits processor class, a worker extension class)."""

from __future__ import annotations

import importlib
from typing import Any


def import_named(name: str, what: str) -> Any:
    """The attribute `name` (module:Attribute) names; ValueError naming `what` it was to be when it cannot be had."""
    module, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{what} {name!r} not found (give module:Class): {exc}") from None
