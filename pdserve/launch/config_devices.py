"""Where a worker runs, as configured: tensor-parallel ranks (CPU core lists per rank, or one GPU per rank), the
GPUs of a GPU host and the KV data plane (pdserve's connector or vLLM's NixlConnector). The checks of
:class:`~pdserve.launch.config.LauncherConfig` and :class:`~pdserve.launch.config.WorkerConfig` for these fields."""

from __future__ import annotations

from typing import Any

from ..settings import ConfigError, setting
from .config_gpus import assign_gpus
from .config_shapes import LaunchShape, WorkerShape


def check_worker_tp(w: WorkerShape) -> None:
    if not isinstance(w.tp, int) or isinstance(w.tp, bool) or w.tp < 1:
        raise ConfigError(f"{w.name}.tp={w.tp!r}: use a whole number of tensor-parallel ranks >= 1")
    if w.tp > 1 and not w.gpus and len(w.cores) % w.tp:
        raise ConfigError(f"{w.name}.cores={w.cores!r} cannot be split evenly over tp={w.tp} ranks: give "
                          f"{w.tp} x cores-per-rank CPU ids")
    if w.tp > 1 and w.connector_extra.get("pool_master"):
        raise ConfigError(f"{w.name}: tp={w.tp} with the KV pool: the pool supports TP=1 workers only")


def tensor_parallel(cfg: LaunchShape, gpus: tuple[str, ...] | None = None) -> bool:
    """Some worker runs more than one tensor-parallel rank (then the KV pool is off unless asked for);
    ``gpus``: the launch's GPU ids when ``cfg.gpus`` is not normalised yet."""
    on_gpus = cfg.gpus_per_worker if (cfg.gpus if gpus is None else gpus) else 1
    return max(cfg.prefill_tp, cfg.decode_tp, on_gpus) > 1


def check_tp(cfg: LaunchShape) -> None:
    """prefill_tp / decode_tp (checked by the table): disaggregated only; the KV pool needs TP=1."""
    if cfg.colocated and (cfg.prefill_tp > 1 or cfg.decode_tp > 1):
        raise ConfigError("prefill_tp/decode_tp apply to prefill and decode workers: for colocated workers pass "
                          "--worker-args '--tensor-parallel-size N'")
    on_gpus = cfg.gpus_per_worker if cfg.gpus else 1
    if tensor_parallel(cfg) and cfg.pool:
        raise ConfigError(f"prefill_tp={cfg.prefill_tp}, decode_tp={cfg.decode_tp}, gpus_per_worker={on_gpus} "
                          "with the KV pool: the pool stores one shard per block and supports TP=1 workers "
                          "only; add --no-pool")


def worker_tp(cfg: LaunchShape, role: str) -> int:
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


def check_gpus_and_data_plane(cfg: LaunchShape) -> None:
    """GPU ids (normalised by the config from a list or text), TP on GPUs, and the GPU plan itself."""
    if not isinstance(cfg.gpus, tuple) or not all(isinstance(g, str) and g and "," not in g for g in cfg.gpus):
        raise ConfigError(f"gpus={cfg.gpus!r}: give GPU ids such as ('0', '1') or GPU UUIDs")
    if len(set(cfg.gpus)) != len(cfg.gpus):
        raise ConfigError(f"gpus={cfg.gpus!r} lists a GPU twice")
    ranks = max(cfg.prefill_tp * cfg.prefill_dp, cfg.decode_tp * cfg.decode_dp)
    if cfg.gpus and ranks > 1 and cfg.gpus_per_worker != ranks:
        raise ConfigError(
            f"prefill_tp={cfg.prefill_tp}, decode_tp={cfg.decode_tp} (x dp {cfg.prefill_dp}, {cfg.decode_dp}) on "
            f"GPUs with gpus_per_worker={cfg.gpus_per_worker}: on a GPU host every worker gets gpus_per_worker GPUs "
            "and runs that many ranks (TP x DP); pass --gpus-per-worker N alone (the chart's "
            "prefill/decode.tensorParallelSize and dataParallelSize size the pools apart)")
    if cfg.gpus:
        assign_gpus(cfg.num_workers, cfg.gpus, cfg.gpus_per_worker, cfg.share_gpu, cfg.gpu_memory_utilization)


def check_worker_gpu(w: WorkerShape) -> None:
    """A worker's GPU ids and its vLLM connector's side channel: NixlConnector's handshake port or MooncakeConnector's
    bootstrap port (kv_connector and the memory fraction: the table)."""
    if not isinstance(w.gpus, tuple) or not all(isinstance(g, str) and g for g in w.gpus):
        raise ConfigError(f"{w.name}.gpus={w.gpus!r}: a tuple of GPU ids (strings)")
    if w.connector and w.kv_connector == "nixl":
        setting("port").check(w.nixl_side_channel_port, f"{w.name}.nixl_side_channel_port")
        if not w.nixl_side_channel_port:
            raise ConfigError(f"{w.name}.nixl_side_channel_port=0: NixlConnector binds and advertises this port "
                              "(VLLM_NIXL_SIDE_CHANNEL_PORT); give each worker a free one")
    if w.connector and w.kv_connector == "mooncake":
        setting("port").check(w.mooncake_bootstrap_port, f"{w.name}.mooncake_bootstrap_port")
        if not w.mooncake_bootstrap_port:
            raise ConfigError(f"{w.name}.mooncake_bootstrap_port=0: MooncakeConnector's bootstrap server binds this "
                              "port (VLLM_MOONCAKE_BOOTSTRAP_PORT) and D finds P there; give each worker a free one")


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
