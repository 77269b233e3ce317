"""Cases for the differential conformance suite: for each field of the installed vLLM's request models, valid
values (and edge values, some just outside the valid range) generated from the field's type and constraints.

The field list comes from vLLM's pydantic models (``model_fields``), as tests/unit/test_router_fields.py takes
it; each field's values come from its annotation: booleans both ways, every ``Literal`` member, integers at
their ``Ge``/``Le`` bounds and just past them, numbers at the bounds vLLM's ``SamplingParams`` checks
(:data:`RANGES`: those live in vLLM's code, not in the annotation). Fields whose values need meaning the
type cannot give (a prompt, messages, a JSON schema, token ids of this model) take them from :data:`VALUES`.
A field with no case must be in :data:`NO_CASES` with the reason; ``test_every_field_has_cases`` checks that.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT = "The quick brown fox jumps over the lazy dog and then it"
MESSAGES = [{"role": "user", "content": "Name three colours and say why you like them."}]
BASE: dict[str, dict[str, Any]] = {
    "completions": {"model": "rl", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    "chat": {"model": "rl", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
}
MAX_MODEL_LEN = 2048  # pd_cluster's
_INT64 = 2 ** 63

# vLLM's SamplingParams checks (sampling_params.py, _verify_args), or the router's documented limits:
# (low, high, low excluded, high is a bound: high + 1 is a case too)
RANGES: dict[str, tuple[float, float | None, bool, bool]] = {
    "temperature": (0.0, None, False, False), "top_p": (0.0, 1.0, True, True), "min_p": (0.0, 1.0, False, True),
    "repetition_penalty": (0.0, None, True, False), "presence_penalty": (-2.0, 2.0, False, True),
    "frequency_penalty": (-2.0, 2.0, False, True), "length_penalty": (-2.0, 2.0, False, False),
    "top_k": (-1, 3, False, False), "n": (1, 3, False, False), "max_tokens": (1, MAX_MODEL_LEN, False, True),
    "max_completion_tokens": (1, MAX_MODEL_LEN, False, True), "min_tokens": (0, 6, False, False),
    "logprobs": (0, 20, False, True), "top_logprobs": (0, 20, False, True), "prompt_logprobs": (-1, 5, False, False),
    "stream_interval": (1, 8, False, False), "thinking_token_budget": (0, 8, False, False),
}

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
# values that need meaning the type cannot give (completions and chat alike unless the name says otherwise)
VALUES: dict[str, list[Any]] = {
    "model": ["rl", "no-such-model"],
    "prompt": [PROMPT, [1500, 1501, 1502, 1503], [PROMPT, "a b c"], "x", [[7, 8, 9], [10, 11]]],
    "messages": [MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES],
                 [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]],
    "stop": [" the", [" a", " b"], "", []],
    "stream_options": [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
    "logit_bias": [{"1500": 100.0}, {"1500": -100.0, "1501": 5.0}],
    "allowed_token_ids": [[1500, 1501, 1502], list(range(3000, 3040))],
    "logprob_token_ids": [[1500, 1501]],
    "stop_token_ids": [[1500, 1501], []],
    "bad_words": [["the", " fox"], []],
    "cache_salt": ["tenant-a", "x" * 1024],
    "response_format": [{"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "n", "schema": _SCHEMA}},
                        {"type": "text"}],
    "structured_outputs": [{"choice": ["red", "green", "blue"]}, {"regex": "[a-c]{3}"}, {"json": _SCHEMA}],
    "seed": [0, -_INT64, _INT64 - 1, 42],
    "priority": [0],
    "vllm_xargs": [{"k": "v", "n": 1}],
    "repetition_detection": [{"max_pattern_size": 4, "min_count": 2}],
    "request_id": ["client-42"],
    "session_id": ["s-1"],
    "user": ["u-1"],
    "truncate_prompt_tokens": [-1, 0, 1, 3, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, -2],
    "tools": [[_TOOL]],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
    "documents": [[{"title": "t", "text": "Blue is calm."}]],
    "chat_template_kwargs": [{"enable_thinking": False}, {}],
    "routed_experts_prompt_start": [0],
    # the context's edges without generating ~2,000 tokens on 2 cores: past it, and a prompt that leaves 8 tokens
    "max_tokens": [1, 0, MAX_MODEL_LEN + 1], "max_completion_tokens": [1, 0, MAX_MODEL_LEN + 1],
    "prompt_logprobs": [0, 5, -2],  # -1 (the whole vocabulary per prompt token) is the full tier's
    # refused by name (the known difference "refused"): any non-default value
    "suffix": ["!"], "prompt_embeds": ["AAAA"], "chat_template": ["{{ messages }}"],
    "kv_transfer_params": [{"do_remote_decode": True}], "ec_transfer_params": [{"x": 1}],
    "media_io_kwargs": [{"image": {}}], "mm_processor_kwargs": [{"x": 1}],
}
# fields that need another field to act: the case sends both
WITH: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True}, "include_stop_str_in_output": {"stop": [" the"]},
    "top_logprobs": {"logprobs": True}, "truncation_side": {"truncate_prompt_tokens": 4},
    "continue_final_message": {"add_generation_prompt": False,
                               "messages": [*MESSAGES, {"role": "assistant", "content": "Red, green"}]},
    "tool_choice": {"tools": [_TOOL]}, "parallel_tool_calls": {"tools": [_TOOL]},
    "spaces_between_special_tokens": {"skip_special_tokens": False},
    "return_tokens_as_token_ids": {"logprobs": 1},
}
# chat's own: echo repeats the last message when its role is the answer's (without a generation prompt, the last's)
WITH_CHAT: dict[str, dict[str, Any]] = {
    "echo": {"add_generation_prompt": False, "messages": [*MESSAGES, {"role": "assistant", "content": "Red, green"}]},
}
# fields no generated case can check here, with the reason
NO_CASES: dict[str, str] = {}


@dataclass(frozen=True)
class Case:
    endpoint: str  # "completions" | "chat"
    field: str
    value: Any
    extra: dict[str, Any] = field(default_factory=dict)
    tag: str = ""  # names a case with a body of its own (edge_cases)

    def body(self) -> dict[str, Any]:
        return {**BASE[self.endpoint], **self.extra, self.field: self.value}

    @property
    def name(self) -> str:
        return f"{self.endpoint}.{self.field}={str(self.value)[:40]}" + (f"[{self.tag}]" if self.tag else "")


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """The type inside Optional / Annotated, and the constraints found on the way."""
    metadata: list[Any] = []
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            metadata += list(annotation.__metadata__)
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation, metadata
            annotation = args[0]
        else:
            return annotation, metadata


def _bounds(metadata: list[Any]) -> tuple[int | None, int | None]:
    lo = next((m.ge for m in metadata if hasattr(m, "ge")), None)
    hi = next((m.le for m in metadata if hasattr(m, "le")), None)
    for m in metadata:  # pydantic FieldInfo inside Annotated carries its own metadata
        for inner in getattr(m, "metadata", []):
            lo = getattr(inner, "ge", lo)
            hi = getattr(inner, "le", hi)
    return lo, hi


def generated(name: str, annotation: Any, metadata: list[Any]) -> list[Any]:
    """Values of a field from its type and constraints, edge values first."""
    if name in VALUES:
        return list(VALUES[name])
    kind, inner = _unwrap(annotation)
    metadata = metadata + inner
    if kind is bool:
        return [True, False]
    if typing.get_origin(kind) is typing.Literal:
        return list(typing.get_args(kind)) + ["not-a-member"]
    if kind in (int, float):
        if name in RANGES:
            lo, hi, open_lo, bounded = RANGES[name]
        else:
            lo, hi = _bounds(metadata)
            open_lo, bounded = False, True
        out: list[Any] = []
        if lo is not None:
            out += [lo + (0.5 if open_lo else 0)] if kind is float or not open_lo else [lo + 1]
            out.append(lo - 1)  # just outside: both sides must refuse it alike
        if hi is not None:
            out += [hi, hi + 1] if bounded else [hi]
        if kind is float:
            out.append(0.5)
        return [kind(v) if kind is float else int(v) for v in out] or [1]
    return []


def cases(endpoint: str, model: Any) -> list[Case]:
    """Every generated case of ``endpoint``, field by field in vLLM's order."""
    out = []
    for name, info in model.model_fields.items():
        for value in generated(name, info.annotation, list(info.metadata)):
            extra = dict(WITH_CHAT.get(name, {}) if endpoint == "chat" and name in WITH_CHAT else WITH.get(name, {}))
            if name == "messages" or (name == "continue_final_message" and not value):
                extra.pop("messages", None)
                extra.pop("add_generation_prompt", None)
            out.append(Case(endpoint, name, value, extra))
    return out


