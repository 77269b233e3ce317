"""The compatibility fingerprint every KV exchange carries: KV bytes are only usable by a worker whose
fingerprint equals the producer's, field for field.

Fields (all strings): ``model`` (the model's name: its path's last part or hub id), ``model_hash`` (its
``config.json`` and the names and sizes of its weight files; a hub model: its config and revision), ``dtype``
(the model's), ``kv_dtype`` (the cache's), ``block_size``, ``kv_layout`` (the tensor-parallel-independent KV layout
signature; the shard a rank holds is checked by the layout and head plans, so ``tp`` is informative and not
compared), ``vllm`` and ``pdserve`` versions, and ``domain``: the request's key domain (cache salt, LoRA adapter):
"" in the worker's own fingerprint; a hand-off carries its request's (``scheduler.request_fingerprint``, the hex
of :func:`pdserve.hashing.domain_root`, "" without a salt or an adapter), and it is compared like every other
field, so D never takes KV that P computed under another salt or adapter.

P puts its fields in ``kv_transfer_params`` (``remote_fingerprint``); D compares them with its own before it
reads and refuses a mismatch by name (it computes the prompt itself). The 64-bit :func:`digest` travels with
P's checksum reply and in every KV pool object's trailer, so a pool shared by two models never serves one
model's blocks to the other.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PROTOCOL = "pdserve-kv/1"  # bump when the meaning of the bytes a connector moves changes
NOT_COMPARED = frozenset({"tp"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def _pdserve_version() -> str:
    try:
        from importlib.metadata import version
        return f"{version('pdserve')}/{PROTOCOL}"
    except Exception:
        return f"dev/{PROTOCOL}"


def model_hash(model: str, revision: str | None = None, hf_config: Any = None) -> str:
    """A short digest of the model's identity: a local directory's ``config.json`` bytes and its weight files'
    names and sizes (not their contents: hashing gigabytes at start-up is too slow); otherwise the hub id, the
    revision and the loaded config."""
    h = hashlib.blake2b(digest_size=8)
    path = Path(model) if model else Path("/nonexistent-model")
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
    elif path.is_file():
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    else:
        h.update(f"{model}@{revision or ''}".encode())
        if hf_config is not None:
            try:
                cfg = {k: v for k, v in hf_config.to_dict().items() if k != "_name_or_path"}
                h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
            except Exception:
                pass
    return h.hexdigest()


def worker_fingerprint(vllm_config: Any, kv_layout: str, block_size: int, tp: int) -> dict[str, str]:
    """This worker's fingerprint from vLLM's config and its registered KV layout."""
    import vllm

    model = vllm_config.model_config
    name = str(getattr(model, "model", "") or "")
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    return {
        "model": os.path.basename(name.rstrip("/")) or name,
        "model_hash": model_hash(name, getattr(model, "revision", None), getattr(model, "hf_config", None)),
        "dtype": str(getattr(model, "dtype", "")).replace("torch.", ""),
        "kv_dtype": kv_dtype,
        "block_size": str(block_size),
        "kv_layout": kv_layout,
        "tp": str(tp),
        "vllm": str(getattr(vllm, "__version__", "")),
        "pdserve": _pdserve_version(),
        "domain": "",  # the request's key domain goes here per hand-off (scheduler.request_fingerprint)
    }


def digest(fields: Mapping[str, str]) -> int:
    """The fingerprint as one unsigned 64-bit number (compared fields only)."""
    body = json.dumps({k: v for k, v in sorted(fields.items()) if k not in NOT_COMPARED}, sort_keys=True)
    return int.from_bytes(hashlib.blake2b(body.encode(), digest_size=8).digest(), "little")


def differences(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """``field: P=.. vs D=..`` for each compared field that differs (a field one side lacks differs)."""
    keys = sorted((set(theirs) | set(mine)) - NOT_COMPARED)
    return [f"{k}: P={theirs.get(k)!r} vs D={mine.get(k)!r}" for k in keys if theirs.get(k) != mine.get(k)]


def parse(raw: Any) -> dict[str, str]:
    """``remote_fingerprint`` from kv_transfer_params: a map of strings (ValueError otherwise)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError("kv_transfer_params.remote_fingerprint must be a map of strings: pass P's "
                         "kv_transfer_params unchanged")
    return dict(raw)
