"""OpenAI request parsing/validation and response (and SSE chunk) builders.

The router serves the OpenAI API exactly across a prefill -> decode hand-off: logprobs (+ echo and vLLM's
prompt_logprobs), ``n`` choices, prompt lists, structured outputs (``response_format``, ``structured_outputs``)
and tools. What happens to each field of vLLM's request models is one line of :mod:`.fields`: read by the router,
forwarded to the workers (or forwarded with D regenerating the first token), ignored as vLLM ignores it, or
refused with a 400 naming it. Fields vLLM does not know either are ignored (as vLLM does).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import bad_request, model_param
from .chat_request import chat_role_and_echo, parse_messages, parse_tools, template_extras
from .fields import EXTRA_REFUSED, NOT_NULL, names, refuse_nulls
from .lax_values import as_flag, flag, integral
from .limits import load_json
from .sampling_refusals import GREEDY_EPS, check_n, out_of_range
from .truncation import Truncation, parse_truncation

# Known-but-unsupported fields: refused (silently dropping them would change results).
UNSUPPORTED_FIELDS = {kind: names(kind, "refused") + EXTRA_REFUSED[kind] for kind in ("completions", "chat")}
# vLLM's older names for structured outputs: refused with the field to use instead.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
CACHE_SALT_MAX = 128  # vLLM 0.32 refuses a longer cache_salt, or one with these characters
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
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
    response_role: str = "assistant"  # chat: the answer's role (vLLM: the last message's without a generation prompt)
    return_prompt_text: bool = False  # chat: the answer carries the rendered prompt (vLLM's prompt_text)
    chat_echo: str = ""  # chat echo: the last message's content, before each choice's (when its role is the answer's)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = True
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # the field that set it (chat: max_completion_tokens wins), named in errors
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # forwarded to workers as is
    return_token_ids: bool = False
    include_reasoning: bool = True  # chat: False hides the tokens' details where a parser runs (token_details)
    # whether the answer shows each output token's id and logprobs: vLLM 0.32 hides them (not the text) for a chat
    # request with include_reasoning: false when it runs a tool or reasoning parser (set by the router's app)
    token_details: bool = True
    timings: bool = False
    request_id: str = ""  # the router's own, unique: the conductor's and the workers' request id
    response_id: str = ""  # the answer's id when the client named the request (vLLM: prefix + its request_id)
    lora: str | None = None  # the LoRA adapter ``model`` names (set by the router's model check): P and D run it
    gateway_pair: Any = None  # --prefiller-header: the pair the gateway's picker chose (router/fleet/sidecar.Pair)
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # top alternatives per output token (chat: top_logprobs); None: no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    score_only: bool = False  # completions: echo with max_tokens 0: the prompt alone (its one generated token hidden)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as asked (echo alone sends logprobs to workers)
    prompts: list[str | list[int]] | None = None  # completions: several prompts (one request each, fanned out)
    constrained: bool = False  # structured outputs: D regenerates the first token (Generation first_from_prefill)
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True
    truncation: Truncation | None = None  # truncate_prompt_tokens / truncation_side (the router truncates)

    def __post_init__(self) -> None:
        if not self.request_id:
            prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
            self.request_id = prefix + uuid.uuid4().hex


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _opt_number(body: dict, name: str, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad_request(f"'{name}' must be a number, got {v!r}", name)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise out_of_range(name, v, f"'{name}'={v} is out of range: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v > hi:
        raise out_of_range(name, v, f"'{name}'={v} is out of range: must be <= {hi}")
    return v


def _opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = integral(body.get(name))
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise out_of_range(name, v, f"'{name}'={v} is out of range: must be >= {lo}")
    if hi is not None and v > hi:
        raise out_of_range(name, v, f"'{name}'={v} is out of range: must be <= {hi}")
    return v


def token_id_list(v: Any, name: str) -> list[int]:
    """``v`` as a list of token ids (integral floats read as ints, as vLLM's models read them), or a 400."""
    v = [integral(t) for t in v] if isinstance(v, list) else v
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
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is vLLM's old name: send \"structured_outputs\": {{\"{kind}\": ...}}",
                              name, "unsupported_parameter")
    req.n = _opt_int(body, "n", 1) or 1
    best_of = _opt_int(body, "best_of", 1)
    if best_of not in (None, 1, req.n):
        raise bad_request("'best_of' > n is not supported by the pdserve router", "best_of", "unsupported_parameter")
    _parse_logprobs(body, req)
    req.truncation = parse_truncation(body)

    req.stream = flag(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
        if not req.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        req.include_usage = flag(so, "include_usage")
        req.continuous_usage = flag(so, "continuous_usage_stats")
    if req.stream and req.prompt_logprobs:  # as vLLM 0.32 refuses it (0 passes there: a falsy value)
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")

    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if "" in stops:  # as vLLM 0.32 refuses it (an empty stop string would end every answer at once), unnamed
        raise bad_request("stop cannot contain an empty string.")
    req.stop = list(stops)
    if body.get("stop_token_ids") is not None:
        req.stop_token_ids = token_id_list(body["stop_token_ids"], "stop_token_ids")
    req.include_stop_str_in_output = flag(body, "include_stop_str_in_output")

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
    if flag(body, "ignore_eos"):
        s["ignore_eos"] = True
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if name in body and body[name] is not None:
            s[name] = flag(body, name)
    _forward(body, req, s)
    if s.get("logprob_token_ids") and req.logprobs is None:  # as vLLM's request model refuses it (before a stream)
        raise bad_request("when using `logprob_token_ids`, `logprobs` must be set"
                          + (" to true." if req.kind == "chat" else "."), "logprob_token_ids")
    if req.logprobs is not None:
        s["logprobs"] = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs  # as vLLM: echo with logprobs scores the prompt too
    if prompt_logprobs is not None:
        s["prompt_logprobs"] = prompt_logprobs
    _parse_structured(body, req, s)
    check_n(req.n, s.get("temperature"))
    if seeded_random(s):
        # seeded random sampling: D samples every token, so all come from the one random stream vLLM seeds per
        # request, as on one worker (P's token would be draw 1 of P's stream and D's next draw 1 of its own;
        # docs/seeded-sampling.md)
        req.constrained = True
    req.sampling = s
    req.return_token_ids = flag(body, "return_token_ids")
    req.timings = flag(body, "pdserve_timings")


def _salt(v: str, name: str) -> str:
    if not v:
        raise bad_request(f"'{name}' must be a non-empty string, got {v!r}", name)
    if len(v) > CACHE_SALT_MAX or CACHE_SALT_FORBIDDEN & set(v):
        raise bad_request(f"'{name}' must be at most {CACHE_SALT_MAX} characters and must not contain "
                          "'@', '/', '\\', or NUL", name)
    return v


def _at_least(lo: int) -> Callable[[int, str], int]:
    def check(v: int, name: str) -> int:
        if v < lo:
            raise out_of_range(name, v, f"'{name}' must be >= {lo}, got {v!r}")
        return v
    return check


def _int64(v: int, name: str) -> int:
    if not -_INT64 <= v < _INT64:
        raise bad_request(f"'{name}' must be a 64-bit integer, got {v!r}", name)
    return v


def _strings(v: list[Any], name: str) -> list[str]:
    if not all(isinstance(w, str) for w in v):
        raise bad_request(f"'{name}' must be a list of strings", name)
    return v


def _bias(v: dict[Any, Any], name: str) -> dict[str, float]:
    # a negative id reads as vLLM reads it, an id out of the vocabulary (app: check_ids)
    if not all(isinstance(k, str) and k.isascii() and k.removeprefix("-").isdigit() and _is_num(b)
               for k, b in v.items()):
        raise bad_request(f"'{name}' maps token ids (as strings) to numbers", name)
    return v


def _allowed(v: list[Any], name: str) -> list[int]:
    ids = token_id_list(v, name)
    if not ids:  # as vLLM 0.32 refuses it
        raise bad_request("allowed_token_ids is not None and empty!", name)
    return ids


# a forwarded field's value checks past its JSON type, as vLLM makes them (the value to send, or a 400 naming it)
_VALUE_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "cache_salt": _salt, "stream_interval": _at_least(1), "min_tokens": _at_least(0), "priority": _int64,
    "bad_words": _strings, "logit_bias": _bias, "allowed_token_ids": _allowed, "logprob_token_ids": token_id_list}


