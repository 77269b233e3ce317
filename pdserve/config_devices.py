"""Where a worker runs, as configured: tensor-parallel ranks (CPU core lists per rank, or one GPU per rank), the
GPUs of a GPU host and the KV data plane (pdserve's connector or vLLM's NixlConnector). The checks of
:class:`~pdserve.config.LauncherConfig` and :class:`~pdserve.config.WorkerConfig` for these fields."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config_fields import ConfigError, check_port

if TYPE_CHECKING:
    from .config import LauncherConfig, WorkerConfig

KV_CONNECTORS = ("pdserve", "nixl")  # the workers' KV data plane (same names as the router's --kv-connector)


def check_worker_tp(w: WorkerConfig) -> None:
    if not isinstance(w.tp, int) or isinstance(w.tp, bool) or w.tp < 1:
        raise ConfigError(f"{w.name}.tp={w.tp!r}: use a whole number of tensor-parallel ranks >= 1")
    if w.tp > 1 and not w.gpus and len(w.cores) % w.tp:
        raise ConfigError(f"{w.name}.cores={w.cores!r} cannot be split evenly over tp={w.tp} ranks: give "
                          f"{w.tp} x cores-per-rank CPU ids")
    if w.tp > 1 and w.connector_extra.get("pool_master"):
        raise ConfigError(f"{w.name}: tp={w.tp} with the KV pool: the pool supports TP=1 workers only")


def check_tp(cfg: LauncherConfig) -> None:
    """prefill_tp / decode_tp: whole numbers >= 1, disaggregated only; the KV pool needs TP=1 (off by default)."""
    for name in ("prefill_tp", "decode_tp"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r}: use a whole number of tensor-parallel ranks >= 1 (vLLM's "
                              "--tensor-parallel-size)")
    if cfg.colocated and (cfg.prefill_tp > 1 or cfg.decode_tp > 1):
        raise ConfigError("prefill_tp/decode_tp apply to prefill and decode workers: for colocated workers pass "
                          "--worker-args '--tensor-parallel-size N'")
    on_gpus = cfg.gpus_per_worker if cfg.gpus and isinstance(cfg.gpus_per_worker, int) else 1
    if max(cfg.prefill_tp, cfg.decode_tp, on_gpus) > 1:
        if cfg.pool:
            raise ConfigError(f"prefill_tp={cfg.prefill_tp}, decode_tp={cfg.decode_tp}, gpus_per_worker={on_gpus} "
                              "with the KV pool: the pool stores one shard per block and supports TP=1 workers "
                              "only; add --no-pool")
        if cfg.pool is None:
            object.__setattr__(cfg, "pool", False)


def worker_tp(cfg: LauncherConfig, role: str) -> int:
    """Tensor-parallel ranks of a worker of ``role`` (colocated workers: 1, or via worker_args)."""
    return {"prefill": cfg.prefill_tp, "decode": cfg.decode_tp}.get(role, 1)


def gpu_ids(value: Any) -> tuple[str, ...]:
    """GPU ids from YAML or flags: ``[0, 1]``, ``"0,1"``, ``"GPU-uuid"``; ``none`` / ``""`` / ``[]``: no GPU;
    ``auto``: none here (the config stays pure), ``pdserve serve`` then fills in what it discovers."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "cpu", "auto")):
        return ()
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"gpus={value!r}: give GPU ids such as [0, 1] or '0,1' (or none for CPU workers)")
    return tuple(str(v).strip() for v in value)


def check_gpus_and_data_plane(cfg: LauncherConfig) -> None:
    if cfg.kv_connector not in KV_CONNECTORS:
        raise ConfigError(f"kv_connector={cfg.kv_connector!r}: choose pdserve (pdserve's KV connector, the default) "
                          "or nixl (vLLM's NixlConnector)")
    if isinstance(cfg.gpus, (list, str, int)) or cfg.gpus is None:
        object.__setattr__(cfg, "gpus", gpu_ids(cfg.gpus))
    if not all(isinstance(g, str) and g and "," not in g for g in cfg.gpus):
        raise ConfigError(f"gpus={cfg.gpus!r}: give GPU ids such as ('0', '1') or GPU UUIDs")
    if len(set(cfg.gpus)) != len(cfg.gpus):
        raise ConfigError(f"gpus={cfg.gpus!r} lists a GPU twice")
    if isinstance(cfg.gpus_per_worker, bool) or not isinstance(cfg.gpus_per_worker, int) or cfg.gpus_per_worker < 1:
        raise ConfigError(f"gpus_per_worker={cfg.gpus_per_worker!r}: use an integer >= 1")
    if not isinstance(cfg.share_gpu, bool):
        raise ConfigError(f"share_gpu={cfg.share_gpu!r}: true or false")
    check_memory_utilization(cfg.gpu_memory_utilization, "gpu_memory_utilization")
    if cfg.gpus and max(cfg.prefill_tp, cfg.decode_tp) > 1 and cfg.gpus_per_worker != max(cfg.prefill_tp,
                                                                                        cfg.decode_tp):
        raise ConfigError(
            f"prefill_tp={cfg.prefill_tp}, decode_tp={cfg.decode_tp} on GPUs with gpus_per_worker="
            f"{cfg.gpus_per_worker}: on a GPU host every worker gets gpus_per_worker GPUs and runs that many "
            "tensor-parallel ranks; pass --gpus-per-worker N alone (the chart's prefill/decode.tensorParallelSize "
            "sizes the pools apart)")
    if cfg.gpus:
        from .launch.gpus import assign_gpus

        assign_gpus(cfg.num_workers, cfg.gpus, cfg.gpus_per_worker, cfg.share_gpu, cfg.gpu_memory_utilization)


def check_memory_utilization(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{name}={value!r}: the fraction of a GPU's memory vLLM may use, in (0, 1], e.g. 0.9")


def check_worker_gpu(w: WorkerConfig) -> None:
    if w.kv_connector not in KV_CONNECTORS:
        raise ConfigError(f"{w.name}.kv_connector={w.kv_connector!r}: choose one of {KV_CONNECTORS}")
    if not isinstance(w.gpus, tuple) or not all(isinstance(g, str) and g for g in w.gpus):
        raise ConfigError(f"{w.name}.gpus={w.gpus!r}: a tuple of GPU ids (strings)")
    check_memory_utilization(w.gpu_memory_utilization, f"{w.name}.gpu_memory_utilization")
    if w.connector and w.kv_connector == "nixl":
        check_port(f"{w.name}.nixl_side_channel_port", w.nixl_side_channel_port)
        if not w.nixl_side_channel_port:
            raise ConfigError(f"{w.name}.nixl_side_channel_port=0: NixlConnector binds and advertises this port "
                              "(VLLM_NIXL_SIDE_CHANNEL_PORT); give each worker a free one")


def cpu_list_text(cores: tuple[int, ...]) -> str:
    ordered = sorted(set(cores))
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(str(c) for c in ordered)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)``; the format of ``taskset -c`` and ``VLLM_CPU_OMP_THREADS_BIND``."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"CPU list {text!r}: use ids and ranges such as '0,2-3'") from None
    return tuple(out)
