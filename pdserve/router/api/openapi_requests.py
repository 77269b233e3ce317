"""The request schemas of /v1/completions, /v1/chat/completions and /tokenize in the router's OpenAPI document
(:mod:`.openapi`): the fields :mod:`.protocol` parses, with the ranges and rules it enforces; fields it refuses
(``suffix``, ``kv_transfer_params``, ...) take only what reads as "not sent"."""

from __future__ import annotations

from typing import Any

from . import openapi_rules as rules
from .chat_request import REASONING_EFFORTS
from .fields import NOT_NULL, TOKENIZE_CHAT_FIELDS
from .openapi_parts import (
    BOOL,
    INT64,
    NAME,
    OFF,
    SALT,
    STOP,
    STR,
    TEMPLATE_KWARGS,
    TOKEN_IDS,
    TRUE,
    nullable,
    ref,
    tool_rules,
    with_nulls,
)
from .protocol import GUIDED, UNSUPPORTED_FIELDS
from .sampling_refusals import GREEDY_EPS, max_n

Fields = list[tuple[str, dict[str, Any], str]]  # (name, schema, description)

# the fields both generation endpoints take (protocol._parse_common)
COMMON: Fields = [
    ("model", STR, "the served model name (GET /v1/models); omitted: the one model"),
    ("stream", BOOL, "answer with server-sent events"),
    ("stream_options", {"type": "object", "properties": {"include_usage": nullable(BOOL),
                                                         "continuous_usage_stats": nullable(BOOL)}},
     "only with stream: true"),
    ("stop", {"anyOf": [STOP, {"type": "array", "items": STOP}]}, "stop string(s), none of them empty"),
    ("stop_token_ids", TOKEN_IDS, "token ids that end the generation"),
    ("include_stop_str_in_output", BOOL, "keep the matched stop string in the text"),
    ("temperature", {"type": "number", "minimum": 0}, "sampling temperature"),
    ("top_p", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "nucleus sampling"),
    ("min_p", {"type": "number", "minimum": 0, "maximum": 1}, "min-p sampling"),
    ("repetition_penalty", {"type": "number", "exclusiveMinimum": 0}, "vLLM repetition penalty"),
    ("top_k", {"type": "integer", "minimum": -1}, "top-k sampling (-1: off)"),
    ("seed", {"type": "integer", "minimum": -INT64, "maximum": INT64 - 1}, "sampling seed"),
    ("ignore_eos", BOOL, "keep generating past EOS"),
    ("use_beam_search", BOOL, "beam search (n beams): the whole request on one worker, its answer relayed as that "
                              "worker (vLLM) gives it"),
    ("skip_special_tokens", BOOL, "drop special tokens from the text"),
    ("spaces_between_special_tokens", BOOL, "vLLM detokenization option"),
    ("presence_penalty", {"type": "number", "minimum": -2, "maximum": 2}, "penalty on tokens already output"),
    ("frequency_penalty", {"type": "number", "minimum": -2, "maximum": 2}, "penalty by output token count"),
    ("logit_bias", {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "number"}},
     "token id (as a string, of the vocabulary: x-pdserve-rules) -> bias added to its logit (clamped to +-100, as "
     "vLLM clamps it)"),
    ("allowed_token_ids", {**TOKEN_IDS, "minItems": 1}, "sample only these token ids"),
    ("bad_words", {"type": "array", "items": STR}, "words never generated"),
    ("cache_salt", SALT, "salts the workers' prefix caches: requests with another salt never reuse this one's KV"),
    ("priority", {"type": "integer", "minimum": -INT64, "maximum": INT64 - 1},
     "scheduling priority (the workers must run priority scheduling for a value other than 0)"),
    ("return_tokens_as_token_ids", BOOL, "logprobs' tokens as token_id:N"),
    ("request_id", {"type": "string", "minLength": 1}, "the answer's id is cmpl-/chatcmpl- + this"),
    ("n", {"type": "integer", "minimum": 1, "maximum": max_n()},
     "choices per prompt, up to vLLM's VLLM_MAX_N_SEQUENCES; more than 1 needs temperature > 0, as vLLM"),
    ("best_of", nullable({"type": "integer", "const": 1}), "only 1 (or equal to n)"),
    ("prompt_logprobs", nullable({"type": "integer", "minimum": -1}), "vLLM: logprobs of the prompt's tokens"),
    ("response_format", {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema", "structural_tag"]},
        "json_schema": nullable({"type": "object"})},
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}},
     "structured output (JSON object or JSON schema)"),
    ("structured_outputs", {"type": "object", "oneOf": [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
        for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")]},
     "vLLM structured outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag"),
    ("return_token_ids", BOOL, "add token ids to the response (vLLM extension)"),
    ("truncate_prompt_tokens", nullable(ref("TruncatePromptTokens")),
     "keep this many prompt tokens (-1: the context less one); the router truncates before placement"),
    ("truncation_side", nullable({"enum": ["left", "right"]}),
     "left keeps the last tokens (the default), right the first"),
    ("pdserve_timings", BOOL, "add the router's per-phase timings to the response"),
    # forwarded to the workers after the router checks their JSON type (the workers check the rest, with vLLM's 400)
    ("stream_interval", {"type": "integer", "minimum": 1}, "the streaming worker's chunk interval"),
    ("min_tokens", {"type": "integer", "minimum": 0}, "no stop before this many tokens"),
    ("logprob_token_ids", TOKEN_IDS, "the logprobs of these token ids"),
    ("vllm_xargs", {"type": "object"}, "custom extensions' parameters"),
    ("repetition_detection", {"type": "object"}, "vLLM's repetition detection"),
    ("thinking_token_budget", {"type": "integer"}, "reasoning token budget"),
    ("watermarking", BOOL, "vLLM watermarking"),
    ("mm_payload", {"enum": ["tensors", "none"]}, "ignored (render endpoints), as by vLLM"),
    *((name, {"type": "null"}, f"vLLM's old name: send structured_outputs.{kind}")
      for name, kind in GUIDED.items()),
]

_COMPLETION: Fields = [
    ("prompt", {"anyOf": [{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1},
                          {"type": "array", "minItems": 1,
                           "items": {"anyOf": [{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1}]}}]},
     "one prompt: text or token ids"),
    ("max_tokens", nullable({"type": "integer", "minimum": 1}), "default 16 (null too, as vLLM 0.32)"),
    ("add_special_tokens", BOOL, "add the tokenizer's special tokens (default true)"),
    ("echo", BOOL, "put the prompt (and its logprobs) before the output"),
    ("logprobs", nullable({"type": "integer", "minimum": -1}),
     "logprobs of each output token and N alternatives (-1: the whole vocabulary, past a worker's --max-logprobs "
     "refused by it, as vLLM)"),
]

_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": STR}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": STR, "name": STR, "content": nullable({"anyOf": [STR, {"type": "array", "items": _TEXT_PART}]})}}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": NAME, "description": nullable(STR), "parameters": nullable({"type": "object"})}}}}

