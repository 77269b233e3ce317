"""Launching a deployment on one machine: a pure plan (:mod:`.plan`, :mod:`.commands`) and the cluster that
runs it (:mod:`.cluster`)."""

from ..procs import LaunchError
from .cluster import Cluster, allocate_ports, memory_warning, new_run_dir, resolve_model, usage_text
from .commands import (
    kv_events_config,
    kv_transfer_config,
    pool_master_argv,
    pool_node_argv,
    router_command,
    served_name,
    worker_argv,
    worker_env,
)
from .plan import (
    Plan,
    PoolPlan,
    Ports,
    ProcessSpec,
    dry_run_ports,
    make_plan,
    plan_pool,
    plan_workers,
    router_env,
    worker_command,
)

__all__ = [
    "Cluster", "LaunchError", "Plan", "PoolPlan", "Ports", "ProcessSpec", "allocate_ports", "dry_run_ports",
    "kv_events_config", "kv_transfer_config", "make_plan", "memory_warning", "new_run_dir", "plan_pool",
    "plan_workers", "pool_master_argv", "pool_node_argv", "resolve_model", "router_command", "router_env",
    "served_name", "usage_text", "worker_argv", "worker_command", "worker_env",
]
