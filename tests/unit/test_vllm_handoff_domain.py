"""The P -> D hand-off carries the request's key domain (cache salt, LoRA adapter) in its fingerprint: D takes P's
KV only for a request of the same domain, and refuses it by field otherwise (it computes the prompt itself)."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.hashing import domain_root
from pdserve.vllm.messages import PdserveHandshake
from pdserve.vllm.params import ConnectorConfig, RemoteParams, prompt_hash
from pdserve.vllm.scheduler import SchedulerSide, request_fingerprint

SECRET = "s" * 64
FP = {"model": "m", "model_hash": "abc", "dtype": "float32", "kv_dtype": "auto", "block_size": "16",
      "kv_layout": "x", "tp": "1", "vllm": "0.32.0", "pdserve": "dev/pdserve-kv/1", "domain": ""}
TOKENS = list(range(100, 110))


def _req(lora: str | None = None, salt: str | None = None, remote: RemoteParams | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id="d1", prompt_token_ids=TOKENS + [1], num_prompt_tokens=11,
                           kv_transfer_params=remote.to_params() if remote else None, sampling_params=None,
                           cache_salt=salt, lora_request=SimpleNamespace(lora_name=lora) if lora else None)


def test_request_fingerprint_names_the_domain():
    assert request_fingerprint(FP, _req()) == FP  # no salt, no adapter: the worker's own
    assert request_fingerprint(FP, _req("ad"))["domain"] == f"{domain_root(None, 'ad'):016x}"
    assert request_fingerprint(FP, _req("ad"))["domain"] != request_fingerprint(FP, _req("ad", "s"))["domain"]
    assert request_fingerprint({}, _req("ad")) is None  # a worker with no fingerprint (a fake) sends none


def test_d_takes_p_kv_of_its_own_adapter_only():
    s = SchedulerSide(ConnectorConfig.from_extra({"secret": SECRET}), 4)
    s.set_handshake({0: PdserveHandshake("engine-p", "10.0.0.1", 7000, "L", fingerprint=FP)})

    def from_p(p_lora: str | None, d_lora: str | None) -> int:
        fp = request_fingerprint(FP, _req(p_lora))
        remote = RemoteParams("engine-p", "10.0.0.1", 7000, (7, 8, 9), 10, "p1", "L", prompt_hash(TOKENS, 10), 0.0,
                              fingerprint=fp)
        return s.get_num_new_matched_tokens(_req(d_lora, remote=remote), 0)[0]

    assert from_p("ad", "ad") == 10 and from_p(None, None) == 10
    assert from_p(None, "ad") == 0  # P ran the base model, D the adapter
    assert s._reads["d1"]["refused"].startswith("fingerprint mismatch: domain: P=''"), s._reads["d1"]
    assert from_p("ad", "other") == 0 and from_p("ad", None) == 0