_CHAT: Fields = [
    ("messages", {"type": "array", "minItems": 1, "items": MESSAGE}, "the conversation"),
    ("max_tokens", nullable({"type": "integer"}),
     "default: up to the context limit; at least 1 unless max_completion_tokens is set (x-pdserve-rules: context)"),
    ("max_completion_tokens", nullable({"type": "integer", "minimum": 1}), "takes precedence over max_tokens"),
    ("add_generation_prompt", BOOL, "end the rendered prompt with the assistant turn (default true)"),
    ("continue_final_message", BOOL, "continue the last message instead (not with add_generation_prompt)"),
    ("chat_template_kwargs", TEMPLATE_KWARGS, "extra variables for the chat template"),
    ("add_special_tokens", BOOL, "default false (the template has them)"),
    ("logprobs", nullable(BOOL), "logprobs of each output token"),
    ("top_logprobs", nullable({"type": "integer", "minimum": -1}),
     "alternatives per token (with logprobs: true; -1: the whole vocabulary, where the workers' --max-logprobs "
     "allows it)"),
    ("tools", {"type": "array", "minItems": 1, "items": _TOOL},
     "functions the model may call (rendered by the chat template)"),
    ("tool_choice", {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                        "properties": {"name": STR}}}}]},
     "none, auto (parsed by --tool-call-parser), required or a named function (constrained decoding)"),
    ("parallel_tool_calls", BOOL, "allow several tool calls in one answer (default true)"),
    ("documents", {"type": "array", "items": {"type": "object", "additionalProperties": STR}},
     "passed to the chat template"),
    ("reasoning_effort", {"enum": list(REASONING_EFFORTS)}, "passed to the chat template with enable_thinking"),
    ("include_reasoning", BOOL, "false with --tool-call-parser: no token ids or logprobs in the answer (vLLM's)"),
]

