"""Command lines of the processes a launch runs: vLLM workers, the router, the KV pool master and node.

Pure functions of their inputs (no sockets, no environment reads): :mod:`pdserve.launch.plan` calls them with
the ports it was given, and nothing here parses a command line back.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import CONNECTOR_MODULE, CONNECTOR_NAME, LauncherConfig, WorkerConfig

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "pdserve.router"
STORE_MODULE = "pdserve.store.cli"


def served_name(config: LauncherConfig, model_dir: str | os.PathLike) -> str:
    """Name clients put in ``"model"``: ``served_model_name`` or the model folder's name."""
    return config.served_model_name or Path(model_dir).name


def kv_transfer_config(worker: WorkerConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value naming the pdserve connector (secret excluded: it is in the env)."""
    extra: dict[str, Any] = {"lease_s": worker.lease_s}
    extra.update(worker.connector_extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def kv_events_config(worker: WorkerConfig) -> dict[str, Any]:
    """The ``--kv-events-config`` value: vLLM connects to the router's sink (a host, not ``*``, in the endpoint)
    and publishes BlockStored/BlockRemoved/AllBlocksCleared with the worker's URL as the topic."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": worker.kv_events_endpoint,
            "topic": worker.url}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def worker_argv(worker: WorkerConfig, python: str = sys.executable) -> list[str]:
    """argv of one vLLM OpenAI server."""
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", worker.model,
        "--host", worker.host,
        "--port", str(worker.port),
        "--enforce-eager",
        "--max-model-len", str(worker.max_model_len),
    ]
    if worker.served_model_name:
        argv += ["--served-model-name", worker.served_model_name]
    if worker.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(worker.max_num_batched_tokens)]
    if worker.dtype:
        argv += ["--dtype", worker.dtype]
    if worker.connector:
        argv += ["--kv-transfer-config", _json(kv_transfer_config(worker))]
    if worker.kv_events_endpoint:
        argv += ["--kv-events-config", _json(kv_events_config(worker))]
    if worker.tp > 1:
        argv += ["--tensor-parallel-size", str(worker.tp)]
    return argv + list(worker.extra_args)


def worker_env(worker: WorkerConfig) -> dict[str, str]:
    """Variables the launcher sets for one worker (on top of its own environment; the secret comes apart)."""
    env = dict(worker.env)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(worker.kv_cache_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = worker.omp_bind
    if worker.tp > 1:  # one core list per tensor-parallel rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = worker.omp_bind_ranks
    env["PYTHONUNBUFFERED"] = "1"
    env["PDSERVE_WORKER_NAME"] = worker.name
    return env


def router_command(
    config: LauncherConfig,
    workers: Sequence[WorkerConfig],
    model_dir: str | os.PathLike,
    port: int,
    python: str = sys.executable,
    kv_events_bind: str = "",
    pool_master: str = "",
) -> list[str]:
    """argv of ``python -m pdserve.router`` for these workers (see pdserve/router/__main__.py).

    kv_events_bind: the endpoint the router binds for the workers' KV events ("" none); pool_master: HOST:PORT
    of the KV pool master the conductor follows ("" none)."""
    argv = [python, "-m", ROUTER_MODULE, "--host", config.host, "--port", str(port),
            "--model-dir", str(model_dir)]
    if config.colocated:
        argv += ["--colocated", *[w.url for w in workers]]
    else:
        argv += ["--prefill", *[w.url for w in workers if w.role == "prefill"]]
        argv += ["--decode", *[w.url for w in workers if w.role == "decode"]]
    argv += ["--served-model-name", served_name(config, model_dir)]
    argv += ["--max-model-len", str(config.max_model_len)]
    argv += ["--policy", config.policy]
    if kv_events_bind:
        argv += ["--kv-events-bind", kv_events_bind]
    if config.ttft_slo_ms is not None:
        argv += ["--ttft-slo-ms", str(config.ttft_slo_ms)]
    if config.tpot_slo_ms is not None:
        argv += ["--tpot-slo-ms", str(config.tpot_slo_ms)]
    argv += list(config.router_args)
    if pool_master:
        argv += ["--pool-master", pool_master]
    return argv


def pool_master_argv(port: int, metrics_port: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", STORE_MODULE, "master", "--port", str(port), "--metrics-port", str(metrics_port)]


def pool_node_argv(master: str, mem: str, disk: str, disk_dir: str, python: str = sys.executable) -> list[str]:
    """argv of the one store node: ``mem`` of host memory, and ``disk`` bytes in ``disk_dir`` unless disk is 0."""
    argv = [python, "-m", STORE_MODULE, "node", "--master", master, "--mem", mem, "--node-id", "node0"]
    if disk != "0":
        argv += ["--disk-dir", disk_dir, "--disk", disk]
    return argv
