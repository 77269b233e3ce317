"""Early dispatch to D (pdserve's connector): D gets its request while P prefills, not after P's answer.

The router mints a hand-off id per P -> D attempt and sends it to P (``pdserve_handoff`` in P's
``kv_transfer_params``) and, at the same time, to D with P's transfer-engine address. D admits the request, allocates
its blocks and waits for the KV as an async load; its connector asks P's engine for the id and P answers once the
forward that completes the prompt has written (and sealed) it (pdserve/vllm/handoff_board.py). Where P's first token
streams to the client (greedy, no output-counting sampling options: ``first_from_prefill``) and ``continues`` (on
unless the router's ``--no-early-continue``), P and D get :data:`CONTINUE`: P answers D with its first token t1 once
sampled, and D continues from prompt + [t1] with one token less (pdserve/vllm/continuation.py), so D's stream starts
at the second token; a D that could not continue gives one token marked :data:`NO_CONTINUE` instead
(:class:`~.attempt.Diverged`: the serial hand-off takes over). Without ``continues`` D regenerates the first token from
P's KV and the router checks it equals P's, which the client already has (:class:`~.attempt.Diverged` otherwise).

Which of the two, per hand-off (the router's ``--early-continue``): ``always``, ``never`` (greedy or D-sampled
requests only; other sampling goes serial) or ``auto``. A P that announces layers as its forward writes them says so
in its answers (:data:`LAYERWISE`: host memory, layerwise_kv): a D of its TP and layout then has P's whole KV when P's
forward ends and computes t1 and t2 while P samples and its answer travels, where continuing would wait for P's t1
first (docs/bench.md, "Everything together"). ``auto`` regenerates there when that is exact (greedy sampling) and
continues otherwise (a P that reads whole: a GPU's device memory, or one the book has not heard from).

Where P's engine is, before P answers: :class:`EngineBook` keeps, per prefill worker, the address part of that
worker's last answer (its ``kv_transfer_params``). A P the book does not know yet (its first request, or after it
failed) goes the serial way and teaches it. A P that restarted since has another engine id: D's connector refuses
the old address at once (the engine at that port names itself) and computes the prompt; P's next answer corrects
the book.

Each data plane that allows it has an :class:`EarlyDispatch` (``params``: what P's and D's ``kv_transfer_params``
get for one early hand-off, or None: serial; ``learn`` / ``forget``: P's answers and failures). pdserve's is
:class:`EngineBook`; vLLM's MooncakeConnector's is :class:`~.kv_protocol.MooncakeEarly` (D's pull waits for P's
transfer id: vLLM's ``send_kv_to_decode``); vLLM's NixlConnector allows none (D needs P's block ids).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from ...settings.table import EARLY_CONTINUE
from ..api.sampling_refusals import GREEDY_EPS

__all__ = ["CONTINUE", "EARLY_CONTINUE", "HANDOFF_PREFIX", "LAYERWISE", "NO_CONTINUE", "EarlyDispatch", "EngineBook",
           "early_allowed", "greedy", "new_handoff_id"]

HANDOFF_PREFIX = "hoff-"  # pdserve.vllm.params.HANDOFF_PREFIX: the connector tells hand-off ids by it
# pdserve.vllm.continuation: in P's and D's kv_transfer_params, D continues after P's first token; the stop_reason of
# the one token a D that could not continue gives instead (the serial hand-off takes over)
CONTINUE = "pdserve_continue"
NO_CONTINUE = "pdserve_no_continue"
NO_EARLY = "pdserve_no_early"  # pdserve.vllm.params.NO_EARLY: P's engine (prefix caching off) takes no early hand-off
LAYERWISE = "pdserve_layerwise"  # pdserve.vllm.params.LAYERWISE: P announces layers as its forward writes them
# the address part of P's answer: where its engine (and each tensor-parallel rank's) listens, and its KV layout
_ADDRESS = ("remote_engine_id", "remote_host", "remote_port", "remote_ranks", "remote_kv_layout", "remote_kv_heads",
            "remote_kv_unit")


def new_handoff_id() -> str:
    return f"{HANDOFF_PREFIX}{uuid.uuid4().hex}"


def greedy(sampling: Mapping[str, Any]) -> bool:
    """Whether ``sampling`` is greedy (``temperature`` below vLLM's greedy bound)."""
    temperature = sampling.get("temperature")
    return isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature < GREEDY_EPS


def early_allowed(sampling: Mapping[str, Any], first_from_prefill: bool, continues: bool = False) -> bool:
    """Whether an early D's output is exact: D continues after P's first token (``continues``: any sampling, as the
    serial hand-off), D produces every token itself (``first_from_prefill`` False: structured outputs, seeded
    sampling), or D's regenerated first token can be P's: greedy sampling. Unseeded random sampling would differ
    there: it takes the serial hand-off."""
    return not first_from_prefill or continues or greedy(sampling)


class EarlyDispatch(Protocol):
    """One data plane's early hand-off (see the module docstring)."""

    def continues(self, prefill_url: str, sampling: Mapping[str, Any]) -> bool:
        """Where P's first token streams: whether D is given it by P and continues after it (:data:`CONTINUE`), or
        regenerates it and the router compares, for a request of ``sampling`` from P ``prefill_url``."""
        ...

    async def params(self, prefill_url: str, num_tokens: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(what P's ``kv_transfer_params`` get besides the usual, D's ``kv_transfer_params``) for one early hand-off
        of a prompt of ``num_tokens`` from P ``prefill_url``; None: the serial hand-off."""
        ...

    def learn(self, url: str, kvp: Any) -> None: ...

    def forget(self, url: str) -> None: ...


class EngineBook:
    """Prefill worker URL -> the address part of its last ``kv_transfer_params`` (see the module docstring)."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in EARLY_CONTINUE:
            raise ValueError(f"early continue {mode!r}: use one of {', '.join(EARLY_CONTINUE)}")
        self._book: dict[str, dict[str, Any]] = {}
        self._layerwise: set[str] = set()  # the P URLs whose last answer said LAYERWISE
        self.mode = mode

    def continues(self, prefill_url: str, sampling: Mapping[str, Any]) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        return not (prefill_url in self._layerwise and greedy(sampling))

    def learn(self, url: str, kvp: Any) -> None:
        """P answered ``kvp``: keep where its engine is (a hybrid KV cache's hand-off is not early, nor one from an
        engine without prefix caching, which says so: forgotten)."""
        if not isinstance(kvp, Mapping) or not kvp.get("do_remote_prefill") or kvp.get("remote_group_blocks"):
            return
        if kvp.get(NO_EARLY):
            self.forget(url)
            return
        if not all(kvp.get(k) is not None for k in ("remote_engine_id", "remote_host", "remote_port")):
            return
        self._book[url] = {k: kvp[k] for k in _ADDRESS if kvp.get(k) is not None}
        if kvp.get(LAYERWISE) is True:
            self._layerwise.add(url)
        else:
            self._layerwise.discard(url)

    def forget(self, url: str) -> None:
        self._book.pop(url, None)
        self._layerwise.discard(url)

    def decode_params(self, url: str, handoff: str, num_tokens: int) -> dict[str, Any] | None:
        """D's ``kv_transfer_params`` for an early hand-off from P ``url`` of a prompt of ``num_tokens``; None while
        the book does not know ``url``."""
        address = self._book.get(url)
        if address is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, **address, "remote_block_ids": [],
                "remote_num_tokens": num_tokens, "remote_request_id": handoff, "pdserve_handoff": handoff}

    async def params(self, prefill_url: str, num_tokens: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        handoff = new_handoff_id()
        d = self.decode_params(prefill_url, handoff, num_tokens)
        return None if d is None else ({"pdserve_handoff": handoff}, d)

    def __contains__(self, url: object) -> bool:
        return url in self._book
