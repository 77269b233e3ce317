"""The P -> D hand-off protocol of each KV data plane the router can drive (``--kv-connector``).

The router never touches KV bytes; what differs between data planes is only what the workers' connectors expect
in ``kv_transfer_params`` and what D is sent. One small class per data plane says:

- what P gets (``prefill_params``: the ``kv_transfer_params`` of P's one-token request),
- whether P's first token goes to the client at once (``first_from_prefill``) and D continues from prompt + [t1],
  or D gets the prompt alone and regenerates the first token itself,
- how P's answer becomes D's ``kv_transfer_params`` (``decode_params``), and how a P answer D cannot use reads
  (a 502 naming the prefill worker and the missing fields, before D is sent anything).

``pdserve``: pdserve's own connector (pdserve/vllm). P keeps the prompt's blocks under a lease; D continues from
prompt + [t1] and reads only the blocks it lacks, so P's first token is exact and streamed at once.

``nixl``: vLLM's own NixlConnector. P answers ``do_remote_prefill`` + its block ids, engine id and NIXL
side-channel host/port; D gets the prompt alone with those params (what vLLM's own proxy does), pulls P's
blocks, recomputes the last prompt token and samples the first token itself. That token is D's, not P's: under
random sampling they are independent draws, and even greedy ties may differ between P's prefill and D's
one-token step, so D's continuation is consistent only with D's own first token. P's token is therefore never
streamed early: the first token reaches the client after the hand-off (TTFT includes it).

``mooncake``: vLLM's own MooncakeConnector (Mooncake Transfer Engine; tcp, rdma or efa). The router names the
transfer: P gets ``do_remote_decode`` + a fresh ``transfer_id`` and answers no ``kv_transfer_params`` at all
(``MooncakeConnectorScheduler.request_finished`` returns None); it keeps the prompt's blocks only when its one
token ended the request by length (``FINISHED_LENGTH_CAPPED``; any other finish frees them at once). D gets the
prompt alone with ``do_remote_prefill``, the same ``transfer_id``, P's bootstrap address and P's engine id (asked
of P's bootstrap server, :mod:`.mooncake`); D's worker asks P's sender for that transfer id, pulls the blocks
and samples the first token itself, as with NIXL, so P's token is never streamed early. P's blocks are freed when
D's pull completes, or after ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (the launcher sets it to ``lease_s``).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar

from ...settings.table import MOONCAKE_BOOTSTRAP_PORT
from ..config import parse_bootstrap_ports
from ..errors import RouterError, upstream_failed
from .early_dispatch import EngineBook
from .mooncake import BootstrapBook

KV_CONNECTORS = ("pdserve", "nixl", "mooncake")
DEFAULT_KV_CONNECTOR = "pdserve"


class KVProtocol:
    """What one data plane's connector expects across the hand-off (see the module docstring)."""

    name: ClassVar[str] = ""
    first_from_prefill: ClassVar[bool] = True

    def prefill_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` for P's one-token request (a fresh dict: vLLM mutates what it is given)."""
        raise NotImplementedError

    def decode_params(self, prefill_url: str, kvp: Any, finish: str | None = None
                      ) -> dict[str, Any] | None | Awaitable[dict[str, Any] | None]:
        """D's ``kv_transfer_params`` from what P answered (its ``kv_transfer_params`` and its one token's
        ``finish_reason``), or an awaitable of them; None: D computes the prompt itself. Raises RouterError (502)
        when P answered something this data plane's D would misread."""
        raise NotImplementedError

    def options(self, constrained: bool = False) -> dict[str, Any]:
        """:class:`~pdserve.router.run.generation.GenerationOptions` fields that speak this protocol. ``constrained``
        (structured outputs, constrained tools): D must generate the first token itself on any data plane."""
        return {"first_from_prefill": self.first_from_prefill and not constrained,
                "prefill_kv_params": self.prefill_params(), "decode_kv_params": self.decode_params}


class PdserveProtocol(KVProtocol):
    """pdserve's own connector: P's first token streams at once, D continues from prompt + [t1]; with early
    dispatch (:mod:`.early_dispatch`, on unless ``early`` is False) D gets its request while P prefills, from the
    second request to each P on (``book``: where each P's engine is)."""

    name = "pdserve"
    first_from_prefill = True

    def __init__(self, early: bool = True, continues: str = "auto") -> None:
        self.book: EngineBook | None = EngineBook(continues) if early else None

    def prefill_params(self) -> dict[str, Any]:
        return {"do_remote_decode": True}

    def options(self, constrained: bool = False) -> dict[str, Any]:
        """As every protocol's; and where P's first token streams, P leases only a prefill that ended by length
        (``lease_on_stop``: the router ends a request whose first token stopped it, so no D reads that lease)."""
        out = super().options(constrained)
        if out["first_from_prefill"]:
            out["prefill_kv_params"] = {**out["prefill_kv_params"], "lease_on_stop": False}
        out["early"] = self.book
        return out

    def decode_params(self, prefill_url: str, kvp: Any, finish: str | None = None) -> dict[str, Any] | None:
        return kvp if isinstance(kvp, dict) else None


# Fields NixlConnector's D needs to pull P's blocks (vllm/.../nixl/metadata.py RemoteMeta and the pull
# scheduler's checks), with the JSON types P sends them as.
_NIXL_REQUIRED: dict[str, tuple[type, ...]] = {
    "remote_engine_id": (str,),
    "remote_request_id": (str,),
    "remote_host": (str,),
    "remote_port": (int,),
    "remote_block_ids": (list,),
}


class NixlProtocol(KVProtocol):
    """vLLM's NixlConnector: D gets the prompt alone plus P's params and regenerates the first token."""

    name = "nixl"
    first_from_prefill = False

    def prefill_params(self) -> dict[str, Any]:
        # what vLLM's own disaggregation proxy sends a NixlConnector producer
        return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}

    def decode_params(self, prefill_url: str, kvp: Any, finish: str | None = None) -> dict[str, Any] | None:
        """P's answer, checked: a D given ``do_remote_prefill`` without block ids stops its engine on an
        assertion, and one without host/port/engine waits for KV that never comes, so neither is passed on."""
        if kvp is None:
            return None  # P kept nothing (e.g. its request was aborted): D computes the prompt itself
        if not isinstance(kvp, Mapping):
            raise _bad_params(prefill_url, f"kv_transfer_params is a {type(kvp).__name__}, not an object")
        if not kvp.get("do_remote_prefill"):
            raise _bad_params(prefill_url, "kv_transfer_params lacks do_remote_prefill=true")
        problems = [f"{k} missing" if k not in kvp else f"{k}={kvp[k]!r}"
                    for k, types in _NIXL_REQUIRED.items()
                    if not isinstance(kvp.get(k), types) or isinstance(kvp.get(k), bool)]
        if "tp_size" in kvp and (not isinstance(kvp["tp_size"], int) or isinstance(kvp["tp_size"], bool)):
            problems.append(f"tp_size={kvp['tp_size']!r}")
        blocks = kvp.get("remote_block_ids")
        if isinstance(blocks, list) and not _block_ids_ok(blocks):
            problems.append("remote_block_ids is not a list of block ids per KV cache group")
        if problems:
            raise _bad_params(prefill_url, "; ".join(problems))
        return dict(kvp)


def _block_ids_ok(blocks: list[Any]) -> bool:
    """``[[int, ...], ...]`` (one list per KV cache group) or a flat ``[int, ...]`` (older NixlConnector)."""
    def ints(xs: Any) -> bool:
        return isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)

    return ints(blocks) or all(ints(g) for g in blocks)


def _bad_params(prefill_url: str, what: str, connector: str = "NixlConnector", flag: str = "nixl") -> RouterError:
    return upstream_failed(
        f"prefill worker {prefill_url} answered kv_transfer_params that vLLM's {connector} cannot use ({what}); "
        f"is every worker started with --kv-transfer-config naming {connector} (pdserve serve --kv-connector "
        f"{flag})?", code="kv_transfer_params_invalid")


class MooncakeProtocol(KVProtocol):
    """vLLM's MooncakeConnector: the router names each transfer; D pulls by it and regenerates the first token."""

    name = "mooncake"
    first_from_prefill = False

    def __init__(self, book: BootstrapBook | None = None, early: bool = True) -> None:
        self.book = book or BootstrapBook(MOONCAKE_BOOTSTRAP_PORT)
        self.early = early

    def prefill_params(self, transfer_id: str = "") -> dict[str, Any]:
        return {"do_remote_decode": True, "do_remote_prefill": False,
                "transfer_id": transfer_id or new_transfer_id()}

    def options(self, constrained: bool = False) -> dict[str, Any]:
        """One transfer id per request: P's params and D's reading of P's answer share it (and an early D's)."""
        transfer_id = new_transfer_id()
        return {"first_from_prefill": False, "prefill_kv_params": self.prefill_params(transfer_id),
                "decode_kv_params": functools.partial(self.decode_for, transfer_id),
                "early": MooncakeEarly(self, transfer_id) if self.early else None}

    def decode_params(self, prefill_url: str, kvp: Any, finish: str | None = None
                      ) -> Awaitable[dict[str, Any] | None]:
        """Without the request's transfer id there is nothing D could pull: use :meth:`options`."""
        raise NotImplementedError("MooncakeProtocol.decode_for(transfer_id, ...) through options()")

    async def decode_for(self, transfer_id: str, prefill_url: str, kvp: Any, finish: str | None = None
                         ) -> dict[str, Any] | None:
        """D's params for the transfer P just kept; None (D computes the prompt itself) when P kept nothing (its
        token did not end by length) or P's bootstrap server names no engine (P died after answering). P answering
        params of its own means it runs another connector: a 502 before D is sent anything."""
        if kvp is not None:
            raise _bad_params(prefill_url, f"MooncakeConnector answers none, got {kvp!r}", "MooncakeConnector",
                              "mooncake")
        if finish != "length":
            return None
        engine = await self.book.engine_id(prefill_url)
        if engine is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine,
                "remote_bootstrap_addr": self.book.address(prefill_url), "transfer_id": transfer_id}


class MooncakeEarly:
    """Early dispatch over vLLM's MooncakeConnector (:mod:`.early_dispatch`): D is sent its pull of the request's
    transfer id at once. vLLM allows it: P's sender, asked for a transfer id it has not finished yet, waits for it
    (``send_kv_to_decode``: a placeholder and its ``ready`` event, up to ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``).
    What vLLM does not do, and pdserve cannot from outside: end that wait when P's request ends without keeping its
    blocks (a stop or an abort: ``record_send_reqs`` drops the transfer, nobody tells D) or when P dies (D's ZMQ
    socket waits ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` + 60 s): D's blocks stay allocated that long, then D
    computes the prompt. The router closes such a D and sends the serial request."""

    def continues(self, prefill_url: str, sampling: Mapping[str, Any]) -> bool:
        return False  # D regenerates P's first token (vLLM's connector cannot be given it)

    def __init__(self, protocol: MooncakeProtocol, transfer_id: str) -> None:
        self.protocol, self.transfer_id = protocol, transfer_id

    async def params(self, prefill_url: str, num_tokens: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        d = await self.protocol.decode_for(self.transfer_id, prefill_url, None, "length")
        return None if d is None else ({}, d)

    def learn(self, url: str, kvp: Any) -> None:
        return None

    def forget(self, url: str) -> None:
        return None


def new_transfer_id() -> str:
    """A transfer id no other request shares (P's sender and D's pull meet on it)."""
    return f"xfer-{uuid.uuid4().hex}"


PROTOCOLS: dict[str, KVProtocol] = {"pdserve": PdserveProtocol(early=False), "nixl": NixlProtocol()}


def protocol_for(name: str, mooncake_bootstrap_port: int = MOONCAKE_BOOTSTRAP_PORT, mooncake_bootstrap: str = "",
                 early_dispatch: bool = True, early_continue: str = "auto") -> KVProtocol:
    """The hand-off of data plane ``name``. Mooncake's holds state (P's engine ids), and so does pdserve's with
    ``early_dispatch`` (each P's engine address): build it once per router. Raises ValueError for an unknown name
    or a bad ``mooncake_bootstrap`` (``URL=PORT,...``)."""
    if name == "pdserve":
        return PdserveProtocol(early=early_dispatch, continues=early_continue)
    if name == "mooncake":
        return MooncakeProtocol(BootstrapBook(mooncake_bootstrap_port, parse_bootstrap_ports(mooncake_bootstrap)),
                                early=early_dispatch)
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"kv connector {name!r} unknown; choose one of {', '.join(KV_CONNECTORS)}") from None
