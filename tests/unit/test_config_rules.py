"""The policy, SLO and decode-local rules are the table's (pdserve.settings): the launcher, router and conductor
configs all apply them, each under its own names (a field, a flag, the conductor's field in seconds) and error
class (all subclasses of the one ConfigError), and all give the same advice."""

from __future__ import annotations

import json

import pytest

from pdserve import settings
from pdserve.conductor.config import POLICIES, ConductorConfig, ConductorConfigError
from pdserve.launch.config import ConfigError, LauncherConfig
from pdserve.router.config import RouterConfig, RouterConfigError


@pytest.fixture
def router_dir(tmp_path) -> str:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(tmp_path)


def _message(error: type[Exception], build) -> str:
    with pytest.raises(error) as info:
        build()
    return str(info.value)


def test_one_policy_list_and_one_error_class():
    assert POLICIES is settings.POLICIES
    assert ConfigError is settings.ConfigError
    assert issubclass(RouterConfigError, ConfigError) and issubclass(ConductorConfigError, ConfigError)


def test_bad_policy_same_advice_everywhere(router_dir):
    launcher = _message(ConfigError, lambda: LauncherConfig(policy="random"))
    router = _message(RouterConfigError, lambda: RouterConfig(model_dir=router_dir, colocated=("http://a:1",),
                                                              policy="random"))
    conductor = _message(ConductorConfigError, lambda: ConductorConfig(policy="random"))
    assert launcher.startswith("policy='random'") and router.startswith("--policy 'random'")
    assert conductor.startswith("policy='random'")
    advice = launcher.split(": ", 1)[1]
    assert "round_robin, least_loaded, conductor" in advice
    assert router.split(": ", 1)[1] == advice == conductor.split(": ", 1)[1]


@pytest.mark.parametrize("value", [0, -5, "fast", True])
def test_bad_slo_same_advice_everywhere(router_dir, value):
    launcher = _message(ConfigError, lambda: LauncherConfig(policy="conductor", ttft_slo_ms=value))
    router = _message(RouterConfigError, lambda: RouterConfig(model_dir=router_dir, colocated=("http://a:1",),
                                                              tpot_slo_ms=value))
    conductor = _message(ConductorConfigError, lambda: ConductorConfig(ttft_slo_s=value))
    assert launcher.startswith(f"ttft_slo_ms={value!r}: a target in ms > 0")
    assert router.startswith(f"--tpot-slo-ms {value!r}: a target in ms > 0")
    assert conductor.startswith(f"ttft_slo_s={value!r}: a target in seconds > 0")
    assert all("429" in m for m in (launcher, router, conductor))


def test_slo_needs_the_conductor_in_the_launcher():
    with pytest.raises(ConfigError, match="needs policy=conductor"):
        LauncherConfig(tpot_slo_ms=50)
    assert LauncherConfig(policy="conductor", ttft_slo_ms=500, tpot_slo_ms=50.5).tpot_slo_ms == 50.5


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_bad_local_prefill_tokens_same_advice(router_dir, value):
    router = _message(RouterConfigError, lambda: RouterConfig(model_dir=router_dir, colocated=("http://a:1",),
                                                              local_prefill_tokens=value))
    conductor = _message(ConductorConfigError, lambda: ConductorConfig(local_prefill_tokens=value))
    assert router.startswith(f"--local-prefill-tokens {value!r}:")
    assert router.split(": ", 1)[1] == conductor.split(": ", 1)[1]
    assert "learn" in router


def test_good_values_pass():
    for p in POLICIES:
        settings.setting("policy").check(p)
    settings.setting("ttft_slo_ms").check(None)
    settings.setting("ttft_slo_ms").check(0.5)
    settings.setting("local_prefill_tokens").check(None)
    settings.setting("local_prefill_tokens").check(0)
    assert ConductorConfig(local_prefill_tokens=0, ttft_slo_s=1.0).local_prefill_tokens == 0
