"""The router's hand-off per KV data plane (pdserve/router/run/kv_protocol.py): what P gets, what D gets, how P's
kv_transfer_params are checked, and the errors; units first, then through the router against fake workers."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.errors import RouterError
from pdserve.router.run.kv_protocol import KV_CONNECTORS, NixlProtocol, PdserveProtocol, protocol_for
from tests.unit.test_router_app import Env, FakeWorker, ids, model_dir, run, tokenizer  # noqa: F401

P_URL = "http://10.0.0.1:8001"

# what vLLM 0.32's NixlConnector (pull mode) answers a do_remote_decode request with
NIXL_P_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5]],
                 "remote_engine_id": "e-1", "remote_request_id": "cmpl-1-0", "remote_host": "10.0.0.1",
                 "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 300,
                 "remote_blocks_expiry_time": None, "transfer_mode": "pull"}


# ---------------------------------------------------------------- units

def test_protocol_lookup_and_modes():
    assert KV_CONNECTORS == ("pdserve", "nixl", "mooncake")
    assert isinstance(protocol_for("pdserve"), PdserveProtocol) and protocol_for("pdserve").first_from_prefill
    assert isinstance(protocol_for("nixl"), NixlProtocol) and not protocol_for("nixl").first_from_prefill
    with pytest.raises(ValueError, match="choose one of pdserve, nixl, mooncake"):
        protocol_for("lmcache")


def test_prefill_params_are_fresh_dicts():
    nixl = NixlProtocol()
    a, b = nixl.prefill_params(), nixl.prefill_params()
    assert a == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    a["remote_host"] = "x"
    assert b["remote_host"] is None and nixl.prefill_params()["remote_host"] is None
    assert PdserveProtocol().prefill_params() == {"do_remote_decode": True}


def test_nixl_decode_params_accepts_p_answer():
    out = NixlProtocol().decode_params(P_URL, dict(NIXL_P_ANSWER))
    assert out == NIXL_P_ANSWER
    flat = dict(NIXL_P_ANSWER, remote_block_ids=[1, 2])  # older NixlConnector: one flat list
    assert NixlProtocol().decode_params(P_URL, flat) == flat
    no_tp = {k: v for k, v in NIXL_P_ANSWER.items() if k != "tp_size"}
    assert NixlProtocol().decode_params(P_URL, no_tp) == no_tp
    assert NixlProtocol().decode_params(P_URL, None) is None  # P kept nothing: D computes the prompt


@pytest.mark.parametrize("change, needle", [
    ({"remote_host": None}, "remote_host=None"),
    ({"remote_port": "5600"}, "remote_port='5600'"),
    ({"remote_port": True}, "remote_port=True"),
    ({"remote_block_ids": [[1, "2"]]}, "remote_block_ids is not a list of block ids"),
    ({"remote_block_ids": None}, "remote_block_ids=None"),
    ({"tp_size": "1"}, "tp_size='1'"),
    ({"do_remote_prefill": False}, "lacks do_remote_prefill=true"),
])
def test_nixl_decode_params_refuses_what_d_would_misread(change, needle):
    with pytest.raises(RouterError) as e:
        NixlProtocol().decode_params(P_URL, dict(NIXL_P_ANSWER, **change))
    err = e.value
    assert err.status == 502 and err.code == "kv_transfer_params_invalid"
    assert needle in err.message and P_URL in err.message and "NixlConnector" in err.message


def test_nixl_decode_params_refuses_missing_fields_and_non_objects():
    partial = {"do_remote_prefill": True, "remote_block_ids": [[1]]}  # what would hang a real D forever
    with pytest.raises(RouterError, match="remote_engine_id missing.*remote_host missing"):
        NixlProtocol().decode_params(P_URL, partial)
    with pytest.raises(RouterError, match="is a list, not an object"):
        NixlProtocol().decode_params(P_URL, [1, 2])
    # pdserve's connector's answer is not NixlConnector's: a mixed deployment is named, not half-run
    with pytest.raises(RouterError, match="lacks do_remote_prefill"):
        NixlProtocol().decode_params(P_URL, {"pdserve": {"host": "x"}})


def test_pdserve_protocol_passes_params_through():
    kvp = {"remote_host": "h", "anything": 1}
    assert PdserveProtocol().decode_params(P_URL, kvp) is kvp
    assert PdserveProtocol().decode_params(P_URL, "junk") is None


def test_pdserve_prefill_is_leased_on_stop_only_where_d_regenerates_the_first_token():
    """P's first token streamed (unconstrained): a prefill that stopped ends the request, so P need not lease it;
    constrained output (D regenerates the first token) and the other planes keep the default."""
    assert PdserveProtocol().options()["prefill_kv_params"] == {"do_remote_decode": True, "lease_on_stop": False}
    assert PdserveProtocol().options(constrained=True)["prefill_kv_params"] == {"do_remote_decode": True}
    assert "lease_on_stop" not in NixlProtocol().options()["prefill_kv_params"]


def test_a_one_token_request_asks_p_for_no_lease_and_d_for_nothing(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d]) as env:
            st, out = await env.post("/v1/completions", {"model": "tiny", "prompt": "the cat sat", "max_tokens": 1,
                                                         "temperature": 0})
            assert st == 200 and out["choices"][0]["text"] == " on", out
            assert len(p.requests) == 1 and "kv_transfer_params" not in p.requests[0] and d.requests == []
    run(main())


def test_router_config_kv_connector(model_dir):  # noqa: F811
    ok = RouterConfig(model_dir=str(model_dir), prefill=("http://a:1",), decode=("http://b:1",))
    assert ok.kv_connector == "pdserve"
    with pytest.raises(RouterConfigError, match="--kv-connector 'lmcache': choose pdserve"):
        RouterConfig(model_dir=str(model_dir), prefill=("http://a:1",), decode=("http://b:1",),
                     kv_connector="lmcache")
    from pdserve.router.__main__ import config_from_args

    cfg = config_from_args(["--model-dir", str(model_dir), "--prefill", "http://a:1", "--decode", "http://b:1",
                            "--kv-connector", "nixl"])
    assert cfg.kv_connector == "nixl"


# ---------------------------------------------------------------- through the router

class BadKVWorker(FakeWorker):
    """A fake P whose one-token answer carries kv_transfer_params a NixlConnector D would hang on."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        return web.json_response({
            "id": "cmpl-bad", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": " x", "token_ids": [10], "finish_reason": "length",
                         "stop_reason": None}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [[1]]}})


