"""Chat template rendering and tokenization with the model folder's tokenizer (local files only)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import bad_request


class PromptTokenizer:
    """Wraps a Hugging Face tokenizer loaded from ``model_dir`` without touching the network."""

    def __init__(self, model_dir: str, tokenizer: Any | None = None) -> None:
        if tokenizer is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            from transformers import AutoTokenizer

            # truncation_side as vLLM loads a generative model's tokenizer (api/truncation.py)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, truncation_side="left")
        self.tok = tokenizer
        self.vocab_size = len(tokenizer)
        self._chars_per_token: int | None = None

    @property
    def chars_per_token(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (byte-level entries are
        at least as long as the text they decode to); 0 when the tokenizer does not list its vocabulary."""
        if self._chars_per_token is None:
            backend = getattr(self.tok, "backend_tokenizer", None)
            try:
                vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else self.tok.get_vocab()
                self._chars_per_token = max((len(t) for t in vocab), default=0)
            except Exception:  # a tokenizer without a listable vocabulary: the caller's floor applies
                self._chars_per_token = 0
        return self._chars_per_token

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """The text's ids; ``max_length``: truncated by the tokenizer itself, as vLLM asks it to (its special
        tokens kept, from its truncation side)."""
        if max_length is None:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))
        return list(self.tok(text, truncation=True, max_length=max_length,
                             add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_one(self, token_id: int) -> str:
        """One token's text as vLLM shows a token it has no logprob entry for (``tokenizer.decode(id)``)."""
        return self.decode([token_id])

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, /, **template_kwargs: Any) -> str:
        """The chat as the template renders it; ``template_kwargs`` (the request's chat_template_kwargs and the
        router's additions) under the request's own add_generation_prompt / continue_final_message, as vLLM merges
        them. Any failure of the template on them is a 400 (vLLM's too)."""
        if not getattr(self.tok, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages", "no_chat_template")
        kwargs = {**template_kwargs, "add_generation_prompt": add_generation_prompt,
                  "continue_final_message": continue_final_message}
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja2 errors raised by the template (e.g. bad role order), a clashing kwarg
            raise bad_request(f"chat template failed on these messages: {e}", "messages") from None

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 continue_final_message: bool = False, add_special_tokens: bool = False, /,
                 **template_kwargs: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, **template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True,
                    spaces_between_special_tokens: bool = True) -> IncrementalDetokenizer | None:
        """An incremental detokenizer primed with the prompt, as the worker's own (None: no fast tokenizer)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:
            return None
        return IncrementalDetokenizer(backend, prompt_ids, skip_special_tokens, spaces_between_special_tokens)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        """400 naming ``param`` for a token id outside the vocabulary. vLLM checks ids in its engine, inside a
        streamed answer: a streamed request gets it as vLLM's error event (``RouterError.event``)."""
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is None:
            return
        if param == "prompt":  # vLLM's own message, naming no parameter
            e = bad_request(f"Token id {bad} is out of vocabulary")
        else:
            e = bad_request(f"token id {bad} in '{param}' is out of vocabulary (size {self.vocab_size})", param)
        e.event = True
        raise e


class IncrementalDetokenizer:
    """Text of output tokens, one token at a time, primed with the prompt ids.

    The disaggregated path needs it: D's own text for t2... is wrong when the prompt it was given (prompt + t1)
    ends inside a multi-byte character (the worker's stream then re-emits prompt text). Detokenizing every
    output token here, primed exactly like a single worker primes its stream (the whole prompt, then t1, t2...),
    gives the text one worker would give. Bytes that do not yet form a character give "" until they do.
    """

    def __init__(self, backend: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._decode_stream = DecodeStream
        self.backend = backend
        self.skip = skip_special_tokens
        self.stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self.added: dict[int, str] | None = None
        self.last_special = False
        # the last step's token completed the text so far (the stream emitted at it; its window starts over there):
        # what run/textsync.py needs to know where a continuing worker's stream is
        self.emitted = False
        if not (skip_special_tokens or spaces_between_special_tokens):
            added = {tid: t.content for tid, t in backend.get_added_tokens_decoder().items()}
            self.added = added or None

    def step(self, token_id: int) -> str:
        try:
            piece = self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):
            piece = None
        except Exception as e:  # the stream's state broke on non-monotonic UTF-8 output: restart it
            if "invalid prefix" not in str(e).lower():
                raise
            self.stream = self._decode_stream(skip_special_tokens=self.skip)
            piece = self.stream.step(self.backend, token_id)
        self.emitted = piece is not None
        if self.added is not None:
            special = self.added.get(token_id)
            if special is not None and self.last_special:
                piece = special  # no space between consecutive special tokens
            self.last_special = special is not None
        return piece or ""
