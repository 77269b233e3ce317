"""The served model and its LoRA adapters: which names ``model`` may take and what GET /v1/models lists
(:mod:`..endpoints.models`); POST /v1/load_lora_adapter / /v1/unload_lora_adapter change the list
(:mod:`..endpoints.lora_admin`).

:class:`ModelCatalog` is the one owner of the adapter list. It starts from the configured ``--lora-modules`` (what
every worker loads at start, and again after a restart) and follows the load and unload calls made through this
router and, with ``--routers N``, through the other replicas of the host (the ``lora_adapters`` section of their
shared file: :mod:`..fleet.shared_adapters`). It is kept here rather than asked of a worker per request: the
model check runs on every request with no worker round trip, and it cannot disagree between P and D. A worker
that comes back (restarted, with only the configured adapters) gets the others loaded again before it takes
requests (:mod:`..fleet.adapter_sync`). A request with ``model=<adapter>`` is sent to P and D
with that model (both run the adapter), its block keys take the adapter into their domain
(:func:`pdserve.hashing.domain_root`), and the answer's ``model`` is the adapter's name, as vLLM's is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import bad_request, not_found


class ModelCatalog:
    """The base model's name and the adapters (name -> path) that ``model`` may name."""

    def __init__(self, base: str, root: str, max_model_len: int, created: int,
                 adapters: Mapping[str, str] | None = None, lora: bool = False) -> None:
        self.base = base
        self.root = root
        self.max_model_len = max_model_len
        self.created = created
        self.adapters: dict[str, str] = dict(adapters or {})
        self.lora = lora or bool(self.adapters)
        self.lock = asyncio.Lock()  # one load or unload (or a worker's re-load) at a time
        self.changed: Callable[[str, str | None], None] | None = None  # told each add / remove (the shared file)

    def add(self, name: str, path: str) -> None:
        """List an adapter every worker has loaded."""
        self.adapters[name] = path
        if self.changed is not None:
            self.changed(name, path)

    def remove(self, name: str) -> bool:
        """Stop listing an adapter; False when it was not listed."""
        known = self.adapters.pop(name, None) is not None
        if known and self.changed is not None:
            self.changed(name, None)
        return known

    def replace(self, adapters: Mapping[str, str]) -> None:
        """Take another replica's list (the shared file), without telling it back."""
        self.adapters = dict(adapters)

    def adapter(self, model: Any) -> str | None:
        """The adapter ``model`` names (None: the base model, or no model given); 404 ``model_not_found`` for any
        other name, as the router answered before adapters."""
        if model is None or model == self.base:
            return None
        if isinstance(model, str) and model in self.adapters:
            return model
        raise not_found(f"The model `{model}` does not exist. This router serves `{self.base}`"
                        + (f" and the adapters {', '.join(sorted(self.adapters))}" if self.adapters else "")
                        + " (see /v1/models).", "model", "model_not_found")

    def refuse_prompt_scoring(self, prompt_logprobs: int | None, echo: bool, logprobs: int | None) -> None:
        """With LoRA on, a request that scores its prompt (``prompt_logprobs``, or ``echo`` with ``logprobs``) is a
        400: vLLM 0.32's engine core dies computing prompt logprobs through LoRA's logits processor when the request
        shares a step with another (``einsum(): subscript b has size 2 ... does not broadcast``), taking every
        request on that worker with it. A refusal costs the client a feature; the crash costs everyone a worker."""
        if self.lora and (prompt_logprobs is not None or (echo and logprobs is not None)):
            raise bad_request("prompt_logprobs (and echo with logprobs) are not served while the workers run LoRA "
                              "adapters: vLLM 0.32 crashes the worker computing prompt logprobs with LoRA on",
                              "prompt_logprobs")

    def answer_name(self, lora: str | None) -> str:
        """The ``model`` of the answer to a request that ran adapter ``lora`` (None: the base model): the adapter's
        name, else the served model's, as vLLM names its answers."""
        return lora or self.base

    def listing(self) -> dict[str, Any]:
        """GET /v1/models as vLLM answers it: the base model, then each adapter (root = its path, parent = the
        base model)."""
        data = [{"id": self.base, "object": "model", "created": self.created, "owned_by": "pdserve",
                 "root": self.root, "parent": None, "max_model_len": self.max_model_len}]
        data += [{"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": path,
                  "parent": self.base, "max_model_len": None} for name, path in self.adapters.items()]
        return {"object": "list", "data": data}
