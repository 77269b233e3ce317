"""Multi-LoRA through P and D (issue 25, item 3), on prefill0 and decode0 of the shared conductor launch
(tests/integration/conftest.py: ``pd_conductor``, whose workers load one random adapter) behind a router this module
starts with ``--lora-modules``: the
cases are in tests/integration/lora_pd.py. The router refuses prompt scoring with LoRA on (vLLM 0.32's engine dies
on it), which is checked against the real workers too."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.launch.procs import free_port, spawn, stop_children

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(600),
]  # shares pd_conductor (tests/conftest.py: SHARED_STACKS)

ROOT = Path(__file__).resolve().parents[2]


def _start_router(cfg, p: str, d: str, log: Path, *extra: str):
    """A router on P and D with the launch's adapters; its URL once its /health is 200."""
    port = free_port()
    router = spawn("router", [sys.executable, "-m", "pdserve.router", "--model-dir", cfg.model, "--port",
                              str(port), "--served-model-name", cfg.served_model_name, "--max-model-len", "2048",
                              "--prefill", p, "--decode", d, "--lora-modules", cfg.lora_modules, *extra], cwd=ROOT,
                   log_path=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert router.proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return router, url
        except OSError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stack(pd_conductor, tmp_path_factory):
    cfg = pd_conductor.config
    p, d = (pd_conductor.worker_urls(role)[0] for role in ("prefill", "decode"))
    router, url = _start_router(cfg, p, d, tmp_path_factory.mktemp("lora-router") / "router.log")
    try:
        yield url, d, cfg.lora_modules, cfg.served_model_name
    finally:
        stop_children([router], timeout_s=15)


def test_lora_adapter_through_pd_equals_one_worker(stack):
    """model=<adapter> runs on P and D and equals D alone with the adapter (streamed and not), unlike the base
    model; /v1/load_lora_adapter and /v1/unload_lora_adapter reach both workers."""
    from tests.integration.lora_pd import run_lora_cases

    router, decode, lora_modules, base = stack
    run_lora_cases(router, decode, lora_modules, base=base)


def test_prompt_scoring_with_lora_on_is_refused_and_the_workers_live(stack):
    router, decode, _, base = stack
    body = {"model": base, "prompt": "a b c", "max_tokens": 2, "prompt_logprobs": 1}
    req = urllib.request.Request(router + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "prompt_logprobs"
    with urllib.request.urlopen(decode + "/health", timeout=10) as r:
        assert r.status == 200


def test_a_runtime_adapter_reaches_every_router_replica(pd_conductor, tmp_path):
    """Two router replicas sharing a membership file (as ``pdserve serve --routers 2`` starts them): an adapter
    loaded through one is listed by the other within its poll and runs there through P -> D as on D alone; an
    unload through the other takes it off the first."""
    from pdserve.settings.lora import parse_lora_modules
    from tests.integration.lora_pd import ADAPTER, check_runtime_load_reaches_replicas

    cfg = pd_conductor.config
    p, d = (pd_conductor.worker_urls(role)[0] for role in ("prefill", "decode"))
    shared = ("--membership-file", str(tmp_path / "membership.json"))
    routers = []
    try:
        for name in ("a", "b"):
            routers.append(_start_router(cfg, p, d, tmp_path / f"router-{name}.log", *shared))
        check_runtime_load_reaches_replicas(routers[0][1], routers[1][1], d,
                                            parse_lora_modules(cfg.lora_modules)[ADAPTER], cfg.served_model_name)
    finally:
        stop_children([r for r, _ in routers], timeout_s=15)
