"""/v1/messages (Anthropic Messages API) and /v1/responses (OpenAI Responses API) through the 1P1D router, against
the same greedy requests on one plain vLLM worker's own /v1/messages and /v1/responses (issue 25, item 4): the
same text, tool calls, stop reasons and token counts, whole and streamed, and the same SSE event sequence.
Random per-request values (ids, created_at) and the workers' prefix-cache hit counts (``cached_tokens``: the
router does not see them, a documented difference) are left out of the comparison. Run from
tests/integration/test_pd_router.py, whose stack (hermes tool parser on the workers and the router) it uses."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from itertools import groupby
from typing import Any

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                      "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"

MESSAGES_CASES: list[dict[str, Any]] = [
    {"model": "rl", "max_tokens": 12, "temperature": 0, "system": "Be brief.",
     "messages": [{"role": "user", "content": "Name three colours, please."}]},
    {"model": "rl", "max_tokens": 16, "temperature": 0, "stop_sequences": ["e"],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]},
    {"model": "rl", "max_tokens": 48, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}],
     "tools": [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["schema"],
                "strict": True}],
     "tool_choice": {"type": "tool", "name": "get_weather"}},
]
RESPONSES_CASES: list[dict[str, Any]] = [
    {"model": "rl", "max_output_tokens": 12, "temperature": 0, "ignore_eos": True, "input": "Name three colours."},
    {"model": "rl", "max_output_tokens": 10, "temperature": 0, "instructions": "Be brief.", "metadata": {"k": "v"},
     "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say something."}]}]},
    {"model": "rl", "max_output_tokens": 6, "temperature": 0, "ignore_eos": True, "input": "Say a word.",
     "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    {"model": "rl", "max_output_tokens": 48, "temperature": 0, "input": QUESTION,
     "tools": [{"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
                "parameters": WEATHER["schema"], "strict": True}],
     "tool_choice": {"type": "function", "name": "get_weather"}},
]


def _post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for ev in raw.decode().split("\n\n"):
        if not ev.strip():
            continue
        name, data = ev.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), ev
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def _collapsed(events: list[tuple[str, dict]]) -> list[str]:
    """The event names with each run of deltas as one (the two sides may cut the text into deltas differently)."""
    return [name for name, _ in groupby(n for n, _ in events)]


def _message_blocks(content: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def _streamed_message(events: list[tuple[str, dict]]) -> dict:
    """What a streamed Messages answer says: its blocks (text joined, tool input as the streamed JSON text), stop
    and usage."""
    blocks: list[dict] = []
    for name, e in events:
        if name == "content_block_start":
            blocks.append({k: v for k, v in e["content_block"].items() if k != "id"})
            blocks[-1]["_json"] = ""
        elif name == "content_block_delta":
            d = e["delta"]
            if d["type"] == "text_delta":
                blocks[-1]["text"] += d["text"]
            else:
                blocks[-1]["_json"] += d["partial_json"]
    start = events[0][1]["message"]
    last = events[-2][1]
    return {"blocks": blocks, "start_usage": start["usage"], "delta": last["delta"], "usage": last["usage"],
            "names": _collapsed(events)}


def check_messages(router: str, worker: str) -> int:
    """Every Messages case, whole and streamed, equal on both sides; returns how many tool_use blocks were
    compared (the caller checks that the tool case produced one)."""
    tool_blocks = 0
    for body in MESSAGES_CASES:
        st_r, mine = _post(router + "/v1/messages", body)
        st_w, ref = _post(worker + "/v1/messages", body)
        assert st_r == st_w == 200, (st_r, mine[:500], st_w, ref[:500])
        a, b = json.loads(mine), json.loads(ref)
        assert _message_blocks(a["content"]) == _message_blocks(b["content"]), (a, b)
        for key in ("type", "role", "model", "stop_reason", "stop_sequence", "usage"):
            assert a.get(key) == b.get(key), (key, a, b)
        assert set(a) == set(b), (set(a) ^ set(b))
        tool_blocks += sum(1 for blk in a["content"] if blk["type"] == "tool_use")
        st_r, mine = _post(router + "/v1/messages", {**body, "stream": True})
        st_w, ref = _post(worker + "/v1/messages", {**body, "stream": True})
        assert st_r == st_w == 200
        sa, sb = _streamed_message(_events(mine)), _streamed_message(_events(ref))
        assert sa == sb, (sa, sb)
        assert sa["usage"]["output_tokens"] == a["usage"]["output_tokens"]
    return tool_blocks


def _normal_response(r: dict) -> dict:
    """A response object without its random values and the workers' prefix-cache hit counts."""
    out = {k: v for k, v in r.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in r["output"]]
    if out.get("usage"):
        out["usage"] = {**out["usage"], "input_tokens_details": {
            **out["usage"]["input_tokens_details"], "cached_tokens": 0}}
    return out