def _forward(body: dict, req: GenerationRequest, s: dict[str, Any]) -> None:
    """The fields the workers read as vLLM does (:mod:`.fields`: forwarded, regenerated), checked for their JSON
    type here (the workers check the rest: a 400 from P reaches the client as it is). A regenerated field set to
    a value that acts makes D regenerate the first token (``constrained``)."""
    if body.get("mm_payload") not in (None, "tensors", "none"):  # ignored here, as by vLLM, which checks it
        raise bad_request(f"'mm_payload' must be 'tensors' or 'none', got {body['mm_payload']!r}",
                          model_param("mm_payload"))
    for name in ("presence_penalty", "frequency_penalty"):
        v = _opt_number(body, name, -2.0, 2.0)
        if v:
            s[name] = v
            req.constrained = True
    checks: dict[str, tuple[type | tuple[type, ...], bool]] = {
        "logit_bias": (dict, False), "allowed_token_ids": (list, False), "cache_salt": (str, False),
        "priority": (int, False), "return_tokens_as_token_ids": (bool, False), "logprob_token_ids": (list, False),
        "vllm_xargs": (dict, False), "bad_words": (list, True), "repetition_detection": (dict, True),
        "thinking_token_budget": (int, True), "watermarking": (bool, True), "stream_interval": (int, False),
        "min_tokens": (int, False)}
    for name, (kind, regenerated) in checks.items():
        v = integral(body.get(name)) if kind is int else body.get(name)
        if v is None:
            continue
        if kind is bool:
            v = as_flag(v, name)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise bad_request(f"'{name}' must be of type {want}, got {v!r}", name)
        check = _VALUE_CHECKS.get(name)
        if check is not None:
            v = check(v, name)
        if (v is False or (isinstance(v, (list, dict)) and not v)) and name != "priority":
            continue  # vLLM's default: nothing to send (an int 0 is sent: thinking_token_budget=0 is refused there)
        s[name] = v
        if regenerated:
            req.constrained = True
    rid = body.get("request_id")
    if rid is not None:
        if not isinstance(rid, str) or not rid:
            raise bad_request(f"'request_id' must be a non-empty string, got {rid!r}", "request_id")
        req.response_id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + rid


