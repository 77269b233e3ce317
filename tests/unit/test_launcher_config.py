"""LauncherConfig / WorkerConfig validation: wrong values fail with messages that say how to fix them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.launch.config import ConfigError, LauncherConfig, WorkerConfig, default_model_dir, parse_cpu_list

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return d


def test_defaults_are_one_prefill_one_decode_with_connector():
    c = LauncherConfig()
    assert (c.prefill, c.decode, c.colocated) == (1, 1, 0)
    assert c.mode == "disaggregated" and c.num_workers == 2 and c.connector is True
    assert (c.host, c.port) == ("127.0.0.1", 8000)
    assert c.model_dir == default_model_dir()


def test_colocated_mode_zeroes_pools_and_drops_connector():
    c = LauncherConfig(colocated=3)
    assert (c.prefill, c.decode, c.num_workers, c.mode, c.connector) == (0, 0, 3, "colocated", False)
    assert LauncherConfig(colocated=1, connector=True).connector is True


@pytest.mark.parametrize("kwargs, needle", [
    (dict(colocated=1, prefill=2), "choose one mode"),
    (dict(prefill=0), "at least one of each"),
    (dict(decode=0), "at least one of each"),
    (dict(prefill=-1), "whole number of workers"),
    (dict(port=70000), "port"),
    (dict(kv_cache_gib=0), "whole GiB"),
    (dict(kv_cache_gib=1.5), "whole GiB"),
    (dict(max_model_len=4), "max_model_len"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(dtype="fp8"), "bfloat16"),
    (dict(cores=(0, 0)), "twice"),
    (dict(cores=(-1,)), "CPU ids"),
    (dict(cores=(0, 1), cores_per_worker=3), "cores_per_worker"),
    (dict(cores_per_worker=0), "cores_per_worker"),
    (dict(lease_s=0), "lease_s"),
    (dict(connector=False), "needs the connector"),
    (dict(connector_extra={"secret": "x" * 32}), "PDSERVE_TRANSFER_SECRET"),
    (dict(worker_args=("--x", 3)), "list of strings"),
    (dict(connector_extra={"bogus": 1}), "unknown keys"),
    (dict(connector_extra={"backend": "carrier-pigeon"}), "backend"),
    (dict(lease_s=1e9), "lease_s"),
    (dict(connector_extra={"transfer_port": 9999}), "shared by 2 workers"),
    (dict(env={"A": 1}), "string values"),
    (dict(worker_timeout_s=0), "positive"),
    (dict(model="/definitely/not/here"), "does not exist"),
])
def test_bad_values_say_how_to_fix(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        LauncherConfig(**kwargs)


def test_model_folder_must_hold_config_json(tmp_path, model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        LauncherConfig(model=str(empty))
    assert LauncherConfig(model=str(model_dir)).model_dir == model_dir


def test_from_mapping_rejects_unknown_keys_with_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'prefill'"):
        LauncherConfig.from_mapping({"prefil": 2})
    with pytest.raises(ConfigError, match="known keys"):
        LauncherConfig.from_mapping({"zzzzzz": 2})
    c = LauncherConfig.from_mapping({"max-model-len": 1024, "cores": "0-1", "worker_args": "--max-num-seqs 8",
                                     "env": {"X": 1}})
    assert c.max_model_len == 1024 and c.cores == (0, 1)
    assert c.worker_args == ("--max-num-seqs", "8") and dict(c.env) == {"X": "1"}


def test_yaml_file_and_overrides(tmp_path, model_dir):
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {model_dir}\nprefill: 2\ndecode: 1\nport: 9100\ncores: [0, 1]\n")
    c = LauncherConfig.from_yaml(f)
    assert (c.prefill, c.decode, c.port, c.cores) == (2, 1, 9100, (0, 1))
    assert LauncherConfig.from_yaml(f, port=9200).port == 9200
    # a --colocated flag replaces the file's prefill/decode counts instead of clashing with them
    c = LauncherConfig.from_yaml(f, colocated=1)
    assert (c.colocated, c.prefill, c.decode) == (1, 0, 0)
    g = tmp_path / "g.yaml"
    g.write_text("colocated: 2\n")
    assert LauncherConfig.from_yaml(g, prefill=1).mode == "disaggregated"


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        LauncherConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        LauncherConfig.from_yaml(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("prefil: 1\n")
    with pytest.raises(ConfigError, match=r"wrong.yaml: unknown setting 'prefil'"):
        LauncherConfig.from_yaml(wrong)


def test_example_yaml_is_valid():
    c = LauncherConfig.from_yaml(ROOT / "deploy" / "pdserve.example.yaml")
    assert c == LauncherConfig()


def test_worker_config_validation_and_omp_bind():
    w = WorkerConfig(role="prefill", index=0, model="/m", port=8100, cores=(0,))
    assert (w.name, w.url, w.omp_bind) == ("prefill0", "http://127.0.0.1:8100", "0")
    assert WorkerConfig(role="decode", index=1, model="/m", cores=(2, 3)).omp_bind == "2-3"
    assert WorkerConfig(role="decode", index=1, model="/m", cores=(0, 2)).omp_bind == "0,2"
    with pytest.raises(ConfigError, match="role"):
        WorkerConfig(role="both", index=0, model="/m", cores=(0,))
    with pytest.raises(ConfigError, match="cores"):
        WorkerConfig(role="decode", index=0, model="/m", cores=())
    with pytest.raises(ConfigError, match="decode0.kv_cache_gib"):
        WorkerConfig(role="decode", index=0, model="/m", cores=(0,), kv_cache_gib=0)


def test_parse_cpu_list():
    assert parse_cpu_list("0,2-4, 7") == (0, 2, 3, 4, 7)
    with pytest.raises(ConfigError, match="0,2-3"):
        parse_cpu_list("3-1")
    with pytest.raises(ConfigError):
        parse_cpu_list("a")