def _logprob_values(obj: Any, out: list[float]) -> Any:
    """``obj`` with every ``logprob`` number set to 0.0, the numbers appended to ``out`` (they are compared to
    1e-3: P computes the first token's, D the rest)."""
    if isinstance(obj, dict):
        return {k: (out.append(v) or 0.0) if k == "logprob" and isinstance(v, float) else _logprob_values(v, out)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_logprob_values(v, out) for v in obj]
    return obj


def _same(a: Any, b: Any) -> None:
    va: list[float] = []
    vb: list[float] = []
    sa, sb = _logprob_values(a, va), _logprob_values(b, vb)
    assert sa == sb, (sa, sb)
    assert len(va) == len(vb) and all(abs(x - y) < 1e-3 for x, y in zip(va, vb)), (va, vb)


def check_responses(router: str, worker: str) -> None:
    for body in RESPONSES_CASES:
        st_r, mine = _post(router + "/v1/responses", body)
        st_w, ref = _post(worker + "/v1/responses", body)
        assert st_r == st_w == 200, (st_r, mine[:500], st_w, ref[:500])
        a, b = _normal_response(json.loads(mine)), _normal_response(json.loads(ref))
        _same(a, b)
        if "include" in body:
            assert a["output"][0]["content"][0]["logprobs"], "no logprobs came back"
        st_r, mine = _post(router + "/v1/responses", {**body, "stream": True})
        st_w, ref = _post(worker + "/v1/responses", {**body, "stream": True})
        assert st_r == st_w == 200
        ea, eb = _events(mine), _events(ref)
        assert _collapsed(ea) == _collapsed(eb), (_collapsed(ea), _collapsed(eb))
        for events in (ea, eb):
            assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        text_a = "".join(e["delta"] for n, e in ea if n == "response.output_text.delta")
        text_b = "".join(e["delta"] for n, e in eb if n == "response.output_text.delta")
        assert text_a == text_b
        fa, fb = _normal_response(ea[-1][1]["response"]), _normal_response(eb[-1][1]["response"])
        _same(fa, fb)
        _same([lp for n, e in ea if n == "response.output_text.delta" for lp in e["logprobs"]],
              [lp for n, e in eb if n == "response.output_text.delta" for lp in e["logprobs"]])
        assert fa["usage"] == a["usage"]
        if "tools" not in body:  # with tools vLLM itself builds the whole answer's items otherwise than the stream's
            _same(fa["output"], a["output"])


def check_errors(router: str, worker: str) -> None:
    """Bad requests get the worker's status on both endpoints, Messages errors in Anthropic's shape (vLLM's own
    request-validation errors on /v1/messages are OpenAI-shaped: only the status is compared for those); what
    needs vLLM's response store is refused by name."""
    m, r = MESSAGES_CASES[0], RESPONSES_CASES[0]
    shaped = [({**m, "model": "nope"}, 404), ({**m, "max_tokens": 5000}, 400)]
    for body, status in shaped + [({k: v for k, v in m.items() if k != "max_tokens"}, 400),
                                  ({**m, "messages": [{"role": "tool", "content": "x"}]}, 400)]:
        (st_r, mine), (st_w, _) = _post(router + "/v1/messages", body), _post(worker + "/v1/messages", body)
        err = json.loads(mine)
        assert st_r == st_w == status and err["type"] == "error" and set(err["error"]) == {"type", "message"}, \
            (body, st_r, st_w, mine)
    for body, _ in shaped:
        (_, mine), (_, ref) = _post(router + "/v1/messages", body), _post(worker + "/v1/messages", body)
        assert set(json.loads(ref)) == set(json.loads(mine)), (mine, ref)
    for body, status, param in (({**r, "model": "nope"}, 404, "model"), ({**r, "input": 5}, 400, None),
                                ({**r, "max_output_tokens": 5000}, 400, "max_output_tokens")):
        (st_r, mine), (st_w, ref) = _post(router + "/v1/responses", body), _post(worker + "/v1/responses", body)
        assert st_r == st_w == status, (body, st_r, st_w, mine, ref)
        if param is not None:
            assert json.loads(mine)["error"]["param"] == json.loads(ref)["error"]["param"] == param
    st, raw = _post(router + "/v1/responses", {**r, "previous_response_id": "resp_1"})
    assert st == 400 and json.loads(raw)["error"]["param"] == "previous_response_id"
