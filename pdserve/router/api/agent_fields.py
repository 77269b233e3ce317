"""What the router does with each field of vLLM 0.32's ``AnthropicMessagesRequest`` (``/v1/messages``) and
``ResponsesRequest`` (``/v1/responses``), one line each; ``tests/unit/test_router_messages.py`` and
``test_router_responses.py`` fail when the installed vLLM has a field this table does not classify.

Kinds: ``same`` (sent as the chat field of the same name and meaning, so it acts on P and D as on one worker),
``mapped`` (translated into the chat request as vLLM translates it: :mod:`.messages_request`,
:mod:`.responses_request`), ``echoed`` (no effect on generation; written back in the answer as vLLM does),
``ignored_as_vllm`` (vLLM ignores it on this endpoint too), ``refused`` (a 400 that names it).
"""

from __future__ import annotations

from collections import Counter

KINDS = ("same", "mapped", "echoed", "ignored_as_vllm", "refused")
_RENDER_ONLY = "multimodal render option; text-only requests render the same without it"

MESSAGES: dict[str, tuple[str, str]] = {
    "model": ("mapped", "checked against the served model (404 in Anthropic's shape)"),
    "messages": ("mapped", "text, tool_use and tool_result blocks -> chat messages"),
    "system": ("mapped", "the first system message"),
    "max_tokens": ("same", "the output budget"),
    "stop_sequences": ("mapped", "-> stop"),
    "stream": ("mapped", "Messages SSE events from the chat deltas"),
    "temperature": ("same", ""),
    "top_p": ("same", ""),
    "top_k": ("same", ""),
    "tools": ("mapped", "input_schema -> parameters"),
    "tool_choice": ("mapped", "auto, any -> required, none, tool -> a named function"),
    "output_config": ("mapped", "format -> response_format json_schema; effort -> reasoning_effort"),
    "cache_salt": ("same", ""),
    "watermarking": ("same", ""),
    "vllm_xargs": ("same", ""),
    "chat_template_kwargs": ("same", ""),
    "metadata": ("ignored_as_vllm", "vLLM does not read it"),
    "mm_payload": ("ignored_as_vllm", "render endpoints only"),
    "return_mm_kwargs": ("ignored_as_vllm", "render endpoints only"),
    "thinking": ("mapped", "enabled -> thinking_token_budget; disabled -> reasoning_effort none (or low)"),
    "kv_transfer_params": ("refused", "the router owns the P -> D hand-off"),
    "ec_transfer_params": ("refused", "the router owns the hand-offs"),
}

# fields these vLLM models refuse null for (as fields.NOT_NULL; the router refuses it by name too)
MESSAGES_NOT_NULL = frozenset({"max_tokens", "messages", "mm_payload", "model"})
RESPONSES_NOT_NULL = frozenset({"enable_response_messages", "ignore_eos", "include_reasoning",
                                "include_stop_str_in_output", "input", "mm_payload", "priority", "request_id",
                                "service_tier", "skip_special_tokens", "tool_choice", "tools"})

RESPONSES: dict[str, tuple[str, str]] = {
    "model": ("mapped", "checked against the served model (404)"),
    "input": ("mapped", "messages, function_call and function_call_output items -> chat messages"),
    "instructions": ("mapped", "the first system message; echoed"),
    "max_output_tokens": ("mapped", "-> max_tokens; the budget used is echoed"),
    "stream": ("mapped", "Responses SSE events from the chat deltas"),
    "text": ("mapped", "format json_object / json_schema -> structured_outputs; echoed"),
    "reasoning": ("mapped", "effort -> reasoning_effort; echoed"),
    "tools": ("mapped", "function tools -> chat tools (others refused); echoed"),
    "tool_choice": ("mapped", "-> the chat tool_choice; echoed"),
    "parallel_tool_calls": ("mapped", "-> parallel_tool_calls; echoed"),
    "request_id": ("mapped", "the response's id"),
    "temperature": ("same", "echoed"),
    "top_p": ("same", "echoed"),
    "top_k": ("same", ""),
    "min_p": ("same", ""),
    "repetition_penalty": ("same", ""),
    "presence_penalty": ("same", "echoed"),
    "frequency_penalty": ("same", "echoed"),
    "seed": ("same", ""),
    "stop": ("same", ""),
    "stop_token_ids": ("same", ""),
    "ignore_eos": ("same", ""),
    "logit_bias": ("same", ""),
    "skip_special_tokens": ("same", ""),
    "include_stop_str_in_output": ("same", ""),
    "cache_salt": ("same", ""),
    "priority": ("same", ""),
    "watermarking": ("same", ""),
    "vllm_xargs": ("same", ""),
    "chat_template_kwargs": ("same", ""),
    "structured_outputs": ("same", ""),
    "metadata": ("echoed", ""),
    "user": ("echoed", ""),
    "service_tier": ("echoed", ""),
    "max_tool_calls": ("echoed", "vLLM uses it for its built-in tools only"),
    "truncation": ("refused", "\"auto\" (the router does not truncate prompts); \"disabled\" echoed"),
    "store": ("ignored_as_vllm", "nothing is stored, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE"),
    "top_logprobs": ("mapped", "-> chat top_logprobs with include's output logprobs (else unused, as vLLM)"),
    "include_reasoning": ("ignored_as_vllm", "acts only with a reasoning parser"),
    "prompt_cache_key": ("ignored_as_vllm", "vLLM documents it as not implemented"),
    "session_id": ("ignored_as_vllm", "vLLM uses it only for tracing"),
    "media_io_kwargs": ("ignored_as_vllm", _RENDER_ONLY),
    "mm_processor_kwargs": ("ignored_as_vllm", _RENDER_ONLY),
    "mm_payload": ("ignored_as_vllm", "render endpoints only"),
    "return_mm_kwargs": ("ignored_as_vllm", "render endpoints only"),
    "include": ("mapped", "message.output_text.logprobs -> chat logprobs (other values ignored as vLLM does)"),
    "previous_response_id": ("refused", "stateful: needs vLLM's response store"),
    "previous_input_messages": ("refused", "stateful (harmony) history"),
    "background": ("refused", "stateful: needs vLLM's response store (vLLM refuses it too without the store)"),
    "enable_response_messages": ("refused", "raw harmony messages"),
    "prompt": ("refused", "vLLM refuses prompt templates too"),
    "kv_transfer_params": ("refused", "the router owns the P -> D hand-off"),
    "ec_transfer_params": ("refused", "the router owns the hand-offs"),
}

TABLES = {"messages": MESSAGES, "responses": RESPONSES}


def counts(endpoint: str) -> dict[str, int]:
    """How many fields of the endpoint's vLLM request model each kind has (the README's table)."""
    c = Counter(kind for kind, _ in TABLES[endpoint].values())
    return {k: c.get(k, 0) for k in KINDS}
