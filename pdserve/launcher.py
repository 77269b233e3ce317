"""Compatibility name for :mod:`pdserve.launch`: the plan (:mod:`pdserve.launch.plan`) and the cluster that runs
it (:mod:`pdserve.launch.cluster`). Tests, benchmarks and scripts import :class:`Cluster` from here."""

from .launch import (
    Cluster,
    LaunchError,
    Plan,
    PoolPlan,
    Ports,
    ProcessSpec,
    allocate_ports,
    dry_run_ports,
    kv_events_config,
    kv_transfer_config,
    make_plan,
    memory_warning,
    new_run_dir,
    plan_pool,
    plan_workers,
    pool_master_argv,
    pool_node_argv,
    resolve_model,
    router_command,
    router_env,
    served_name,
    usage_text,
    worker_argv,
    worker_command,
    worker_env,
)

__all__ = [
    "Cluster", "LaunchError", "Plan", "PoolPlan", "Ports", "ProcessSpec", "allocate_ports", "dry_run_ports",
    "kv_events_config", "kv_transfer_config", "make_plan", "memory_warning", "new_run_dir", "plan_pool",
    "plan_workers", "pool_master_argv", "pool_node_argv", "resolve_model", "router_command", "router_env",
    "served_name", "usage_text", "worker_argv", "worker_command", "worker_env",
]
