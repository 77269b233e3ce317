"""P -> D streams relayed as bytes (issue 24, item 3), on real vLLM workers: D's stream goes through the router's
byte relay once its text has settled (pdserve/router/run/textsync.py), and what the client gets (text and token ids,
event by event joined) equals the decode worker serving the same request alone, byte for byte. Run from a test
module that owns a 1P1D stack (tests/integration/test_pd_router.py)."""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Any


def _sse(url: str, body: dict, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _text_and_ids(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    text, ids = "", []
    for e in events:
        assert "error" not in e, e
        for c in e.get("choices") or []:
            text += c.get("text") or ""
            ids += c.get("token_ids") or []
    return text, ids


def check_pd_streams_are_relayed_and_exact(router_url: str, decode_url: str, tokens: int = 48) -> None:
    relayed = 0
    for seed in range(3):
        rng = random.Random(100 + seed)
        body = {"model": "rl", "prompt": [rng.randrange(1000, 40000) for _ in range(40 + 30 * seed)],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        mine = _sse(router_url, body, {"X-Pdserve-Timings": "1"})
        alone = _sse(decode_url, body)  # the whole request on the decode worker, no kv_transfer_params
        assert _text_and_ids(mine) == _text_and_ids(alone)
        assert mine[-1]["usage"]["completion_tokens"] == tokens
        timings = mine[-1]["pdserve_timings"]
        assert timings["mode"] == "disaggregated" and timings["prefill_worker"], timings  # P -> D, not local
        relayed += timings["relayed_tokens"]
    # per request: all but P's token, D's first events (checked against the router's detokenizer) and the finish
    assert relayed >= 3 * (tokens - 6), relayed
