"""LoRA adapter settings: ``--lora-modules NAME=PATH,NAME=PATH`` parsed and checked once, for the launcher (the
workers' vLLM flags) and the router (the names clients may put in ``model``)."""

from __future__ import annotations

from .errors import ConfigError

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks (vllm/config/lora.py)
RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM serves /v1/(un)load_lora_adapter only with it


def parse_lora_modules(text: str, base_name: str = "") -> dict[str, str]:
    """``NAME=PATH,NAME=PATH`` -> {name: path}, in order. Raises :class:`ConfigError` on an empty name or path, a
    name given twice, or a name equal to the served model's (``base_name``): clients could not tell them apart."""
    out: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"lora_modules={text!r}: {item!r} is not NAME=PATH (e.g. sql=/models/sql-lora)")
        if name in out:
            raise ConfigError(f"lora_modules={text!r}: adapter {name!r} is given twice")
        if base_name and name == base_name:
            raise ConfigError(f"lora_modules={text!r}: adapter {name!r} has the served model's name; rename it")
        out[name] = path
    return out


def lora_modules_text(modules: dict[str, str]) -> str:
    """The inverse of :func:`parse_lora_modules`."""
    return ",".join(f"{name}={path}" for name, path in modules.items())


def check_max_lora_rank(rank: int) -> None:
    if rank not in MAX_LORA_RANKS:
        raise ConfigError(f"max_lora_rank={rank!r}: use one of vLLM's ranks {', '.join(map(str, MAX_LORA_RANKS))}")