def _parse_logprobs(body: dict, req: GenerationRequest) -> None:
    """Completions: ``logprobs`` = N alternatives, ``echo``. Chat: ``logprobs`` true + ``top_logprobs`` = N.
    Both: vLLM's ``prompt_logprobs`` = N (-1: the whole vocabulary)."""
    if req.kind == "chat":
        if flag(body, "logprobs"):
            # -1 (the whole vocabulary) goes on: the workers refuse it naming logprobs past their --max-logprobs
            req.logprobs = _opt_int(body, "top_logprobs", -1) or 0
        elif _opt_int(body, "top_logprobs", -1) not in (None, 0):
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        req.logprobs = _opt_int(body, "logprobs", -1)  # -1 goes on: the workers' engines refuse it (in-stream)
        req.echo = flag(body, "echo")
    req.prompt_logprobs = _opt_int(body, "prompt_logprobs", -1)


def _parse_structured(body: dict, req: GenerationRequest, s: dict[str, Any]) -> None:
    """``response_format`` and ``structured_outputs`` go to the workers as is (vLLM validates the schema or
    grammar and answers 400 itself); such requests are marked ``constrained``."""
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in _RESPONSE_FORMATS:
            raise bad_request("'response_format' must be an object with 'type' one of " + ", ".join(_RESPONSE_FORMATS),
                              "response_format")
        if rf.get("json_schema") is not None and not isinstance(rf["json_schema"], dict):
            raise bad_request("response_format.json_schema must be an object", "response_format")
        if rf["type"] == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise bad_request("response_format type 'json_schema' needs a 'json_schema' object "
                              "({\"name\": ..., \"schema\": {...}})", "response_format")
        if rf["type"] != "text":
            s["response_format"] = rf
            req.constrained = True
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object with one of " + ", ".join(_STRUCTURED_KINDS),
                              "structured_outputs")
        kinds = [k for k in _STRUCTURED_KINDS if so.get(k) is not None]
        if len(kinds) != 1:
            raise bad_request("'structured_outputs' needs exactly one of " + ", ".join(_STRUCTURED_KINDS)
                              + (f", got {kinds}" if kinds else ""), "structured_outputs")
        if "response_format" in s:
            raise bad_request("send either 'response_format' or 'structured_outputs', not both", "structured_outputs")
        s["structured_outputs"] = so
        req.constrained = True


