"""`--kv-connector mooncake` up to vLLM's boundary: the router's hand-off for vLLM's MooncakeConnector
(pdserve/router/run/kv_protocol.py MooncakeProtocol, pdserve/router/run/mooncake.py) against fake workers and a
fake bootstrap server, and the torch patch of pdserve/vllm/mooncake_cpu.py. The launch plan's side is in
tests/unit/test_mooncake_plan.py; real workers in tests/integration/test_mooncake_vllm.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest
from aiohttp import web

from pdserve.router.config import RouterConfig, RouterConfigError, parse_bootstrap_ports
from pdserve.router.errors import RouterError
from pdserve.router.run.kv_protocol import MooncakeProtocol, protocol_for
from pdserve.router.run.mooncake import ENGINE_ID_TTL_S, BootstrapBook
from tests.unit.test_router_app import Env, FakeWorker, ids, model_dir, run, tokenizer  # noqa: F401

P_URL = "http://10.0.0.1:8001"


class FakeBootstrap:
    """vLLM's MooncakeBootstrapServer as D and the router see it: GET /query -> {dp_rank: engine entry}."""

    def __init__(self, engine: str = "engine-P") -> None:
        self.engine = engine
        self.queries = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        return web.json_response({"0": {"engine_id": self.engine, "worker_addr": {"0": {"0": "tcp://x:1"}}}})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/query", self.query)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


# ---------------------------------------------------------------- units

def test_bootstrap_ports_parse_and_refuse():
    assert parse_bootstrap_ports("") == {}
    assert parse_bootstrap_ports("http://a:1/=9000, http://b:2=9001") == {"http://a:1": 9000, "http://b:2": 9001}
    for bad in ("a:1=9000", "http://a:1", "http://a:1=0", "http://a:1=x", "http://a:1=70000"):
        with pytest.raises(ValueError):
            parse_bootstrap_ports(bad)


def test_router_config_takes_mooncake(model_dir):  # noqa: F811
    from pdserve.router.__main__ import config_from_args

    cfg = config_from_args(["--model-dir", str(model_dir), "--prefill", "http://a:1", "--decode", "http://b:1",
                            "--kv-connector", "mooncake", "--mooncake-bootstrap", "http://a:1=9100",
                            "--mooncake-bootstrap-port", "9200"])
    assert (cfg.kv_connector, cfg.mooncake_bootstrap, cfg.mooncake_bootstrap_port) == ("mooncake",
                                                                                       "http://a:1=9100", 9200)
    with pytest.raises(RouterConfigError, match="--mooncake-bootstrap 'http://a:1=0'"):
        RouterConfig(model_dir=str(model_dir), prefill=("http://a:1",), decode=("http://b:1",),
                     kv_connector="mooncake", mooncake_bootstrap="http://a:1=0")


def test_bootstrap_address_per_worker_else_default_port():
    book = BootstrapBook(8998, {"http://a:1": 9000})
    assert book.address("http://a:1/") == "http://a:9000"
    assert book.address("http://b:2") == "http://b:8998"
    assert book.address("http://[::1]:2") == "http://[::1]:8998"


def test_engine_id_asked_cached_and_forgotten():
    now = [0.0]
    boot = FakeBootstrap()

    async def main():
        await boot.start()
        try:
            book = BootstrapBook(boot.port, clock=lambda: now[0])
            url = "http://127.0.0.1:1"
            got = await asyncio.gather(*(book.engine_id(url) for _ in range(5)))
            assert got == ["engine-P"] * 5 and boot.queries == 1  # concurrent callers share one query
            assert await book.engine_id(url) == "engine-P" and boot.queries == 1
            now[0] += ENGINE_ID_TTL_S + 0.1  # a restarted P answers a new id: asked again past the TTL
            boot.engine = "engine-P2"
            assert await book.engine_id(url) == "engine-P2" and boot.queries == 2
        finally:
            await boot.stop()
        now[0] += ENGINE_ID_TTL_S + 0.1
        assert await book.engine_id(url) is None  # P's bootstrap server is gone

    run(main())


