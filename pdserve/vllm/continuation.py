"""D, an early hand-off that continues after P's first token (docs/architecture.md, section 3, "Early dispatch").

The router sends D the prompt alone while P prefills, with ``pdserve_continue`` in its ``kv_transfer_params``. P
announces its blocks at the forward that completed the prompt, and its first token t1 once it sampled it; D's worker
asks for t1 after its READ (pdserve.vllm.handoff_board: the second question). When D's read of P's KV has ended, D's
request becomes what a serial D gets, prompt + [t1] with one token less to generate, before vLLM schedules it: t1 is
appended to the prompt as vLLM's own streaming-input sessions extend one (``Scheduler._update_request_as_session``:
the token lists, the block hashes, ``num_prompt_tokens``), ``max_tokens`` and ``min_tokens`` count it. D's first
step then computes t1's position on P's KV and samples t2; D's stream starts at t2. Exact as the serial hand-off is
(repetition_penalty counts prompt and output alike; what counts output tokens only, presence/frequency penalties,
bad words, grammars, never comes this way: the router sends such requests with ``first_from_prefill`` off, D
regenerating every token).

A D that cannot continue (its read ended without t1: P's request ended first, P restarted, P's answer did not come
in time, a fingerprint or prompt mismatch; or it reads nothing at all) must not stream a first token of its own as
if it were t2. Such a request is cut to one token whose ``stop_reason`` is :data:`NO_CONTINUE` (stop token ids off,
so that no stop token replaces it): the router sees it in D's first event and runs the serial hand-off instead.

No vLLM import: ``request`` is vLLM's Request, duck-typed (the attributes named here), so unit tests use fakes.
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.vllm.logs import connector_log

__all__ = ["CONTINUE", "NO_CONTINUE", "asks_to_continue", "cannot_continue", "continue_after"]

CONTINUE = "pdserve_continue"  # D's kv_transfer_params: continue after P's first token (router: run/early_dispatch)
NO_CONTINUE = "pdserve_no_continue"  # stop_reason of a D that could not: the router falls back to the serial hand-off

log = connector_log()


def asks_to_continue(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get(CONTINUE) is True  # type: ignore[union-attr]


def continue_after(request: Any, t1: int) -> bool:
    """Make ``request`` (D's, waiting for its KV, nothing generated yet) continue from prompt + [t1]; False (and
    nothing changed) when it cannot: it generated already, its prompt is not token ids, or t1 is its last token."""
    prompt = request.prompt_token_ids
    if (request.num_output_tokens or prompt is None or getattr(request, "prompt_is_token_ids", None) is not None
            or getattr(request, "prompt_embeds", None) is not None or request.max_tokens < 2
            or len(request._all_token_ids) != len(prompt)):
        return False
    request.prompt_token_ids = [*prompt, int(t1)]
    request._all_token_ids.append(int(t1))  # (as vLLM's session update: all_token_ids is a read-only view of it)
    request.num_prompt_tokens = len(request.prompt_token_ids)
    request.update_block_hashes()
    request.max_tokens -= 1
    params = request.sampling_params
    if params is not None and params.min_tokens:
        params = copy.copy(params)  # (the engine's own copy of the client's; copied all the same)
        params.min_tokens -= 1
        request.sampling_params = params
    return True


def cannot_continue(request: Any, why: str) -> None:
    """Cut ``request`` to one token marked :data:`NO_CONTINUE` (see the module docstring)."""
    log.info("request %s: cannot continue after P's first token (%s); its one token tells the router to hand off "
             "serially", request.request_id, why)
    request.max_tokens = 1
    request.stop_reason = NO_CONTINUE
    params = request.sampling_params
    if params is not None and params.stop_token_ids:
        params = copy.copy(params)
        params.stop_token_ids = []
        request.sampling_params = params
