"""OpenAI request parsing/validation and response (and SSE chunk) builders.

The router accepts the subset of the OpenAI API it can serve exactly across a prefill -> decode hand-off:
one choice (``n=1``), no logprobs/echo/tools. Fields it does not know are ignored (as vLLM does); fields it
knows but cannot honour are refused with 400 naming the field.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request
from .limits import load_json

# Known-but-unsupported fields: refused (silently dropping them would change results).
UNSUPPORTED_FIELDS = {
    "completions": ("suffix", "logit_bias", "prompt_embeds", "response_format", "structured_outputs", "guided_json",
                    "guided_regex", "guided_choice", "guided_grammar", "use_beam_search", "prompt_logprobs"),
    "chat": ("tools", "functions", "tool_choice", "logit_bias", "response_format", "structured_outputs",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar", "use_beam_search",
             "prompt_logprobs", "audio", "modalities", "prediction"),
}
_INT64 = 2 ** 63


@dataclass
class GenerationRequest:
    """A validated client request, normalized for both endpoints."""

    kind: str  # "completions" | "chat"
    model: str | None
    prompt_text: str | None = None  # completions: text prompt
    prompt_ids: list[int] | None = None  # completions: token-id prompt (or filled in after tokenization)
    messages: list[dict[str, Any]] | None = None  # chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = True
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # forwarded to workers as is
    return_token_ids: bool = False
    timings: bool = False
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
            self.request_id = prefix + uuid.uuid4().hex


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _opt_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _opt_number(body: dict, name: str, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad_request(f"'{name}' must be a number, got {v!r}", name)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad_request(f"'{name}'={v} is out of range: must be {'>' if lo_open else '>='} {lo}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}'={v} is out of range: must be <= {hi}", name)
    return v


def _opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}'={v} is out of range: must be >= {lo}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}'={v} is out of range: must be <= {hi}", name)
    return v


def _token_id_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad_request(f"'{name}' must be a list of non-negative integer token ids", name)
    return v


def _parse_common(body: dict, req: GenerationRequest) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    req.model = model
    for name in UNSUPPORTED_FIELDS[req.kind]:
        if body.get(name) not in (None, False, [], {}):
            raise bad_request(f"'{name}' is not supported by the pdserve router", name, "unsupported_parameter")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise bad_request(f"'n'={n}: the pdserve router serves one choice per request (n=1)", "n",
                          "unsupported_parameter")
    best_of = _opt_int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise bad_request("'best_of' > 1 is not supported by the pdserve router", "best_of", "unsupported_parameter")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("'logprobs' is not supported by the pdserve router", "logprobs", "unsupported_parameter")

    req.stream = _opt_bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
        if not req.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        req.include_usage = _opt_bool(so, "include_usage")
        req.continuous_usage = _opt_bool(so, "continuous_usage_stats")

    stop = body.get("stop")
    if stop is None:
        req.stop = []
    elif isinstance(stop, str):
        req.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop = [s for s in stop if s]
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if body.get("stop_token_ids") is not None:
        req.stop_token_ids = _token_id_list(body["stop_token_ids"], "stop_token_ids")
    req.include_stop_str_in_output = _opt_bool(body, "include_stop_str_in_output")

    s: dict[str, Any] = {}
    for name, lo, hi, lo_open in (("temperature", 0.0, None, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False), ("repetition_penalty", 0.0, None, True)):
        v = _opt_number(body, name, lo, hi, lo_open)
        if v is not None:
            s[name] = v
    top_k = _opt_int(body, "top_k", -1)
    if top_k is not None:
        s["top_k"] = top_k
    seed = _opt_int(body, "seed", -_INT64, _INT64 - 1)
    if seed is not None:
        s["seed"] = seed
    if _opt_bool(body, "ignore_eos"):
        s["ignore_eos"] = True
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if name in body and body[name] is not None:
            s[name] = _opt_bool(body, name)
    for name in ("presence_penalty", "frequency_penalty"):
        v = _opt_number(body, name, -2.0, 2.0)
        if v:
            raise bad_request(f"'{name}' is not supported by the pdserve router (the decode worker would not see "
                              "the first token as output)", name, "unsupported_parameter")
    req.sampling = s
    req.return_token_ids = _opt_bool(body, "return_token_ids")
    req.timings = _opt_bool(body, "pdserve_timings")


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    req = GenerationRequest(kind="completions", model=None)
    _parse_common(body, req)
    if body.get("echo"):
        raise bad_request("'echo' is not supported by the pdserve router", "echo", "unsupported_parameter")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        req.prompt_text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("'prompt' holds several prompts: send one prompt per request", "prompt",
                              "unsupported_parameter")
        req.prompt_ids = _token_id_list(prompt, "prompt")
    else:
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    req.add_special_tokens = _opt_bool(body, "add_special_tokens", True)
    # OpenAI's default is 16; an explicit null means "up to the context limit" (as in vLLM).
    req.max_tokens = _opt_int(body, "max_tokens", 1) if "max_tokens" in body else 16
    return req


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise bad_request(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", "messages")
        return "\n".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    req = GenerationRequest(kind="chat", model=None)
    _parse_common(body, req)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        msg = {"role": m["role"], "content": "" if content is None else _message_text(content, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    req.messages = out
    req.add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
    req.continue_final_message = _opt_bool(body, "continue_final_message", False)
    if req.add_generation_prompt and req.continue_final_message and "add_generation_prompt" in body:
        raise bad_request("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                          "continue_final_message")
    if req.continue_final_message:
        req.add_generation_prompt = False
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        req.chat_template_kwargs = ctk
    req.add_special_tokens = _opt_bool(body, "add_special_tokens", False)
    mt = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if mt is None:
        mt, name = body.get("max_tokens"), "max_tokens"
    req.max_tokens = None if mt is None else _opt_int({name: mt}, name, 1)
    return req


def parse_json(raw: bytes) -> Any:
    """The body as JSON; 400 when it is not JSON or nests too deeply (see :mod:`.limits`)."""
    return load_json(raw)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---- responses ----

def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Builds one request's response objects (full or SSE chunks) in the shape of its endpoint."""

    def __init__(self, req: GenerationRequest, model_name: str) -> None:
        self.req = req
        self.model = model_name
        self.created = int(time.time())
        self.chat = req.kind == "chat"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, stop_reason: Any, token_ids: list[int],
             prompt_tokens: int, prompt_ids: list[int] | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            out = self._base("text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
            if not self.chat:
                choice["prompt_token_ids"] = prompt_ids
            else:
                out["prompt_token_ids"] = prompt_ids
        out["choices"] = [choice]
        out["usage"] = usage_dict(prompt_tokens, len(token_ids))
        return out

    def chunk(self, text: str, token_ids: list[int] | None = None, finish_reason: str | None = None,
              stop_reason: Any = None, role: bool = False, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._base("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
            if prompt_ids is not None:
                if self.chat:
                    out["prompt_token_ids"] = prompt_ids
                else:
                    choice["prompt_token_ids"] = prompt_ids
        out["choices"] = [choice]
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        out = self._base("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = []
        out["usage"] = usage_dict(prompt_tokens, completion_tokens)
        return out


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