def test_decode_for_checks_what_p_answered():
    proto = MooncakeProtocol(BootstrapBook(1))
    with pytest.raises(RouterError) as e:  # P runs another connector: a 502 before D is called
        run(proto.decode_for("xfer-1", P_URL, {"do_remote_prefill": True}, "length"))
    assert e.value.status == 502 and e.value.code == "kv_transfer_params_invalid"
    assert "MooncakeConnector" in e.value.message and P_URL in e.value.message
    # P's one token ended by a stop (EOS): vLLM freed its blocks, D computes the prompt
    assert run(proto.decode_for("xfer-1", P_URL, None, "stop")) is None
    # P's bootstrap server does not answer (P died after answering): D computes the prompt
    assert run(proto.decode_for("xfer-1", "http://127.0.0.1:1", None, "length")) is None


def test_each_request_gets_its_own_transfer_id():
    proto = protocol_for("mooncake")
    a, b = proto.options(), proto.options(constrained=True)
    assert a["first_from_prefill"] is False and b["first_from_prefill"] is False
    ta, tb = a["prefill_kv_params"]["transfer_id"], b["prefill_kv_params"]["transfer_id"]
    assert ta != tb and ta.startswith("xfer-")
    assert a["prefill_kv_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": ta}


# ---------------------------------------------------------------- through the router

def _mooncake_env(model_dir, tokenizer, p, d, boot):  # noqa: F811
    return Env(model_dir, tokenizer, [p], [d], kv_connector="mooncake", mooncake_bootstrap=f"{p.url}={boot.port}")


@pytest.mark.parametrize("stream", [False, True])
def test_mooncake_handoff_bodies(model_dir, tokenizer, stream):  # noqa: F811
    # MooncakeConnector's P answers no kv_transfer_params (kv=False)
    p, d, boot = FakeWorker("P", kv=False, texts={10: " P-TOKEN"}), FakeWorker("D"), FakeBootstrap()

    async def main():
        await p.start()
        await boot.start()
        try:
            async with _mooncake_env(model_dir, tokenizer, p, d, boot) as env:
                body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True, "stream": stream}
                if stream:
                    st, chunks = await env.stream("/v1/completions", body)
                    text = "".join(o["choices"][0]["text"] for o in map(json.loads, chunks) if o["choices"])
                else:
                    st, out = await env.post("/v1/completions", body)
                    text = out["choices"][0]["text"]
                assert st == 200
                prompt = ids(tokenizer, "the cat sat")
                pb, db = p.requests[0], d.requests[0]
                assert pb["prompt"] == prompt and pb["max_tokens"] == 1 and pb["stream"] is False
                transfer = pb["kv_transfer_params"]["transfer_id"]
                assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                    "transfer_id": transfer}
                # D: the prompt alone, the whole max_tokens, the same transfer, P's engine and bootstrap address
                assert db["prompt"] == prompt and db["max_tokens"] == 4 and db["stream"] is True
                assert db["kv_transfer_params"] == {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-P",
                    "remote_bootstrap_addr": f"http://127.0.0.1:{boot.port}", "transfer_id": transfer}
                assert text == " on mat a b" and "P-TOKEN" not in text  # P's token is never streamed early
        finally:
            await boot.stop()
            await p.stop()

    run(main())


