"""The request schemas of /v1/messages (Anthropic Messages API) and /v1/responses (OpenAI Responses API) in the
router's OpenAPI document (:mod:`.openapi`). Both run as chat requests (:mod:`.messages_request`,
:mod:`.responses_request`), so a chat field's rules hold here too; the fields those modules refuse take only what
reads as "not sent"."""

from __future__ import annotations

from typing import Any

from . import openapi_rules as rules
from .agent_fields import MESSAGES_NOT_NULL, RESPONSES_NOT_NULL
from .chat_request import REASONING_EFFORTS
from .openapi_parts import BOOL, NAME, SALT, STOP, STR, TEMPLATE_KWARGS, nullable, nulls_in, tool_rules
from .openapi_requests import COMMON
from .responses_request import LOGPROBS_INCLUDE

_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result", "redacted_thinking"]}, "text": STR, "id": STR,
    "name": STR, "input": {"type": "object"}, "tool_use_id": STR,
    "content": {"anyOf": [STR, {"type": "array", "items": {"type": "object"}}]}}}

_MESSAGES: dict[str, Any] = {
    "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "minLength": 1}, "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": ["user", "assistant", "system"]},
                "content": {"anyOf": [STR, {"type": "array", "items": _BLOCK}]}}}},
        "system": {"anyOf": [STR, {"type": "array", "items": _BLOCK}]}, "stream": BOOL,
        "stop_sequences": {"type": "array", "items": STOP}, "metadata": {"type": "object"},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "cache_salt": SALT, "chat_template_kwargs": TEMPLATE_KWARGS,
        "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
            "name": NAME, "description": nullable(STR), "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "disable_parallel_tool_use": BOOL},
            "if": {"properties": {"type": {"const": "tool"}}},
            "then": {"required": ["name"], "properties": {"name": NAME}}},
        "output_config": {"type": "object", "properties": {"format": {"type": "object", "properties": {
            "type": {"const": "json_schema"}, "schema": {"type": "object"}}}}},
        **{name: {"type": "null", "description": "not supported"} for name in
           ("kv_transfer_params", "ec_transfer_params")},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]}},
            # enabled needs a budget of at least 1024 (under max_tokens: the rule below); the others ignore it
            "if": {"properties": {"type": {"const": "enabled"}}},
            "then": {"required": ["budget_tokens"], "properties": {"budget_tokens": {"type": "integer",
                                                                                   "minimum": 1024}}}}},
    rules.RULES_KEY: [
        rules.less("/thinking/budget_tokens", "/max_tokens", {"/thinking/type": "enabled"},
                   "thinking.budget_tokens must be less than max_tokens (400 naming thinking)"),
        {**rules.named_tool("/tool_choice/name", "/tools/*/name"), "when": {"/tool_choice/type": "tool"}}]}


def _item(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """An input item of ``kind`` (an item without a type is a message) needs these fields."""
    return {"if": {"properties": {"type": {"const": kind}}}, "then": {"required": list(fields), "properties": fields}}


_INPUT_ITEM = {"type": "object", "properties": {"type": {"enum": ["message", "function_call", "function_call_output"]}},
               "allOf": [_item("message", {"role": {"enum": ["user", "system", "developer", "assistant"]},
                                           "content": {"anyOf": [STR, {"type": "array", "items": {
                                               "type": "object", "required": ["type", "text"], "properties": {
                                                   "type": {"enum": ["input_text", "output_text", "text"]},
                                                   "text": STR}}}]}}),
                         _item("function_call", {"call_id": STR, "name": STR, "arguments": STR}),
                         _item("function_call_output", {"call_id": STR, "output": STR})]}
_SHARED = ("model", "stream", "stop", "stop_token_ids", "include_stop_str_in_output", "temperature", "top_p", "min_p",
           "repetition_penalty", "top_k", "seed", "ignore_eos", "skip_special_tokens", "presence_penalty",
           "frequency_penalty", "cache_salt", "priority", "structured_outputs")  # as chat's

_RESPONSES: dict[str, Any] = {
    "type": "object", "required": ["input"], "additionalProperties": True,
    "allOf": [
        # an empty input needs instructions (else the chat has no message)
        {"anyOf": [{"properties": {"input": {"anyOf": [{"type": "string"}, {"minItems": 1}]}}},
                   {"required": ["instructions"], "properties": {"instructions": {"type": "string", "minLength": 1}}}]},
        # top_logprobs acts (as chat's, >= -1) only with the output logprobs asked for
        {"if": {"required": ["include"], "properties": {"include": {"contains": {"const": LOGPROBS_INCLUDE}}}},
         "then": {"properties": {"top_logprobs": {"minimum": -1}}}},
        # as vLLM: text.format or structured_outputs, not both
        {"not": {"required": ["structured_outputs", "text"], "properties": {
            "structured_outputs": {"type": "object"},
            "text": {"required": ["format"], "properties": {"format": {"type": "object"}}}}}}],
    rules.RULES_KEY: [
        rules.named_tool("/tool_choice/name", "/tools/*/name"),
        rules.json_text("/input", {"type": "function_call"}, "arguments",
                        "a function_call's arguments are JSON (the chat template gets them parsed)")],
    "properties": {
        **{name: {**schema, "description": desc} for name, schema, desc in COMMON if name in _SHARED},
        "input": {"anyOf": [STR, {"type": "array", "items": _INPUT_ITEM}]}, "instructions": STR,
        "max_output_tokens": nullable({"type": "integer", "minimum": 1}),
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": NAME, "description": nullable(STR),
            "parameters": nullable({"type": "object"})}}},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                        "name": STR}}]},
        "parallel_tool_calls": BOOL, "store": BOOL, "metadata": {"type": "object"}, "user": STR,
        "text": {"type": "object", "properties": {"format": nullable({
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {"properties": {"schema": nullable({"type": "object"})}}})}},
        "reasoning": {"type": "object", "properties": {"effort": nullable({"enum": list(REASONING_EFFORTS)})}},
        "truncation": {"const": "disabled"},
        **{name: {"enum": [False, 0, []], "description": "stateful: not supported"} for name in
           ("previous_response_id", "background", "previous_input_messages", "enable_response_messages")},
        **{name: {"type": "null", "description": "not supported"} for name in
           ("prompt", "kv_transfer_params", "ec_transfer_params")},
        "include": {"type": "array", "items": STR},
        "top_logprobs": {"type": "integer", "description": "used only with include's output logprobs"}}}


def messages_schema(max_model_len: int, tool_parser: bool) -> dict[str, Any]:
    schema = rules.with_rules(nulls_in(_MESSAGES, MESSAGES_NOT_NULL),
                              rules.context("messages", max_model_len, ("/max_tokens",)))
    none = {"type": "object", "required": ["type"], "properties": {"type": {"const": "none"},
                                                                   "disable_parallel_tool_use": BOOL}}
    return tool_rules(schema, tool_parser, {"type": "object", "properties": {"type": {"not": {"const": "none"}}}},
                      {"type": "array", "minItems": 1}, none)


def responses_schema(max_model_len: int, tool_parser: bool) -> dict[str, Any]:
    schema = rules.with_rules(nulls_in(_RESPONSES, RESPONSES_NOT_NULL),
                              rules.context("responses", max_model_len, ("/max_output_tokens",)))
    return tool_rules(schema, tool_parser, {"not": {"enum": ["none", "auto"]}}, {"type": "array", "minItems": 1},
                      {"const": "none"})
