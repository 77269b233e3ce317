"""`pdserve serve` plans a KV pool (master + one node) by default with the connector, and none without."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.launch import kv_transfer_config, make_plan
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.store.cli import add_serve_flags


def test_pool_planned_by_default_and_every_connector_points_at_it() -> None:
    cfg = LauncherConfig(port=0, pool_mem="256MiB", pool_disk="1GiB", pool_disk_dir="/data/ssd")
    plan = make_plan(cfg, Path("/tmp/model"))
    assert plan.pool_port and plan.pool_port not in {w.port for w in plan.workers}
    for w in plan.workers:
        extra = kv_transfer_config(w)["kv_connector_extra_config"]
        assert extra["pool_master"] == f"127.0.0.1:{plan.pool_port}"
    (m_name, master), (n_name, node) = [(p.name, list(p.argv)) for p in plan.of_kind("pool")]
    assert (m_name, n_name) == ("pool-master", "pool-node")
    assert master[master.index("--port") + 1] == str(plan.pool_port)
    assert node[node.index("--mem") + 1] == "256MiB" and node[node.index("--disk-dir") + 1] == "/data/ssd"
    assert plan.pool is not None and not plan.pool.owns_disk_dir  # the user's folder: never removed


def test_pool_off_and_colocated_default() -> None:
    plan = make_plan(LauncherConfig(port=0, pool=False), Path("/tmp/model"))
    assert plan.pool_port == 0 and plan.pool is None and plan.of_kind("pool") == []
    assert all("pool_master" not in w.connector_extra for w in plan.workers)
    assert LauncherConfig(colocated=1).pool is False
    assert LauncherConfig(colocated=1, connector=True).pool is True
    with pytest.raises(ConfigError, match="needs the connector"):
        LauncherConfig(colocated=1, pool=True)
    with pytest.raises(ConfigError, match="pool_disk"):
        LauncherConfig(pool_disk="lots")


def test_serve_flags_map_onto_launcher_fields() -> None:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    args = vars(p.parse_args(["--no-pool", "--pool-mem", "2GiB"]))
    assert args == {"pool": False, "pool_mem": "2GiB"}
    assert LauncherConfig.from_mapping(args).pool is False


def test_conductor_router_follows_the_pool() -> None:
    plan = make_plan(LauncherConfig(port=0, policy="conductor"), Path("/tmp/model"))
    argv = list(plan.router_argv)
    assert argv[argv.index("--pool-master") + 1] == f"127.0.0.1:{plan.pool_port}"
    assert "--pool-master" not in make_plan(LauncherConfig(port=0), Path("/tmp/model")).router_argv
    assert "--pool-master" not in make_plan(LauncherConfig(port=0, policy="conductor", pool=False),
                                            Path("/tmp/model")).router_argv
