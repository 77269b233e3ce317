"""The connector's pool pieces without vLLM: object layout, partial loads, config keys (the send gate: test_vllm_release.py)."""

from __future__ import annotations

import pytest

from pdserve.vllm.params import ConfigError, ConnectorConfig, LayerGeometry
from pdserve.vllm.pool import loaded_prefix, pool_items

SECRET = "unit-test-secret-0123"


def test_pool_items_one_range_per_layer_in_block_order() -> None:
    layers = [LayerGeometry("l0", 1000, 600), LayerGeometry("l1", 2000, 800)]
    items = pool_items(layers, [11, 12], [3, 5])
    assert items == [(11, [("l0", 3000, 600), ("l1", 6000, 800)]), (12, [("l0", 5000, 600), ("l1", 10000, 800)])]


def test_loaded_prefix_stops_at_first_gap() -> None:
    assert loaded_prefix([True, True, False, True]) == 2
    assert loaded_prefix([True] * 3) == 3
    assert loaded_prefix([False, True]) == 0


def test_pool_config_keys() -> None:
    cfg = ConnectorConfig.from_extra({"secret": SECRET, "pool_master": "127.0.0.1:7600", "pool_save": "false"})
    assert cfg.pool_address == ("127.0.0.1", 7600) and not cfg.pool_save and cfg.pool_load
    assert ConnectorConfig.from_extra({"secret": SECRET}).pool_address is None
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ConnectorConfig.from_extra({"secret": SECRET, "pool_master": "localhost"})
    with pytest.raises(ConfigError, match="pool_min_blocks"):
        ConnectorConfig.from_extra({"secret": SECRET, "pool_min_blocks": 0})


def test_pool_keys_have_the_request_domain() -> None:
    """A salted or adapter request's pool keys start from its domain root, as the router's and the conductor's do:
    it never loads blocks another salt pooled."""
    from types import SimpleNamespace

    from pdserve.hashing import ROOT_KEY, domain_root
    from pdserve.vllm.scheduler import key_domain

    plain = SimpleNamespace(cache_salt=None, lora_request=None)
    salted = SimpleNamespace(cache_salt="tenant-a", lora_request=None)
    adapter = SimpleNamespace(cache_salt="tenant-a", lora_request=SimpleNamespace(lora_name="ad"))
    assert key_domain(plain) == ROOT_KEY
    assert key_domain(salted) == domain_root("tenant-a") != key_domain(plain)
    assert key_domain(adapter) == domain_root("tenant-a", "ad") != key_domain(salted)
