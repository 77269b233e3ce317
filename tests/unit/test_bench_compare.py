"""Configuration names -> launcher configs, and workload plans for a comparison (no processes)."""

from __future__ import annotations

import pytest

from pdserve.bench.compare import CompareSettings, launcher_config, plan_workloads
from pdserve.launch.config import ConfigError, LauncherConfig


def test_config_names():
    s = CompareSettings(model="", cores=(0, 1), max_model_len=2048)
    c2 = launcher_config("colocated2", s)
    assert c2.colocated == 2 and c2.cores_per_worker == 1 and c2.max_model_len == 2048 and c2.port == 0
    c1 = launcher_config("colocated1", s)
    assert c1.colocated == 1 and c1.cores_per_worker == 2
    pd = launcher_config("1p2d", s)
    assert (pd.prefill, pd.decode, pd.cores_per_worker, pd.connector) == (1, 2, 1, True)
    with pytest.raises(ConfigError, match="unknown"):
        launcher_config("2x2", s)


def test_policy_suffix():
    s = CompareSettings(cores=(0, 1))
    if "policy" in LauncherConfig.__dataclass_fields__:
        assert launcher_config("1p1d-least_loaded", s).policy == "least_loaded"
    else:
        with pytest.raises(ConfigError, match="policy"):
            launcher_config("1p1d-conductor", s)


def test_plan_workloads_rates_and_seeds():
    plans = plan_workloads(["poisson:rate=1,name=short", "trace:seed=5"], [0.5, 1.0])
    assert [p.label for p in plans] == ["short@0.5", "short@1", "trace:seed=5@0.5", "trace:seed=5@1"]
    assert [p.overrides.get("seed") for p in plans] == [0, 1, None, None]
    assert plans[1].rate == 1.0
    assert plan_workloads(["poisson:rate=3"])[0].rate == 3.0


def test_plane_and_pool_words():
    s = CompareSettings(cores=(0, 1))
    assert launcher_config("1p1d", s).kv_connector == "pdserve"
    nixl = launcher_config("1p1d-nixl", s)
    assert (nixl.kv_connector, nixl.pool) == ("nixl", False)
    nopool = launcher_config("1p1d-nopool", s)
    assert (nopool.kv_connector, nopool.pool) == ("pdserve", False)
    assert launcher_config("1p1d-pool", s).pool is True
    store = launcher_config("2p1d-mooncake-store-conductor", s)
    assert (store.prefill, store.kv_connector, store.pool, store.pool_backend, store.policy) == (
        2, "mooncake", True, "mooncake", "conductor")
    unchecked = launcher_config("1p1d-nopool-nocheck", s)
    assert (unchecked.pool, unchecked.kv_checksum, launcher_config("1p1d", s).kv_checksum) == (False, False, True)
    with pytest.raises(ConfigError, match="two plane words"):
        launcher_config("1p1d-nixl-mooncake", s)
    with pytest.raises(ConfigError, match="pool_backend=mooncake with kv_connector='pdserve'"):
        launcher_config("1p1d-store", s)  # Mooncake Store needs vLLM's connector next to it