def vllm_models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def edge_cases() -> list[Case]:
    """Cases that need a body of their own: a prompt that leaves 8 tokens of room and asks for more, ..."""
    long = {"prompt": [1500 + i % 500 for i in range(MAX_MODEL_LEN - 8)]}
    return [Case("completions", "max_tokens", 100, long, "room-8"),
            Case("completions", "truncate_prompt_tokens", -1, {"prompt": [1500] * (MAX_MODEL_LEN + 50)},
                 "over-context"),
            Case("completions", "prompt_logprobs", -1, {"prompt": "a b"}, "whole-vocab"),
            # issue 41: prompt scoring (echo, max_tokens 0), with and without logprobs; n at vLLM's bound
            Case("completions", "max_tokens", 0, {"echo": True, "logprobs": 2}, "score"),
            Case("completions", "max_tokens", 0, {"echo": True}, "score-plain"),
            Case("completions", "n", 16385, {"temperature": 1.0}, "past-vllm-bound"),
            Case("chat", "n", 16385, {"temperature": 1.0}, "past-vllm-bound"),
            Case("completions", "n", 2, {"prompt": ["a b", "c d"], "temperature": 0.0}, "greedy-prompts"),
            # beam search (served whole on one worker, as vLLM's serving layer runs it): 3 beams, a length penalty,
            # a prompt list; greedy beams are deterministic, so token for token
            Case("completions", "use_beam_search", True, {"n": 3, "length_penalty": 0.5}, "beams-3"),
            Case("completions", "use_beam_search", True, {"n": 2, "prompt": ["a b", "c d"]}, "beams-prompts"),
            Case("chat", "use_beam_search", True, {"n": 3, "length_penalty": 1.5}, "beams-3")]


# the quick tier's fields: those the router itself reads, rewrites or refuses (pdserve.router.api.fields); the ones
# it passes to the worker as they are ("forwarded", "ignored_as_vllm") are the full tier's, and test_pd_router's
# test_forwarded_fields_equal_one_worker checks that they arrive
QUICK_USES = ("router", "regenerated", "refused")


def quick(all_cases: list[Case], per_field: int = 1) -> list[Case]:
    """The quick tier: the first ``per_field`` values (the edge values come first) of each field in QUICK_USES."""
    from pdserve.router.api.fields import FIELDS

    seen: dict[tuple[str, str], int] = {}
    out = []
    for c in all_cases:
        k = (c.endpoint, c.field)
        if FIELDS[c.endpoint].get(c.field, ("",))[0] not in QUICK_USES:
            continue
        if seen.get(k, 0) < per_field:
            seen[k] = seen.get(k, 0) + 1
            out.append(c)
    return out
