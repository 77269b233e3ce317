"""Accelerator and network catalogue (pdserve/plan/data/hardware.yaml), plus a measured entry for this machine."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from ..settings.errors import ConfigError

_CATALOGUE = Path(__file__).with_name("data") / "hardware.yaml"


class HardwareError(ConfigError):
    """Unknown accelerator or link, or a catalogue entry with a bad field."""


@dataclass(frozen=True)
class Accelerator:
    """One device. Rates are per device, in SI units (FLOP/s, bytes/s, bytes)."""

    name: str
    bf16_flops: float
    fp8_flops: float | None
    mem_bw: float
    memory_bytes: float
    mfu: float
    mbu: float
    step_overhead_s: float

    def peak_flops(self, dtype: str) -> float:
        """Tensor throughput for weights of ``dtype`` (fp8 rate only where the chip has it)."""
        if dtype in ("fp8", "fp4") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


@dataclass(frozen=True)
class Link:
    """Network between a prefill and a decode instance."""

    name: str
    bytes_s: float  # line rate of the node, bytes/s
    gpus: int  # devices sharing it
    efficiency: float
    overhead_s: float

    def effective_bytes_s(self, instance_gpus: int) -> float:
        """What a KV transfer of an instance of ``instance_gpus`` devices reaches."""
        return self.bytes_s * min(1.0, instance_gpus / self.gpus) * self.efficiency


@dataclass(frozen=True)
class Catalogue:
    accelerators: dict[str, Accelerator]
    links: dict[str, Link]
    handoff_s: float


def _positive(entry: str, field: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or value <= 0:
        raise HardwareError(f"{_CATALOGUE.name}: {entry}.{field} must be a positive number, got {value!r}")
    return float(value)


def load_catalogue(path: Path | None = None) -> Catalogue:
    """Read the catalogue; every field checked."""
    raw = yaml.safe_load((path or _CATALOGUE).read_text())
    accs = {}
    for name, a in raw["accelerators"].items():
        fp8 = a.get("fp8_tflops")
        accs[name] = Accelerator(
            name=name, bf16_flops=_positive(name, "bf16_tflops", a.get("bf16_tflops")) * 1e12,
            fp8_flops=_positive(name, "fp8_tflops", fp8) * 1e12 if fp8 is not None else None,
            mem_bw=_positive(name, "hbm_tbs", a.get("hbm_tbs")) * 1e12,
            memory_bytes=_positive(name, "memory_gb", a.get("memory_gb")) * 1e9,
            mfu=_positive(name, "mfu", a.get("mfu")), mbu=_positive(name, "mbu", a.get("mbu")),
            step_overhead_s=float(a.get("step_overhead_ms", 0.0)) / 1e3)
    links = {}
    for name, spec in raw["links"].items():
        links[name] = Link(name=name, bytes_s=_positive(name, "gbps", spec.get("gbps")) * 1e9 / 8,
                           gpus=int(_positive(name, "gpus", spec.get("gpus"))),
                           efficiency=_positive(name, "efficiency", spec.get("efficiency")),
                           overhead_s=float(spec.get("overhead_ms", 0.0)) / 1e3)
    return Catalogue(accs, links, float(raw.get("handoff_ms", 0.0)) / 1e3)


def accelerator(name: str, catalogue: Catalogue | None = None) -> Accelerator:
    cat = catalogue or load_catalogue()
    for key, acc in cat.accelerators.items():
        if key.lower() == name.lower():
            return acc
    raise HardwareError(f"unknown accelerator {name!r}; known: {', '.join(cat.accelerators)} or 'this'")


def link(name: str, catalogue: Catalogue | None = None) -> Link:
    cat = catalogue or load_catalogue()
    if name not in cat.links:
        raise HardwareError(f"unknown link {name!r}; known: {', '.join(cat.links)} or 'this'")
    return cat.links[name]


def with_overrides(acc: Accelerator, **fields: Any) -> Accelerator:
    """A copy with some fields replaced (calibration, command-line overrides)."""
    return replace(acc, **{k: v for k, v in fields.items() if v is not None})
