"""Request values read as vLLM's pydantic request models read them (lax mode), so a client that works against one
vLLM worker works against the router. Booleans: ``true``/``false``; the numbers 0 and 1 (ints, or floats equal
to them); and the strings pydantic takes, in any case: "1", "on", "t", "true", "y", "yes" and "0", "off", "f",
"false", "n", "no". Anything else is a 400 naming the field. (Chat's ``logprobs: 1`` is the common case.)
Integers: an integral float (``2.0``) is the int."""

from __future__ import annotations

from typing import Any

from ..errors import bad_request

TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def as_flag(v: Any, name: str) -> bool:
    """``v`` (not None) as a boolean, or a 400 naming ``name``."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in TRUE_WORDS | FALSE_WORDS:
        return v.lower() in TRUE_WORDS
    raise bad_request(f"'{name}' must be true or false, got {v!r}", name)


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """``body[name]`` as a boolean; ``default`` when absent or null."""
    v = body.get(name)
    return default if v is None else as_flag(v, name)


def integral(v: Any) -> Any:
    """An integral float (``1.0``) as the int vLLM's pydantic models read it; anything else unchanged."""
    return int(v) if isinstance(v, float) and v.is_integer() else v
