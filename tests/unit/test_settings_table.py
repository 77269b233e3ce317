"""The table of settings is the one source: the configs' defaults and fields, both command lines, the router
argv the launcher writes and what the router hands to the conductor all agree with it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.cli import build_parser as serve_parser
from pdserve.cli import config_from_args as serve_config
from pdserve.conductor.config import ConductorConfig, ConductorConfigError
from pdserve.conductor.moves import MoveConfig
from pdserve.launch import make_plan
from pdserve.launch.config import LauncherConfig, WorkerConfig
from pdserve.router.__main__ import build_parser as router_parser
from pdserve.router.__main__ import config_from_args as router_config
from pdserve.router.config import RouterConfig
from pdserve.settings import SETTINGS, ConfigError, of, setting
from pdserve.settings.argv import flag_words, router_flags
from pdserve.settings.targets import handed_on, settings_of
from pdserve.store.config import StoreConfigError


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("cls, process", [(LauncherConfig, "launcher"), (RouterConfig, "router"),
                                          (WorkerConfig, "worker")])
def test_every_setting_of_a_process_is_a_field_with_the_tables_default(cls, process):
    fields = _defaults(cls)
    for s in of(process):
        if process == "worker" and s.name not in fields:
            continue  # a worker gets some settings from the launcher's plan only (none so far)
        assert s.name in fields, f"{cls.__name__} lacks {s.name}"
        if s.name != "connector":  # a worker's connector is decided by the plan (the launcher's may be unset)
            assert fields[s.name] == s.default_for(process), s.name


def test_conductor_fields_and_defaults_come_from_the_table():
    fields = _defaults(ConductorConfig)
    table = {s.name: s.default for s in settings_of("conductor")}
    assert set(table) <= set(fields)
    assert {k: fields[k] for k in table} == table
    assert table["policy"] == "conductor" and setting("policy").default == "round_robin"


def test_one_declaration_per_name_and_every_argv_setting_reaches_the_router():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    assert all("router" in s.processes for s in SETTINGS if s.argv)
    for s in SETTINGS:
        assert s.help and s.processes


def test_router_flags_are_the_tables():
    dests = {a.dest for a in router_parser()._actions}
    assert {s.name for s in of("router")} <= dests
    a = router_parser().parse_args(["--model-dir", "m"])
    for s in of("router"):
        assert getattr(a, s.name) == s.default_for("router"), s.name


def test_launcher_writes_what_the_router_reads_back(model_dir):
    cfg = LauncherConfig(model=model_dir, policy="conductor", ttft_slo_ms=750, tpot_slo_ms=42.5,
                         kv_connector="pdserve", max_model_len=1024, pool=False)
    argv = list(make_plan(cfg, model_dir).router_argv)
    rc = router_config(argv[3:])
    for name in ("policy", "ttft_slo_ms", "tpot_slo_ms", "kv_connector", "max_model_len"):
        assert getattr(rc, name) == getattr(cfg, name), name
    assert rc.kv_events_bind == "" and rc.served_model_name == cfg.model_dir.name
    assert [e.split("=")[0] for e in rc.kv_events] == [rc.prefill[0], rc.decode[0]]  # each worker's publisher


def test_argv_rules():
    assert router_flags({"policy": "round_robin", "ttft_slo_ms": None, "kv_connector": "pdserve",
                         "kv_events_bind": ""}) == ["--policy", "round_robin"]
    assert router_flags({"kv_connector": "nixl", "tpot_slo_ms": 50.0, "moves": False}) == [
        "--tpot-slo-ms", "50.0", "--kv-connector", "nixl"]  # moves: the launcher never writes it (argv "")
    assert flag_words(setting("moves"), False) == ["--no-moves"] and flag_words(setting("moves"), True) == []


def test_the_conductor_gets_the_slos_in_seconds(model_dir):
    rc = RouterConfig(model_dir=model_dir, colocated=("http://a:1",), policy="conductor", ttft_slo_ms=500,
                      tpot_slo_ms=50.5, max_inflight_per_worker=None, max_num_batched_tokens=256, moves=False)
    kw = handed_on(rc, "conductor")
    assert kw == {"policy": "conductor", "ttft_slo_s": 0.5, "tpot_slo_s": 50.5 / 1000.0, "local_prefill_tokens": None,
                  "block_size": 128, "chunk_tokens": 256, "max_inflight_per_worker": None,
                  "replicas": 1, "recalibration_window": 0, "tier_pricing": "priced"}
    assert ConductorConfig(**kw).tpot_slo_s == 0.0505
    assert MoveConfig(**handed_on(rc, "moves")).enabled is False


def test_one_config_error_hierarchy():
    assert issubclass(StoreConfigError, ConfigError) and issubclass(ConductorConfigError, ConfigError)
    from pdserve.vllm import params

    assert params.ConfigError is ConfigError


@pytest.mark.parametrize("value", [0.05, 5000, "x"])
def test_lease_s_is_checked_by_one_rule_everywhere(value):
    from pdserve.settings.connector import ConnectorConfig

    with pytest.raises(ConfigError, match="lease_s=.*use 0.1 to 3600"):
        LauncherConfig(lease_s=value)
    with pytest.raises(ConfigError, match="kv_connector_extra_config.lease_s=.*use 0.1 to 3600"):
        ConnectorConfig.from_extra({"lease_s": value}, env={"PDSERVE_TRANSFER_SECRET": "s" * 32})
    assert ConnectorConfig.from_extra({}, env={"PDSERVE_TRANSFER_SECRET": "s" * 32}).lease_s == \
        setting("lease_s").default == LauncherConfig().lease_s == 30.0


def test_serve_flags_are_the_tables_and_only_given_ones_override():
    dests = {a.dest for a in serve_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert {s.name for s in of("launcher") if s.on_cli} <= dests
    args = serve_parser().parse_args(["serve", "--colocated", "2", "--lease-s", "12", "--no-pool",
                                      "--gpus", "none"])
    cfg = serve_config(args, discover=lambda: ())
    assert (cfg.colocated, cfg.lease_s, cfg.pool, cfg.policy) == (2, 12.0, False, "round_robin")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["serve", "--port", "-1"])