# add_generation_prompt and continue_final_message, not both (the second continues the last message instead)
_BOTH_TRUE = {"required": ["add_generation_prompt", "continue_final_message"],
              "properties": {"add_generation_prompt": TRUE, "continue_final_message": TRUE}}


def _tokenize() -> dict[str, Any]:
    """/tokenize: a chat when the body has "messages" (of vLLM's TokenizeChatRequest fields alone; "prompt" is not
    read then), else a prompt."""
    fields = {name: {**schema, "description": desc} for name, schema, desc in COMMON + _CHAT
              if name in TOKENIZE_CHAT_FIELDS}
    for name in set(TOKENIZE_CHAT_FIELDS) & set(UNSUPPORTED_FIELDS["chat"]):
        fields[name] = OFF
    chat = {"required": ["messages"], "properties": with_nulls(fields, NOT_NULL["chat"], ("messages",)),
            "not": _BOTH_TRUE}
    prompt = {"required": ["prompt"], "not": {"required": ["messages"]},
              "properties": {"prompt": STR, "add_special_tokens": BOOL, "model": nullable(STR)}}
    return {"type": "object", "properties": {"return_token_strs": nullable(BOOL)}, "anyOf": [chat, prompt]}


TOKENIZE = _tokenize()


def _request_schema(fields: Fields, kind: str, required: str, *conditions: dict[str, Any]) -> dict[str, Any]:
    props = {name: {**schema, "description": desc} for name, schema, desc in COMMON + fields}
    for name in UNSUPPORTED_FIELDS[kind]:
        props.setdefault(name, OFF)
    # as vLLM 0.32: no prompt logprobs (other than 0) on a stream; stream_options (other than null) only on one
    # (one condition for both: schemathesis' generator gives up on a schema past about four conditions)
    streamed = {"if": {"required": ["stream"], "properties": {"stream": TRUE}},
                "then": {"properties": {"prompt_logprobs": {"enum": [None, 0]}}},
                "else": {"properties": {"stream_options": {"type": "null"}}}}
    schema = {"type": "object", "required": [required], "properties": with_nulls(props, NOT_NULL[kind], (required,)),
              "additionalProperties": True, "allOf": [streamed, *conditions]}
    # response_format (other than text) or structured_outputs, not both (a rule of x-pdserve-rules, not a JSON
    # Schema condition: with structured_outputs' oneOf, its complement is past what schemathesis' generator takes)
    return rules.with_rules(schema, rules.exclusive(("/response_format", "/structured_outputs"),
                                                    {"/response_format/type": "text"}))


def completion_schema(max_model_len: int, vocab_size: int) -> dict[str, Any]:
    return rules.with_rules(_request_schema(_COMPLETION, "completions", "prompt"),
                            rules.context("completion", max_model_len, ("/max_tokens",), 16),
                            rules.bias_keys(vocab_size), rules.greedy_n(GREEDY_EPS))


def chat_schema(max_model_len: int, vocab_size: int, tool_parser: bool) -> dict[str, Any]:
    # top_logprobs (other than 0) only with logprobs: true
    top_logprobs = {"anyOf": [{"required": ["logprobs"], "properties": {"logprobs": TRUE}},
                              {"properties": {"top_logprobs": {"enum": [None, 0]}}}]}
    schema = rules.with_rules(_request_schema(_CHAT, "chat", "messages", top_logprobs, {"not": _BOTH_TRUE}),
                              rules.named_tool("/tool_choice/function/name", "/tools/*/function/name"),
                              rules.bias_keys(vocab_size), rules.greedy_n(GREEDY_EPS),
                              rules.context("chat", max_model_len, ("/max_completion_tokens", "/max_tokens")))
    return tool_rules(schema, tool_parser, {"not": {"enum": ["none", None]}}, {"type": "array"}, {"const": "none"})
