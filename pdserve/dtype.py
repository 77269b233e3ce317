"""Which dtype the model runs in on this CPU: the one rule that ``pdserve serve``, ``pdserve bench compare``,
the model converter (:mod:`pdserve.launch.models`) and the planner's measurement (:mod:`pdserve.plan.measure`) share.

bf16 where the CPU computes it natively (AVX512-BF16, or AMX: ``avx512_bf16``, ``amx_bf16``, ``amx_tile`` in
``/proc/cpuinfo``'s flags), else fp32: without those instructions torch and vLLM emulate bf16 matmuls, and an AVX2
EPYC ran a 2-core vLLM worker 3.1x slower in bf16 than in fp32 (``benchmarks/dtype_bench.py`` measures
this machine). An explicit ``--dtype`` always wins. Imports nothing of pdserve and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # any of them: the CPU has bf16 matmul instructions
DTYPES = ("bfloat16", "float32")  # what a model folder and a CPU worker may be given
ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float": "float32"}
_SLOW = ("float16", "half", "fp16")


class DtypeError(ValueError):
    """An override names a dtype the CPU rule does not serve; the message says what to pass instead."""


@dataclass(frozen=True)
class DtypeChoice:
    """``dtype`` is ``bfloat16`` or ``float32`` (vLLM's and torch's spelling); ``reason`` says why, for a log."""

    dtype: str
    reason: str

    def describe(self) -> str:
        return f"dtype {self.dtype}: {self.reason}"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags on ``/proc/cpuinfo``'s ``flags`` lines (x86; other architectures have none, so fp32)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


def read_cpuinfo(path: Path | None = None) -> str | None:
    """``/proc/cpuinfo``'s text (or ``path``'s), or None where there is none (not Linux)."""
    try:
        return (path or CPUINFO).read_text()
    except OSError:
        return None


def normalize(dtype: str) -> str:
    """``bf16`` -> ``bfloat16``, ``fp32``/``float`` -> ``float32``; anything else is refused, saying what to pass."""
    key = str(dtype).strip().lower()
    if key in ALIASES:
        return ALIASES[key]
    if key in _SLOW:
        raise DtypeError(f"dtype {dtype!r} is not supported on CPU workers (vLLM's CPU backend has no fast fp16): "
                         "pass --dtype bfloat16 or --dtype float32, or leave --dtype out to choose from the CPU")
    raise DtypeError(f"dtype {dtype!r} unknown: pass --dtype bfloat16 (alias bf16) or --dtype float32 (alias "
                     "fp32), or leave --dtype out to choose from the CPU's flags")


def choose_dtype(override: str | None = None, cpuinfo: str | None = None) -> DtypeChoice:
    """The dtype to run in: ``override`` if given (normalized, or :class:`DtypeError`), else bf16 when the CPU
    has bf16 instructions, else fp32. ``cpuinfo``: ``/proc/cpuinfo``'s text (default: read it now)."""
    if override is not None and str(override).strip():
        return DtypeChoice(normalize(override), f"--dtype {override} given")
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    if text is None:
        return DtypeChoice("float32", f"{CPUINFO} is unreadable, so bf16 support is unknown; fp32 is safe "
                                      "(pass --dtype bfloat16 if this CPU has AVX512-BF16 or AMX)")
    found = [f for f in BF16_FLAGS if f in cpu_flags(text)]
    if found:
        return DtypeChoice("bfloat16", f"the CPU has {', '.join(found)} (native bf16 matmuls); "
                                       "pass --dtype float32 to override")
    return DtypeChoice("float32", f"the CPU has none of {', '.join(BF16_FLAGS)}, so bf16 would be emulated "
                                  "(~3x slower than fp32 on an AVX2 CPU); pass --dtype bfloat16 to override")