def _one_prompt(prompt: Any, name: str = "prompt") -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{name}' is empty", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request(f"'{name}' is empty", "prompt")
        return token_id_list(prompt, "prompt")
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of those", "prompt")


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    refuse_nulls(body, NOT_NULL["completions"])
    req = GenerationRequest(kind="completions", model=None)
    _parse_common(body, req)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required: a string or a list of token ids", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if len(prompts) > 1:
            req.prompts = prompts
        prompt = prompts[0]
    one = _one_prompt(prompt)
    if isinstance(one, str):
        req.prompt_text = one
    else:
        req.prompt_ids = one
    req.add_special_tokens = flag(body, "add_special_tokens", True)
    # OpenAI's default is 16; vLLM 0.32 reads an explicit null as that default too. echo with max_tokens 0 scores
    # the prompt (vLLM's echo_without_generation: one token generated and not shown; the answer is the prompt)
    max_tokens = _opt_int(body, "max_tokens", 0 if req.echo else 1)
    req.score_only = req.echo and max_tokens == 0
    if req.score_only and req.sampling.get("logprob_token_ids"):
        raise bad_request("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                          "output tokens are generated.", "logprob_token_ids")
    req.max_tokens = 1 if req.score_only else max_tokens or 16
    _min_tokens_fit(req)
    return req


def parse_chat(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    refuse_nulls(body, NOT_NULL["chat"])
    req = GenerationRequest(kind="chat", model=None)
    _parse_common(body, req)
    req.messages = parse_messages(body.get("messages"))
    req.include_reasoning = flag(body, "include_reasoning", True)
    req.parallel_tool_calls = flag(body, "parallel_tool_calls", True)  # checked even without tools, as vLLM does
    tools = parse_tools(body, req.sampling)
    if tools is not None:
        req.tools, req.tool_choice = tools.tools, tools.choice
        req.constrained = req.constrained or tools.constrained
    req.add_generation_prompt = flag(body, "add_generation_prompt", True)
    req.response_role, req.chat_echo = chat_role_and_echo(req.messages, req.add_generation_prompt, flag(body, "echo"))
    req.continue_final_message = flag(body, "continue_final_message", False)
    req.return_prompt_text = flag(body, "return_prompt_text")
    if req.add_generation_prompt and req.continue_final_message and "add_generation_prompt" in body:
        raise bad_request("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                          "continue_final_message")
    if req.continue_final_message:
        req.add_generation_prompt = False
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        unexpected = sorted({"chat_template", "tokenize"} & ctk.keys())  # as vLLM refuses them
        if unexpected:
            raise bad_request(f"Found unexpected chat template kwargs from request: {unexpected}",
                              "chat_template_kwargs")
        req.chat_template_kwargs = ctk
    req.chat_template_kwargs = template_extras(body, req.chat_template_kwargs)
    req.add_special_tokens = flag(body, "add_special_tokens", False)
    _opt_int(body, "max_tokens")  # an integer even when max_completion_tokens wins (vLLM's model checks both)
    mt = body.get("max_completion_tokens")
    if mt is None:
        mt = body.get("max_tokens")
    else:
        req.max_tokens_field = "max_completion_tokens"  # named when it is over the room left, as vLLM does
    req.max_tokens = None if mt is None else _opt_int({"max_tokens": mt}, "max_tokens", 1)  # vLLM names max_tokens
    _min_tokens_fit(req)
    return req


def seeded_random(sampling: dict[str, Any]) -> bool:
    """Random sampling from the request's own seeded stream (vLLM's ``SamplingType.RANDOM_SEED``)."""
    return "seed" in sampling and not (sampling.get("temperature", 1.0) < GREEDY_EPS)


def _min_tokens_fit(req: GenerationRequest, max_tokens: int | None = None) -> None:
    """vLLM's check of ``min_tokens`` against ``max_tokens`` (SamplingParams), with its message: P and D each get a
    share of both, which alone would never break it."""
    least = req.sampling.get("min_tokens")
    budget = req.max_tokens if max_tokens is None else max_tokens
    if budget is not None and isinstance(least, int) and least > budget:
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={budget}, got {least}.")


def clamped_max_tokens(req: GenerationRequest, room: int) -> int:
    """The output budget as vLLM 0.32 sets it (``get_max_tokens``): ``max_tokens`` (at most ``max_model_len``, checked
    before) clamped to the ``room`` the prompt leaves; then SamplingParams' ``min_tokens`` check, against that value."""
    assert req.max_tokens is not None
    budget = min(req.max_tokens, room)
    _min_tokens_fit(req, budget)
    return budget


def parse_json(raw: bytes) -> Any:
    """The body as JSON; 400 when it is not JSON or nests too deeply (see :mod:`.limits`)."""
    return load_json(raw)
