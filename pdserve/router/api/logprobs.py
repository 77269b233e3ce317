"""One choice's logprobs in the shape of its endpoint, from the workers' raw completions logprobs.

Through P and D, the first token's logprobs come from P's answer and the rest from D's stream, each in vLLM's
completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) with offsets counted from
that worker's own output. :class:`LogprobTrack` joins them as one worker would: ``text_offset`` runs over the
whole choice (offset i = sum of the lengths of tokens before i, as vLLM counts it), chat gets the
``{"content": [{token, logprob, bytes, top_logprobs}]}`` list, and ``echo`` puts the prompt's tokens first, built
from the worker's ``prompt_logprobs`` (``[None | {token_id: {logprob, rank, decoded_token}}]``).

Limit: a completions ``top_logprobs`` entry is a ``{text: logprob}`` object, so two alternatives that decode to
the same text arrive as one; the chat list built from it then holds one entry fewer than one worker's would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FLOOR = -9999.0  # vLLM's JSON stand-in for -inf


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class LogprobTrack:
    """Logprobs of one choice; feed each delta's raw logprobs in order."""

    def __init__(self, chat: bool, top: int, decode: Callable[[int], str] | None = None) -> None:
        self.chat = chat
        self.decode = decode  # chat: a sampled token's bytes under return_tokens_as_token_ids (its text's, as vLLM)
        self.top = top  # alternatives asked for (completions: N -> N+1 entries kept, as vLLM; chat: N)
        self.offset = 0  # next token's text_offset
        self.content: list[dict[str, Any]] = []  # chat, whole choice
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    # ---- completions ----
    def _add(self, tokens: list[str], lps: list[float | None], tops: list[dict[str, float] | None]
             ) -> dict[str, Any]:
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        self.tokens += tokens
        self.token_logprobs += lps
        self.top_logprobs += tops
        self.text_offset += offsets
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}

    def prompt(self, prompt_ids: list[int], prompt_logprobs: Any, decode: Callable[[int], str]) -> dict[str, Any]:
        """The echoed prompt's part (completions), from the worker's ``prompt_logprobs``."""
        rows = prompt_logprobs if isinstance(prompt_logprobs, list) else []
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for i, tid in enumerate(prompt_ids):
            row = rows[i] if i < len(rows) else None
            mine = row.get(str(tid)) if isinstance(row, dict) else None
            if not isinstance(mine, dict):
                tokens.append(decode(tid))
                lps.append(None)
                tops.append(None)
                continue
            tokens.append(_token_text(mine, tid, decode))
            lps.append(max(float(mine.get("logprob", _FLOOR)), _FLOOR))
            assert isinstance(row, dict)
            tops.append({_token_text(v, int(k), decode): max(float(v.get("logprob", _FLOOR)), _FLOOR)
                         for j, (k, v) in enumerate(row.items()) if j <= self.top and isinstance(v, dict)})
        return self._add(tokens, lps, tops)

    def completion(self, raw: Any) -> dict[str, Any] | None:
        """A delta's part, offsets rebased onto the whole choice."""
        if not isinstance(raw, dict):
            return None
        return self._add(list(raw.get("tokens") or []), list(raw.get("token_logprobs") or []),
                         list(raw.get("top_logprobs") or []))

    def completion_total(self) -> dict[str, Any]:
        return {"text_offset": self.text_offset, "token_logprobs": self.token_logprobs, "tokens": self.tokens,
                "top_logprobs": self.top_logprobs}

    # ---- chat ----
    def chat_part(self, raw: Any) -> dict[str, Any] | None:
        """A delta's ``{"content": [...]}`` (chat)."""
        if not isinstance(raw, dict):
            return None
        out = []
        for tok, lp, top in zip(raw.get("tokens") or [], raw.get("token_logprobs") or [],
                                raw.get("top_logprobs") or []):
            entry: dict[str, Any] = {"token": tok, "logprob": lp, "bytes": self._sampled_bytes(tok)}
            alts = list(top.items())[:self.top] if isinstance(top, dict) else []
            entry["top_logprobs"] = [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in alts]
            out.append(entry)
        self.content += out
        return {"content": out}

    def _sampled_bytes(self, tok: str) -> list[int]:
        """A sampled token's ``bytes``: of its text, also when ``return_tokens_as_token_ids`` writes the token as
        ``token_id:N`` (vLLM 0.32 does the same; an alternative's bytes are its ``token_id:N`` string's)."""
        if self.decode is not None and tok.startswith("token_id:") and tok[9:].isdigit():
            return _bytes(self.decode(int(tok[9:])))
        return _bytes(tok)

    def chat_total(self) -> dict[str, Any]:
        return {"content": self.content}


def _token_text(entry: dict[str, Any], tid: int, decode: Callable[[int], str]) -> str:
    tok = entry.get("decoded_token")
    return tok if isinstance(tok, str) else decode(tid)
