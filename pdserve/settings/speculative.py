"""``--speculative-config``: vLLM's speculative decoding for the workers that decode, and which roles get it.

The value is vLLM's own JSON (``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}``),
passed as is. Decode, colocated and elastic workers get it: they decode. A prefill worker computes the prompt and
one token, so a drafter that only reads token ids (``ngram``, ``suffix``) has nothing to do there; a drafter with
its own layers (EAGLE, MTP, a draft model) keeps KV of its own for the prompt, which vLLM allocates in the same
KV cache as the target's, so prefill workers get the config too: P computes the drafter's KV in its prefill and
pdserve's connector moves it with the target's (docs/architecture.md, "Speculative decoding on D").
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ConfigError

TOKEN_DRAFTERS = ("ngram", "suffix")  # drafters that read token ids only: nothing to compute on P
DECODING_ROLES = frozenset({"decode", "colocated", "elastic"})
ALL_ROLES = DECODING_ROLES | {"prefill"}
ADVICE = ('give vLLM\'s --speculative-config JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
          '"prompt_lookup_max": 4}\', or leave it empty for none')


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The JSON object of ``text`` ({} when empty); :class:`ConfigError` with an example when it is not one with
    a ``method``."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"speculative_config={text!r}: not JSON ({exc}); {ADVICE}") from None
    if not isinstance(value, dict) or not isinstance(value.get("method"), str) or not value["method"]:
        raise ConfigError(f"speculative_config={text!r}: needs a JSON object with a \"method\"; {ADVICE}")
    return value


def drafts_with_layers(method: str | None) -> bool:
    """Whether vLLM's speculative ``method`` drafts with layers of its own (EAGLE, MTP, a draft model), which keep
    KV of their own for the prompt; False for none and for a drafter that reads token ids only."""
    return bool(method) and method not in TOKEN_DRAFTERS


def speculative_roles(text: str) -> frozenset[str]:
    """The worker roles that get ``--speculative-config text``: none when empty; the decoding roles for a
    token-only drafter; every role for a drafter with layers (P computes its KV for the hand-off)."""
    config = parse_speculative_config(text)
    if not config:
        return frozenset()
    return ALL_ROLES if drafts_with_layers(config["method"]) else DECODING_ROLES
