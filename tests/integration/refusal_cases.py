"""Bodies vLLM refuses (issue 42), and how one is answered: sent to the 1P1D router and to one plain vLLM worker
(a worker of the same stack, on its own endpoints), streamed and not; compared by status, error type and, for a
stream, the error event's code. The router's answer must also not name a worker or show a Python repr."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_TEXT = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

# differences found and not fixed yet, by row name: each must still differ (a fixed one fails the test until its
# line goes)
OPEN: dict[str, str] = {}

# (name, path, body without "model"): each one vLLM 0.32 refuses
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("structured_outputs json_object false", COMPLETIONS, {**_TEXT, "structured_outputs": {"json_object": False}}),
    ("structured_outputs invalid regex", COMPLETIONS, {**_TEXT, "structured_outputs": {"regex": "("}}),
    ("structured_outputs invalid json schema", COMPLETIONS,
     {**_TEXT, "structured_outputs": {"json": {"type": "nonsense"}}}),
    ("structured_outputs two kinds", COMPLETIONS, {**_TEXT, "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("structured_outputs empty choice", COMPLETIONS, {**_TEXT, "structured_outputs": {"choice": []}}),
    ("logit_bias key not an integer", COMPLETIONS, {**_TEXT, "logit_bias": {"abc": 1}}),
    ("logit_bias key out of vocabulary", COMPLETIONS, {**_TEXT, "logit_bias": {"99999999": 1}}),
    ("logit_bias key negative", COMPLETIONS, {**_TEXT, "logit_bias": {"-1": 1}}),
    ("max_tokens over max_model_len", COMPLETIONS, {**_TEXT, "max_tokens": 100000}),
    ("allowed_token_ids out of vocabulary", COMPLETIONS, {**_TEXT, "allowed_token_ids": [99999999]}),
    ("stop_token_ids out of vocabulary", COMPLETIONS, {**_TEXT, "stop_token_ids": [99999999]}),
    ("prompt id out of vocabulary", COMPLETIONS, {**_TEXT, "prompt": [99999999]}),
    ("logprobs over max_logprobs", COMPLETIONS, {**_TEXT, "logprobs": 100}),
    ("min_tokens over max_tokens", COMPLETIONS, {**_TEXT, "min_tokens": 10}),
    ("temperature negative", COMPLETIONS, {**_TEXT, "temperature": -1}),
    ("top_p over 1", COMPLETIONS, {**_TEXT, "top_p": 2}),
    ("top_k -5", COMPLETIONS, {**_TEXT, "top_k": -5}),
    ("bad_words empty string", COMPLETIONS, {**_TEXT, "bad_words": [""]}),
    ("chat structured_outputs json_object false", CHAT, {**_CHAT, "structured_outputs": {"json_object": False}}),
    ("chat response_format json_schema without schema", CHAT, {**_CHAT, "response_format": {"type": "json_schema"}}),
    ("chat logit_bias key not an integer", CHAT, {**_CHAT, "logit_bias": {"x": 1}}),
    ("chat max_tokens over max_model_len", CHAT, {**_CHAT, "max_tokens": 100000}),
    ("chat tool_choice required without tools", CHAT, {**_CHAT, "tool_choice": "required"}),
]


@dataclass
class Answer:
    status: int
    kind: str  # the error's type ("ok" when none); a stream's error event: "event <code> <type>"
    message: str
    param: str | None = None


def post(url: str, body: dict[str, Any], timeout: float = 120) -> Answer:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    if body.get("stream") and status == 200:
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        err = next((e["error"] for e in events if "error" in e), None)
        if err is None:
            return Answer(status, "ok", "")
        return Answer(status, f"event {err.get('code')} {err.get('type')}", str(err.get("message")), err.get("param"))
    try:
        answer = json.loads(raw)
    except ValueError:
        return Answer(status, "not JSON", raw[:200])
    err = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(err, dict):
        return Answer(status, "ok", "")
    return Answer(status, str(err.get("type")), str(err.get("message")), err.get("param"))


def compare(router_url: str, worker_url: str, model: str) -> list[tuple[str, Answer, Answer]]:
    """Each case, unstreamed and streamed: (its name, the router's answer, the worker's)."""
    out = []
    for name, path, body in CASES:
        for stream in (False, True):
            b = {**body, "model": model, "stream": stream}
            out.append((name + (" (streamed)" if stream else ""), post(router_url + path, b),
                        post(worker_url + path, b)))
    return out


def leaks(a: Answer, worker_urls: list[str]) -> bool:
    """The router's message names a worker or shows a Python dict's repr."""
    return any(u in a.message for u in worker_urls) or "{'" in a.message


def table(rows: list[tuple[str, Answer, Answer]]) -> str:
    lines = ["| body | pdserve | one vLLM worker | equal |", "|---|---|---|---|"]
    for name, mine, ref in rows:
        same = (mine.status, mine.kind) == (ref.status, ref.kind)
        lines.append(f"| {name} | {mine.status} {mine.kind} ({mine.param}) | {ref.status} {ref.kind} ({ref.param}) "
                     f"| {'yes' if same else 'open' if name in OPEN else 'NO'} |")
    return "\n".join(lines)


# refused by D alone: P's call leaves structured_outputs out (D produces every token under the grammar), so this
# refusal reaches the client through D's answer, whatever connector carried P's KV
D_REFUSES: tuple[str, str, dict[str, Any]] = CASES[0]


def d_refusal_differences(router_url: str, worker_url: str, worker_urls: list[str], model: str) -> list[str]:
    """D's refusal through the router vs one worker's answer, streamed and not: what differs (empty: nothing)."""
    name, path, body = D_REFUSES
    out = []
    for stream in (False, True):
        b = {**body, "model": model, "stream": stream}
        mine, ref = post(router_url + path, b), post(worker_url + path, b)
        if (mine.status, mine.kind, mine.message) != (ref.status, ref.kind, ref.message) or leaks(mine, worker_urls):
            out.append(f"{name}{' (streamed)' if stream else ''}: pdserve {mine} != vLLM {ref}")
    return out