def test_mooncake_p_stopped_or_bootstrap_down_lets_d_compute(model_dir, tokenizer):  # noqa: F811
    p, d, boot = FakeWorker("P", kv=False, eos_after=1), FakeWorker("D"), FakeBootstrap()

    async def main():
        await p.start()
        await boot.start()
        try:
            async with _mooncake_env(model_dir, tokenizer, p, d, boot) as env:
                # P's one token is EOS: vLLM did not keep P's blocks, so D is not told to pull them (early dispatch:
                # the D sent at once with the transfer id is closed, and D gets the prompt alone instead)
                st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 3})
                assert st == 200, out
                serial = [r for r in d.requests if "kv_transfer_params" not in r]
                early = [r for r in d.requests if "kv_transfer_params" in r]  # (closed; it may land after the other)
                assert len(serial) == 1 and len(early) <= 1 and boot.queries <= 1, d.requests
                assert all(r["kv_transfer_params"]["transfer_id"].startswith("xfer-") for r in early)
                d.requests.clear()
                p.eos_after = None
                await boot.stop()  # P answered but its bootstrap server is gone: D computes the prompt
                await asyncio.sleep(ENGINE_ID_TTL_S)  # (the early D above had P's engine id asked: it is cached)
                st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 3,
                                                             "ignore_eos": True})
                assert st == 200, out
                assert "kv_transfer_params" not in d.requests[-1] and d.requests[-1]["max_tokens"] == 3
        finally:
            await p.stop()

    run(main())


def test_mooncake_p_with_other_params_gives_502(model_dir, tokenizer):  # noqa: F811
    p, d, boot = FakeWorker("P"), FakeWorker("D"), FakeBootstrap()  # kv=True: P answers NIXL-style params

    async def main():
        await p.start()
        await boot.start()
        try:
            async with _mooncake_env(model_dir, tokenizer, p, d, boot) as env:
                st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 3})
                assert st == 502 and out["error"]["code"] == "kv_transfer_params_invalid", out
                # early dispatch: D was sent its pull at once (P's answer was not known yet); closed with the 502
                assert all("transfer_id" in r["kv_transfer_params"] for r in d.requests) and len(d.requests) <= 1
        finally:
            await boot.stop()
            await p.stop()

    run(main())


# ---------------------------------------------------------------- the torch patch (pdserve/vllm/mooncake_cpu.py)

@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("mooncake") is None,
                    reason="vllm and mooncake are needed")
def test_cpu_device_index_only_inside_and_only_without_accelerator():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector as Vllm,
    )

    from pdserve.vllm.mooncake_cpu import MooncakeConnector, cpu_device_index, has_accelerator

    assert issubclass(MooncakeConnector, Vllm) and MooncakeConnector.__name__ == Vllm.__name__
    original = torch.accelerator.current_device_index
    if has_accelerator():
        with cpu_device_index():
            assert torch.accelerator.current_device_index is original
        return
    with pytest.raises(RuntimeError):  # what MooncakeConnectorWorker.__init__ hits on CPU-only torch
        torch.accelerator.current_device_index()
    with cpu_device_index():
        assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_device_index is original
    with pytest.raises(ValueError), cpu_device_index():
        raise ValueError("the constructor failed")
    assert torch.accelerator.current_device_index is original


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("mooncake") is None,
                    reason="vllm and mooncake are needed")
def test_mooncake_prometheus_counters_count_the_connectors_stats():
    """vLLM's MultiConnector asserts every connector reporting stats registered metrics: ours are real counters."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pdserve.vllm.mooncake_cpu import MooncakeConnector

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = MooncakeConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                                                {0: ["0"]})
    prom.observe({"transfer_duration": [0.5, 0.25], "bytes_transferred": [1000, 24], "num_descriptors": [3, 1],
                  "num_failed_transfers": [1], "num_failed_recvs": [], "num_kv_expired_reqs": []})
    got = {m.name: m.samples[0].value for m in reg.collect() if m.samples}
    assert got["vllm:pdserve_mooncake_kv_transfers"] == 2 and got["vllm:pdserve_mooncake_kv_bytes"] == 1024
    assert got["vllm:pdserve_mooncake_kv_transfer_seconds"] == 0.75
    assert got["vllm:pdserve_mooncake_kv_failed_transfers"] == 1 and got["vllm:pdserve_mooncake_kv_failed_recvs"] == 0
