"""The refusals vLLM 0.32's ``SamplingParams`` makes without naming a parameter (``param`` null), in its words:
the router checks these values itself, before any worker runs, and answers as one vLLM worker does (the
conformance suite compares the status and the parameter). ``n``'s bound is vLLM's ``VLLM_MAX_N_SEQUENCES`` (16,384
unless the environment sets it, read as vLLM reads it)."""

from __future__ import annotations

import os

from ..errors import RouterError, bad_request, model_param

# field -> vLLM's message for a value out of its range (sampling_params.py, _verify_args / _verify_num_sequences)
UNNAMED = {
    "presence_penalty": "presence_penalty must be in [-2, 2], got {v}.",
    "frequency_penalty": "frequency_penalty must be in [-2, 2], got {v}.",
    "repetition_penalty": "repetition_penalty must be greater than zero, got {v}.",
    "top_k": "top_k must be 0 (disable), or at least 1, got {v}.",
    "min_p": "min_p must be in [0, 1], got {v}.",
    "min_tokens": "min_tokens must be greater than or equal to 0, got {v}.",
    "n": "n must be at least 1, got {v}.",
}
# fields whose range vLLM's request model checks (``Field(ge=...)``): named as pydantic names them
MODEL_CHECKED = frozenset({"stream_interval"})
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy sampling


def max_n() -> int:
    """vLLM's bound on ``n`` (``VLLM_MAX_N_SEQUENCES``, default 16,384)."""
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


def out_of_range(name: str, value: object, message: str) -> RouterError:
    """A value of ``name`` out of its range: vLLM's unnamed refusal where vLLM makes one, else ``message`` naming
    ``name``."""
    if name in UNNAMED:
        return bad_request(UNNAMED[name].format(v=value))
    return bad_request(message, model_param(name) if name in MODEL_CHECKED else name)


def check_n(n: int, temperature: float | None) -> None:
    """vLLM's checks of ``n``: at most :func:`max_n`, and 1 with greedy sampling (an explicit temperature under
    :data:`GREEDY_EPS`; the model's default temperature is not known here)."""
    if n > max_n():
        raise bad_request(f"n must be at most {max_n()}, got {n}. To increase this limit, set the "
                          "VLLM_MAX_N_SEQUENCES environment variable.")
    if n > 1 and temperature is not None and temperature < GREEDY_EPS:
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}.")
