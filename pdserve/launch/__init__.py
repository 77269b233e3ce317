"""Launching a deployment on one machine: the launcher's configs (:mod:`.config`, with :mod:`.config_devices`,
:mod:`.config_gpus`, :mod:`.config_services` read through :mod:`.config_shapes`), a pure plan (:mod:`.plan`,
:mod:`.commands`), the cluster that runs it (:mod:`.cluster`), its child processes (:mod:`.procs`, :mod:`.deathsig`,
:mod:`.warm_start`, :mod:`.ports`) and the models it serves (:mod:`.models`).

The names below are loaded on first use, so that importing one module of the package (the warm starter's
``python -m pdserve.launch.warm_start``, a test's :mod:`.models`) does not import the whole launcher."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from .procs import LaunchError

_HOME = {
    "cluster": ["Cluster", "allocate_ports", "memory_warning", "new_run_dir", "resolve_model", "usage_text"],
    "commands": ["kv_events_config", "kv_transfer_config", "pool_master_argv", "pool_node_argv", "router_command",
                 "served_name", "worker_argv", "worker_env"],
    "plan": ["Plan", "PoolPlan", "Ports", "ProcessSpec", "dry_run_ports", "make_plan", "plan_pool", "plan_workers",
             "router_env", "worker_command"],
    "procs": ["LaunchError"],
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = [
    "Cluster", "LaunchError", "Plan", "PoolPlan", "Ports", "ProcessSpec", "allocate_ports", "dry_run_ports",
    "kv_events_config", "kv_transfer_config", "make_plan", "memory_warning", "new_run_dir", "plan_pool",
    "plan_workers", "pool_master_argv", "pool_node_argv", "resolve_model", "router_command", "router_env",
    "served_name", "usage_text", "worker_argv", "worker_command", "worker_env",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
