"""What the router does with each field of vLLM's request models, one line per field.

No field is dropped: each one is read by the router with vLLM's meaning (``router``), reaches the workers that
sample or compute KV unchanged (``forwarded``), reaches them with D regenerating the first token because its
meaning depends on the output so far (``regenerated``: P's token would otherwise be D's prompt), is ignored
because vLLM ignores it on these endpoints too (``ignored_as_vllm``), or is refused with a 400 that names it
(``refused``). ``tests/unit/test_router_fields.py`` compares these tables with the installed vLLM's own request
models, so a vLLM upgrade that adds a field fails that test until the field is classified here.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import bad_request

Use = Literal["router", "forwarded", "regenerated", "ignored_as_vllm", "refused"]

_COMMON: dict[str, tuple[Use, str]] = {
    "model": ("router", "the served model (404 for another)"),
    "max_tokens": ("router", "split between P (1) and D (the rest)"),
    "n": ("router", "one generation per choice, prefilled once"),
    "stop": ("router", "matched by the router on the whole text (it spans P's and D's output)"),
    "stream": ("router", ""),
    "stream_options": ("router", "include_usage and continuous_usage_stats"),
    "include_stop_str_in_output": ("router", "with the router's stop strings"),
    "stop_token_ids": ("forwarded", "to P and D"),
    "seed": ("forwarded", "choice i gets seed + i, as vLLM seeds its children"),
    "temperature": ("forwarded", ""),
    "top_p": ("forwarded", ""),
    "top_k": ("forwarded", ""),
    "min_p": ("forwarded", ""),
    "repetition_penalty": ("forwarded", "counts prompt and output tokens alike, so P's token as D's prompt is exact"),
    "ignore_eos": ("forwarded", ""),
    "skip_special_tokens": ("forwarded", "and used by the router's detokenizer"),
    "spaces_between_special_tokens": ("forwarded", "and used by the router's detokenizer"),
    "logprobs": ("router", "forwarded, and the router joins P's and D's"),
    "prompt_logprobs": ("router", "P (or the whole-request worker) scores the prompt"),
    "response_format": ("regenerated", "structured outputs: D regenerates the first token under the grammar"),
    "structured_outputs": ("regenerated", "as response_format"),
    "return_token_ids": ("router", ""),
    "add_special_tokens": ("router", "the router tokenizes"),
    "logit_bias": ("forwarded", "the same bias on P and D"),
    "allowed_token_ids": ("forwarded", "the same mask on P and D"),
    "cache_salt": ("forwarded", "P and D salt their prefix caches with it"),
    "priority": ("forwarded", "each worker schedules by it"),
    "return_tokens_as_token_ids": ("forwarded", "the workers write their logprobs' tokens as token_id:N"),
    "logprob_token_ids": ("forwarded", "the workers return these ids' logprobs"),
    "vllm_xargs": ("forwarded", "custom extensions' parameters, to P and D"),
    "presence_penalty": ("regenerated", "counts output tokens only"),
    "frequency_penalty": ("regenerated", "counts output tokens only"),
    "bad_words": ("regenerated", "a multi-token bad word matches against the output so far"),
    "repetition_detection": ("regenerated", "looks at the output's n-grams"),
    "thinking_token_budget": ("regenerated", "counts output tokens"),
    "watermarking": ("regenerated", "the watermark depends on the output so far"),
    "min_tokens": ("forwarded", "less the tokens already output (P's first, a migration's), at most each call's "
                                "max_tokens"),
    "truncate_prompt_tokens": ("router", "the router truncates before placement, as vLLM (api/truncation.py); P and D "
                                         "get the truncated prompt"),
    "truncation_side": ("router", "with truncate_prompt_tokens"),
    "stream_interval": ("forwarded", "batches the streaming worker's chunks; the text is the same"),
    "user": ("ignored_as_vllm", "vLLM does not use it either"),
    "session_id": ("ignored_as_vllm", "vLLM uses it only as a request-id prefix for tracing"),
    "request_id": ("ignored_as_vllm", "the router names the request itself (its id goes to the conductor and both "
                                      "workers)"),
    "return_token_offsets": ("ignored_as_vllm", "render endpoints only"),
    "mm_payload": ("ignored_as_vllm", "render endpoints only"),
    "return_mm_kwargs": ("ignored_as_vllm", "render endpoints only"),
    "routed_experts_prompt_start": ("ignored_as_vllm", "only with routed-expert capture, which pdserve does not "
                                                       "enable"),
    "length_penalty": ("ignored_as_vllm", "beam search only (a beam search request reaches its worker with it)"),
    "use_beam_search": ("router", "the whole request on one worker, its answer relayed (vLLM runs beam search in "
                                  "its serving layer: run/beam_search.py)"),
    "kv_transfer_params": ("refused", "the router owns the hand-off"),
    "ec_transfer_params": ("refused", "encoder-cache disaggregation is not served"),
}

FIELDS: dict[str, dict[str, tuple[Use, str]]] = {
    "completions": {
        **_COMMON,
        "prompt": ("router", "tokenized by the router; a list fans out"),
        "echo": ("router", "the prompt (and its logprobs) before the output"),
        "suffix": ("refused", "not served"),
        "prompt_embeds": ("refused", "not served"),
    },
    "chat": {
        **_COMMON,
        "messages": ("router", "rendered with the model's chat template"),
        "max_completion_tokens": ("router", "as max_tokens"),
        "top_logprobs": ("router", "with logprobs"),
        "tools": ("router", "rendered into the prompt; calls parsed with vLLM's tool parsers"),
        "tool_choice": ("router", "required / named: constrained, D regenerates the first token"),
        "parallel_tool_calls": ("router", ""),
        "add_generation_prompt": ("router", ""),
        "continue_final_message": ("router", ""),
        "chat_template_kwargs": ("router", "passed to the chat template"),
        "echo": ("router", "the last message's content before each choice's when its role is the answer's, as vLLM"),
        "chat_template": ("refused", "a request's own chat template is not served"),
        "documents": ("router", "passed to the chat template, as vLLM"),
        "reasoning_effort": ("router", "passed to the chat template with enable_thinking, as vLLM"),
        "include_reasoning": ("router", "false with --tool-call-parser: the answer's token ids and logprobs are "
                                        "left out (not its text), as vLLM does with a parser; the router runs no "
                                        "reasoning parser, so there is no reasoning field to leave out"),
        "media_io_kwargs": ("refused", "multimodal inputs are not served"),
        "mm_processor_kwargs": ("refused", "multimodal inputs are not served"),
        "return_prompt_text": ("router", "the chat template's rendered prompt (vLLM's prompt_text)"),
    },
}

# fields vLLM's models do not have but the router refuses by name (OpenAI's, or vLLM's older spellings)
EXTRA_REFUSED: dict[str, tuple[str, ...]] = {
    "completions": (),
    "chat": ("functions", "audio", "modalities", "prediction"),
}


# fields whose vLLM model refuses an explicit null (not Optional there, or a validator that refuses it): the router
# refuses it by name too (refuse_nulls); every other field's null means "not sent", on both. tests/unit/
# test_router_fields.py sends null to the installed vLLM's models to check these sets.
_NOT_NULL_COMMON = frozenset({"add_special_tokens", "bad_words", "ignore_eos", "include_stop_str_in_output",
                              "length_penalty", "min_tokens", "mm_payload", "priority", "request_id",
                              "routed_experts_prompt_start", "skip_special_tokens", "spaces_between_special_tokens",
                              "use_beam_search"})
NOT_NULL: dict[str, frozenset[str]] = {
    "completions": _NOT_NULL_COMMON | {"n", "prompt"},
    "chat": _NOT_NULL_COMMON | {"add_generation_prompt", "continue_final_message", "echo", "include_reasoning",
                                "messages"},
}


def refuse_nulls(body: dict[str, Any], not_null: frozenset[str]) -> None:
    """A 400 naming the first field of ``not_null`` that ``body`` sets to null, as vLLM's model refuses it."""
    name = next((n for n in sorted(not_null) if n in body and body[n] is None), None)
    if name is not None:
        raise bad_request(f"'{name}' may not be null", name)


def names(endpoint: str, use: Use) -> tuple[str, ...]:
    """The fields of ``endpoint`` ("completions" or "chat") that the router treats as ``use``."""
    return tuple(n for n, (u, _) in FIELDS[endpoint].items() if u == use)


def counts(endpoint: str) -> dict[str, int]:
    """How many fields of ``endpoint`` fall under each use (the README's table)."""
    out: dict[str, int] = {}
    for use, _ in FIELDS[endpoint].values():
        out[use] = out.get(use, 0) + 1
    return out


# the fields of vLLM's TokenizeChatRequest: a chat body to /tokenize is read as a chat request of these alone (vLLM
# ignores any other field there; tests/unit/test_router_fields.py compares them with the installed vLLM's)
TOKENIZE_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs", "media_io_kwargs",
                        "mm_processor_kwargs", "tools")
