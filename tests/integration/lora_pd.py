"""Multi-LoRA through P and D (issue 25, item 3) on prefill0 and decode0 of the shared conductor launch (``pd_conductor``, with a router of its own):
the adapter written here at session start (a PEFT-format directory made by hand: peft is not installed), loaded by
both workers with vLLM's ``--lora-modules`` (what ``pdserve serve --lora-modules`` gives every worker). The cases compare the router's greedy output with ``model=<adapter>``
against the D worker itself with the same adapter (streamed and not), and against the base model's (so the adapter
really acted). Run from tests/integration/test_lora_vllm.py."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.prom import scrape

ADAPTER = "rl-lora"
RANK = 8
TARGETS = ("q_proj", "v_proj")
READS = "vllm:pdserve_kv_reads_total"


def write_random_lora(out: Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                      rank: int = RANK, seed: int = 7, std: float = 0.5) -> Path:
    """A PEFT LoRA adapter for :func:`pdserve.launch.models.build_random_llama`'s default shape: ``lora_A`` (rank x in)
    and ``lora_B`` (out x rank) for every layer's q_proj and v_proj, random (std ``std``, scale alpha/r = 2), so
    large next to the base weights' 0.2 that greedy output changes. Deterministic for a seed."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dims = {"q_proj": hidden, "v_proj": hidden // heads * kv_heads}
    tensors = {}
    for layer in range(layers):
        for mod in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * std).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(dims[mod], rank, generator=gen) * std).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": None, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


def _post(url: str, body: dict) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def _ok(url: str, body: dict) -> dict:
    status, out = _post(url, body)
    assert status == 200, out
    return out


def _streamed(url: str, body: dict) -> tuple[str, list[int], set[str]]:
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    text, ids, models = "", [], set()
    for e in map(json.loads, events[:-1]):
        assert "error" not in e, e
        models.add(e["model"])
        for c in e.get("choices") or []:
            text += c.get("text") or ""
            ids += c.get("token_ids") or []
    return text, ids, models


def _models(router_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(router_url + "/v1/models", timeout=30) as r:
        return {m["id"]: m for m in json.loads(r.read())["data"]}


def _reads(url: str) -> float:
    return scrape(url, READS).get(READS, 0.0)


def check_adapter_through_pd_equals_one_worker(router_url: str, decode_url: str, base: str) -> None:
    """Greedy output with model=<adapter> through P -> D equals D alone with the adapter (streamed and not, text
    and token ids), differs from the base model's, and the KV went P -> D. D's reference carries a cache salt of
    its own, so it is computed from scratch rather than from the blocks the routed request left in D's cache."""
    models = _models(router_url)
    assert models[ADAPTER]["parent"] == base and models[base]["parent"] is None
    for length in (40, 300):  # one partial block; two full blocks read from P and a partial one
        ids = [random.Random(length).randrange(1000, 40000) for _ in range(length)]
        body = {"model": ADAPTER, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        reads = _reads(decode_url)
        routed = _ok(router_url + "/v1/completions", body)
        text, token_ids, names = _streamed(router_url + "/v1/completions", body)
        ref = _ok(decode_url + "/v1/completions", dict(body, cache_salt=f"lora-ref-{length}"))["choices"][0]
        plain = _ok(decode_url + "/v1/completions", dict(body, model=base, cache_salt=f"base-{length}"))
        got = routed["choices"][0]
        assert (got["text"], got["token_ids"]) == (text, token_ids) == (ref["text"], ref["token_ids"])
        assert routed["model"] == ADAPTER and names == {ADAPTER}
        assert plain["choices"][0]["token_ids"] != ref["token_ids"], "the adapter did not change greedy output"
        if length > 128:
            assert _reads(decode_url) >= reads + 2  # both routed requests read P's KV
    chat = {"model": ADAPTER, "messages": [{"role": "user", "content": "Name three colours, please."}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    routed = _ok(router_url + "/v1/chat/completions", chat)
    ref = _ok(decode_url + "/v1/chat/completions", dict(chat, cache_salt="lora-chat-ref"))
    assert routed["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert routed["model"] == ADAPTER


def check_runtime_load_and_unload(router_url: str, decode_url: str, adapter_dir: str, base: str) -> None:
    """/v1/load_lora_adapter through the router loads on P and D (a later /v1/models lists it and a request runs
    it through P -> D as D alone does); a bad path is refused as vLLM refuses it and not listed; unload takes it
    off every worker and the list."""
    name = "rl-lora-runtime"
    status, out = _post(router_url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": "/nonexistent/x"})
    assert status == 404, out  # vLLM's own 404 from every worker, passed through
    assert name not in _models(router_url)
    status, out = _post(router_url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})
    assert status == 200, out
    assert _models(router_url)[name]["parent"] == base
    ids = [random.Random(7).randrange(1000, 40000) for _ in range(200)]
    body = {"model": name, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    routed = _ok(router_url + "/v1/completions", body)
    ref = _ok(decode_url + "/v1/completions", dict(body, cache_salt="runtime-ref"))  # D has it too
    assert routed["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"] and routed["model"] == name
    status, out = _post(router_url + "/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, out
    assert name not in _models(router_url)
    assert _post(router_url + "/v1/completions", body)[0] == 404
    assert _post(decode_url + "/v1/completions", body)[0] == 404  # gone from the workers too


def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def check_runtime_load_reaches_replicas(router_a: str, router_b: str, decode_url: str, adapter_dir: str,
                                        base: str) -> None:
    """A load through replica A is listed by replica B within its poll of the shared file (0.5 s) and runs through
    B as on D alone; an unload through B leaves A's list and A answers 404 for it."""
    name = "rl-lora-replicas"
    status, out = _post(router_a + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})
    assert status == 200, out
    try:
        _until(lambda: name in _models(router_b), "replica b never listed the adapter loaded through a")
        assert (_models(router_b)[name]["root"], _models(router_b)[name]["parent"]) == (adapter_dir, base)
        body = {"model": name, "prompt": [random.Random(11).randrange(1000, 40000) for _ in range(60)],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        routed = _ok(router_b + "/v1/completions", body)
        ref = _ok(decode_url + "/v1/completions", dict(body, cache_salt="replicas-ref"))
        assert routed["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"] and routed["model"] == name
    finally:
        status, out = _post(router_b + "/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, out
    _until(lambda: name not in _models(router_a), "replica a still lists the adapter unloaded through b")
    assert _post(router_a + "/v1/completions", body)[0] == 404


def run_lora_cases(router_url: str, decode_url: str, lora_modules: str, base: str) -> None:
    """Every case above on the stack whose workers load ``lora_modules`` (with :data:`ADAPTER`)."""
    from pdserve.settings.lora import parse_lora_modules

    check_adapter_through_pd_equals_one_worker(router_url, decode_url, base)
    check_runtime_load_and_unload(router_url, decode_url, parse_lora_modules(lora_modules)[ADAPTER], base)
