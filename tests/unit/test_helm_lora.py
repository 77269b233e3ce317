"""deploy/helm/pdserve with LoRA adapters (lora.*): every worker pool gets vLLM's --enable-lora, rank, count and
--lora-modules NAME=PATH words plus VLLM_ALLOW_RUNTIME_LORA_UPDATING; the router gets the same list as its
--lora-modules, which its own parser and config accept; bad values are refused by the schema."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.test_helm_chart import FULL, HELM, INSTALL_HINT, helm_template

pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm binary not found: {INSTALL_HINT}")

MODULES = ("lora.modules[0].name=sql", "lora.modules[0].path=/models/loras/sql",
           "lora.modules[1].name=chat", "lora.modules[1].path=org/chat-lora")


def _render(*sets: str) -> list[dict]:
    out = helm_template(sets=sets)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _container(docs: list[dict], deployment: str, name: str) -> dict:
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULL}-{deployment}")
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


@pytest.mark.parametrize("pools", [("prefill", "decode"), ("elastic",)])
def test_every_worker_loads_the_adapters_and_the_router_lists_them(pools):
    from pdserve.router.__main__ import build_parser as router_parser
    from pdserve.settings.lora import parse_lora_modules

    extra = ("elastic.replicas=2",) if pools == ("elastic",) else ()
    docs = _render(*MODULES, "lora.maxLoraRank=32", "lora.maxLoras=2", *extra)
    for pool in pools:
        c = _container(docs, pool, "vllm")
        args = c["args"]
        assert "--enable-lora" in args
        assert args[args.index("--max-lora-rank") + 1] == "32" and args[args.index("--max-loras") + 1] == "2"
        i = args.index("--lora-modules")
        assert args[i + 1:i + 3] == ["sql=/models/loras/sql", "chat=org/chat-lora"]
        assert _env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    router = _container(docs, "router", "router")
    a = router_parser().parse_args(router["args"])
    assert parse_lora_modules(a.lora_modules) == {"sql": "/models/loras/sql", "chat": "org/chat-lora"}


def test_lora_off_by_default_and_on_without_adapters():
    from pdserve.router.__main__ import build_parser as router_parser

    docs = _render()
    for pool in ("prefill", "decode"):
        c = _container(docs, pool, "vllm")
        assert not any("lora" in a for a in c["args"]) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in _env(c)
    assert not any("lora" in a for a in _container(docs, "router", "router")["args"])
    docs = _render("lora.enabled=true")
    c = _container(docs, "decode", "vllm")
    assert "--enable-lora" in c["args"] and "--lora-modules" not in c["args"]
    assert _env(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    a = router_parser().parse_args(_container(docs, "router", "router")["args"])
    assert a.enable_lora is True and a.lora_modules == ""


@pytest.mark.parametrize("sets", [
    ("lora.maxLoraRank=17",),
    ("lora.maxLoras=0",),
    ("lora.modules[0].name=a=b", "lora.modules[0].path=/x"),
    ("lora.modules[0].name=a",),  # no path
    ("lora.unknown=1",),
])
def test_bad_lora_values_are_refused(sets):
    out = helm_template(sets=sets)
    assert out.returncode != 0 and "lora" in out.stderr, out.stderr
