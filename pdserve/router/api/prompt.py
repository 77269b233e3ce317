"""A generation request's prompt as the token ids the router sends to P and D: the chat template rendered (with
the request's tools and template variables), or the text tokenized, or the ids as given; vLLM's truncation
(:mod:`.truncation`) and its bound on prompt characters applied. The one place this happens: generation,
``/tokenize`` and the OpenAPI document's context rule all count a prompt this way."""

from __future__ import annotations

from .limits import check_prompt_chars
from .protocol import GenerationRequest
from .tokenizer import PromptTokenizer
from .truncation import check_truncation, truncated_ids, truncated_text_ids


def prompt_chars(req: GenerationRequest) -> int:
    """The characters of the request's prompt text (0 for token ids)."""
    if req.kind == "chat":
        return sum(len(m["content"]) for m in req.messages or [])
    return 0 if req.prompt_ids is not None else len(req.prompt_text or "")


def _encode(tok: PromptTokenizer, req: GenerationRequest, text: str, max_model_len: int) -> list[int]:
    trunc = req.truncation
    if trunc is None:
        return tok.encode(text, req.add_special_tokens)
    return truncated_text_ids(tok, text, trunc, max_model_len, req.max_tokens or 0, req.add_special_tokens)


def rendered_chat(tok: PromptTokenizer, req: GenerationRequest) -> str:
    """A chat request's prompt text: its messages through the model's chat template, with its tools and template
    variables (what vLLM tokenizes, and answers as ``prompt_text`` with ``return_prompt_text``)."""
    assert req.messages is not None
    kwargs = dict(req.chat_template_kwargs)
    if req.tools:
        kwargs["tools"] = req.tools
    return tok.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message, **kwargs)


def prompt_ids(tok: PromptTokenizer, req: GenerationRequest, max_model_len: int) -> list[int]:
    """The request's prompt ids (400 for a truncation over the context, prompt text no context could hold, ids out
    of the vocabulary, or a chat template that fails)."""
    trunc = req.truncation
    check_truncation(trunc, max_model_len)
    if req.kind == "chat":
        assert req.messages is not None
        if trunc is None:  # vLLM bounds the characters only when it does not truncate
            check_prompt_chars(prompt_chars(req), max_model_len, tok.chars_per_token, "messages")
        return _encode(tok, req, rendered_chat(tok, req), max_model_len)
    if req.prompt_ids is not None:
        ids = req.prompt_ids if trunc is None else truncated_ids(req.prompt_ids, trunc, max_model_len,
                                                                req.max_tokens or 0)
        tok.check_ids(ids)
        return ids
    text = req.prompt_text or ""
    if trunc is None:
        check_prompt_chars(len(text), max_model_len, tok.chars_per_token, "prompt")
    return _encode(tok, req, text, max_model_len)
