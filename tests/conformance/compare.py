"""Send one case to one plain vLLM worker and to the 1P1D router, and compare what a client sees: per choice the
text, token ids, logprobs (values within 1e-3: P and D run fp32), finish reason and (chat) role, the usage, the prompt text (chat ``return_prompt_text``), and for an error
its status and the parameter it names; streamed answers are assembled per choice first.

Known differences, each documented in :data:`KNOWN` and checked by its own rule (its exact condition) rather than
skipped; each is one PD cannot (yet) remove:

- ``refused``: a field api/fields.py refuses gets the router's 400 naming it (vLLM serves it).

Issue 41 removed the rules that absorbed differences the router now does not make: ``router_limit`` (``n`` is
vLLM's VLLM_MAX_N_SEQUENCES), ``refused_before_stream`` (a streamed request vLLM refuses from inside its stream gets
200 and the error event), ``greedy_n`` (greedy ``n`` > 1 is refused as vLLM refuses it), ``max_tokens_clamp`` (``max_tokens`` over the
room the prompt leaves is clamped as vLLM clamps it), ``param_named`` (vLLM's
unnamed SamplingParams refusals are unnamed), ``seeded_sampling`` (no case needed it: seeded cases must be
identical) and ``param_prefix`` (a field vLLM's request model refuses is named ``body.<field>`` by the router too).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

KNOWN = {
    "refused": "the router refuses the field by name with a 400 (vLLM serves it)",
}
TOL = 1e-3


def post(url: str, body: dict[str, Any], timeout: float = 180) -> tuple[int, Any]:
    """The status and the JSON answer, or for a stream the list of its events' JSON (``[DONE]`` left out)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    if not body.get("stream") or status != 200:
        return status, json.loads(raw)
    events = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return status, events


def _error(answer: Any) -> dict[str, Any]:
    err = answer.get("error", answer) if isinstance(answer, dict) else {}
    return err if isinstance(err, dict) else {"message": str(err)}


def _stream_error(events: list[dict]) -> dict[str, Any] | None:
    return next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)


def _collect(events: list[dict], chat: bool) -> dict[str, Any]:
    """A stream as one answer: each choice's text, token ids, logprobs and finish reason; the last usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage, prompt_text = None, None
    for ev in events:
        if ev.get("usage"):
            usage = ev["usage"]
        prompt_text = prompt_text or ev.get("prompt_text")
        for c in ev.get("choices") or []:
            acc = choices.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": [], "lp": [],
                                                  "finish_reason": None, "tool_calls": 0, "role": None})
            delta = c.get("delta", {}) if chat else c
            acc["role"] = acc["role"] or (delta.get("role") if chat else None)
            acc["text"] += (delta.get("content") if chat else delta.get("text")) or ""
            acc["tool_calls"] += len(delta.get("tool_calls") or []) if chat else 0
            acc["token_ids"] += c.get("token_ids") or []
            acc["lp"] += _logprob_list(c.get("logprobs"), chat)
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage, "prompt_text": prompt_text}


def _logprob_list(lp: Any, chat: bool) -> list[tuple[str, float, list[tuple[str, float]]]]:
    if not lp:
        return []
    if chat:
        return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or []])
                for e in lp.get("content") or []]
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [(t, v, sorted((top or {}).items())) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], tops)]


def summary(status: int, answer: Any, chat: bool, stream: bool) -> dict[str, Any]:
    """What the suite compares of one answer."""
    if status != 200:
        err = _error(answer)
        return {"status": status, "param": err.get("param")}
    if stream:
        err = _stream_error(answer)
        if err is not None:
            return {"status": 200, "stream_error": err.get("code") or err.get("type"), "param": err.get("param")}
        answer = _collect(answer, chat)
        choices = answer["choices"]
    else:
        choices = [{"index": c["index"],
                    "text": (c["message"].get("content") or "") if chat else c["text"],
                    "tool_calls": len(c["message"].get("tool_calls") or []) if chat else 0,
                    "token_ids": c.get("token_ids") or [],
                    "lp": _logprob_list(c.get("logprobs"), chat), "finish_reason": c["finish_reason"],
                    "role": c["message"].get("role") if chat else None}
                   for c in sorted(answer["choices"], key=lambda c: c["index"])]
    usage = answer.get("usage")
    if usage is not None:
        usage = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"status": 200, "choices": choices, "usage": usage, "prompt_text": answer.get("prompt_text")}


def _lp_equal(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for (ta, va, topa), (tb, vb, topb) in zip(a, b):
        if ta != tb or (va is None) != (vb is None) or (va is not None and abs(va - vb) > TOL):
            return False
        if [t for t, _ in topa] != [t for t, _ in topb]:
            # equal logprobs may list in either order; compare as sets within the tolerance
            if sorted(t for t, _ in topa) != sorted(t for t, _ in topb):
                return False
        da, db = dict(topa), dict(topb)
        if any(abs(da[t] - db[t]) > TOL for t in da):
            return False
    return True


def differences(mine: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """What differs between the router's summary and the worker's (empty: identical)."""
    out = []
    if mine["status"] != ref["status"]:
        return [f"status {mine['status']} != {ref['status']}"]
    if mine["status"] != 200 or "stream_error" in mine or "stream_error" in ref:
        if mine.get("param") != ref.get("param") or mine.get("stream_error") != ref.get("stream_error"):
            out.append(f"error {mine} != {ref}")
        return out
    if mine["usage"] != ref["usage"]:
        out.append(f"usage {mine['usage']} != {ref['usage']}")
    if mine["prompt_text"] != ref["prompt_text"]:
        out.append(f"prompt_text {mine['prompt_text']!r} != {ref['prompt_text']!r}")
    if len(mine["choices"]) != len(ref["choices"]):
        return out + [f"{len(mine['choices'])} choices != {len(ref['choices'])}"]
    for m, r in zip(mine["choices"], ref["choices"]):
        for key in ("text", "token_ids", "finish_reason", "tool_calls", "role"):
            if m[key] != r[key]:
                out.append(f"choice {m['index']} {key}: {m[key]!r} != {r[key]!r}")
        if not _lp_equal(m["lp"], r["lp"]):
            out.append(f"choice {m['index']} logprobs differ")
    return out