def test_nixl_handoff_bodies_non_stream(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], kv_connector="nixl") as env:
            st, out = await env.post("/v1/completions", {"model": "tiny", "prompt": "the cat sat", "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True})
            assert st == 200, out
            prompt = ids(tokenizer, "the cat sat")
            pb, db = p.requests[0], d.requests[0]
            assert pb["prompt"] == prompt and pb["max_tokens"] == 1 and pb["stream"] is False
            assert pb["kv_transfer_params"] == NixlProtocol().prefill_params()
            # D: the prompt alone, the whole max_tokens, P's params as P gave them
            assert db["prompt"] == prompt and db["max_tokens"] == 4 and db["stream"] is True
            assert db["kv_transfer_params"]["remote_engine_id"] == "P"
            assert db["kv_transfer_params"]["do_remote_prefill"] is True
            # the output is D's whole stream (the fake D regenerates the same first token as P)
            assert out["choices"][0]["text"] == " on mat a b"
            assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    run(main())


def test_nixl_first_token_comes_from_d_in_a_stream(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P", texts={10: " P-TOKEN"}), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], kv_connector="nixl") as env:
            st, chunks = await env.stream("/v1/completions", {"prompt": "the cat sat", "max_tokens": 3,
                                                              "stream": True, "ignore_eos": True})
            assert st == 200
            objs = [json.loads(c) for c in chunks]
            text = "".join(o["choices"][0]["text"] for o in objs if o["choices"])
            assert text == " on mat a" and "P-TOKEN" not in text  # P's token is never streamed early
            assert len(d.requests) == 1 and d.requests[0]["max_tokens"] == 3
    run(main())


def test_nixl_bad_params_from_p_give_502_and_d_is_never_called(model_dir, tokenizer):  # noqa: F811
    p, d = BadKVWorker("P"), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], kv_connector="nixl") as env:
            for stream in (False, True):
                st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 3,
                                                             "stream": stream})
                assert st == 502, out
                err = out["error"]
                assert err["code"] == "kv_transfer_params_invalid" and err["type"] == "server_error"
                assert "remote_host missing" in err["message"] and p.url in err["message"]
            assert d.requests == []
            st, metrics = await env.get("/metrics")
            assert 'pdserve_router_worker_errors_total{kind="protocol",role="prefill"} 2.0' in metrics
    run(main())


def test_nixl_p_without_params_lets_d_compute(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P", kv=False), FakeWorker("D")

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], kv_connector="nixl") as env:
            st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 2})
            assert st == 200, out
            assert "kv_transfer_params" not in d.requests[0] and d.requests[0]["max_tokens"] == 2
    run(main())


def test_nixl_decode_error_passes_through(model_dir, tokenizer):  # noqa: F811
    p, d = FakeWorker("P"), FakeWorker("D", status=400)

    async def main():
        async with Env(model_dir, tokenizer, [p], [d], kv_connector="nixl") as env:
            st, out = await env.post("/v1/completions", {"prompt": "the cat", "max_tokens": 2})
            assert st == 400 and "fake error from D" in out["error"]["message"]
            st, out = await env.stream("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "stream": True})
            assert st == 400  # D answered its streamed call with a JSON 400, as one worker would
    run(main())
