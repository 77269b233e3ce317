"""The router as a gateway's decode sidecar (--prefiller-header, router/fleet/sidecar.py): the header matched against
the prefill pool only, the pair placed as named, later rounds the router's own placement, the config's rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.fleet.placement import ConductorPlacement
from pdserve.router.fleet.registry import WorkerRegistry
from pdserve.router.fleet.sidecar import PREFILLER_HEADER, Pair, SidecarPlacement, host_port, pair_for

from .fake_clock import Clock

D = "http://127.0.0.1:8000"
MEMBERS = (("prefill", "http://10.0.0.5:8000"), ("prefill", "http://p1.pool.svc:8100"), ("decode", D))
PROMPT = list(range(1, 41))


def placement(policy: str = "conductor", local: int | None = None) -> ConductorPlacement:
    conductor = Conductor(ConductorConfig(policy=policy, block_size=4, local_prefill_tokens=local),
                          OnlineCostModel(1000), Clock())
    return ConductorPlacement(conductor, WorkerRegistry(MEMBERS))


@pytest.mark.parametrize("value,want", [
    ("10.0.0.5:8000", ("10.0.0.5", 8000)), ("P1.Pool.svc:8100", ("p1.pool.svc", 8100)),
    ("[fd00::1]:9000", ("fd00::1", 9000)), ("10.0.0.5", None), ("10.0.0.5:0", None), ("10.0.0.5:http", None),
    (":8000", None), ("evil.com/x:80", None), ("a@b:80", None), ("10.0.0.5:70000", None)])
def test_host_port(value: str, want: tuple[str, int] | None) -> None:
    assert host_port(value) == want


def test_pair_only_for_a_registered_healthy_prefill_worker() -> None:
    reg = placement().registry
    assert pair_for({PREFILLER_HEADER: "10.0.0.5:8000"}, reg, D) == Pair("http://10.0.0.5:8000", D, "pair")
    assert pair_for({PREFILLER_HEADER: "p1.pool.svc:8100"}, reg, D).prefill == "http://p1.pool.svc:8100"
    assert pair_for({}, reg, D) == Pair(None, D, "no_header")
    assert pair_for({PREFILLER_HEADER: " "}, reg, D).outcome == "no_header"
    # never dialled: a host outside the pool, another port of a pool host, the local D itself, garbage
    for value, outcome in (("169.254.169.254:80", "unknown_host"), ("10.0.0.5:8001", "unknown_host"),
                           ("127.0.0.1:8000", "unknown_host"), ("http://10.0.0.5:8000", "bad_header")):
        assert pair_for({PREFILLER_HEADER: value}, reg, D) == Pair(None, D, outcome)
    reg.mark_dead("http://10.0.0.5:8000", "refused")
    assert pair_for({PREFILLER_HEADER: "10.0.0.5:8000"}, reg, D) == Pair(None, D, "unhealthy")


def test_first_round_on_the_pair_later_rounds_the_routers_own() -> None:
    pl = placement(local=10_000)  # the conductor alone would run every request decode-local
    assert pl.choose(PROMPT).prefill is None
    side = SidecarPlacement(pl, Pair("http://p1.pool.svc:8100", D, "pair"))
    t = side.choose(PROMPT, request_id="r1", max_tokens=8)
    assert (t.prefill and t.prefill.url, t.decode.url, t.decision.kind) == ("http://p1.pool.svc:8100", D,
                                                                            "disaggregated")
    assert "x-prefiller-host-port" in t.decision.reason
    assert pl.conductor.decision_of("r1") is not None  # reserved as any placement: the ticket releases it
    t.close()
    assert pl.conductor.decision_of("r1") is None
    # a later round (P failed): the router's own placement without P
    t2 = side.choose(PROMPT, frozenset({"http://p1.pool.svc:8100"}), "r2")
    assert t2.prefill is None or t2.prefill.url != "http://p1.pool.svc:8100"
    t2.close()
    whole = SidecarPlacement(pl, Pair(None, D, "unknown_host")).choose(PROMPT, request_id="r3")
    assert (whole.prefill, whole.decode.url, whole.decision.kind) == (None, D, "local")
    whole.close()


def test_a_pair_that_left_is_a_503() -> None:
    pl = placement(policy="round_robin")
    side = SidecarPlacement(pl, Pair("http://10.0.0.5:8000", D, "pair"))
    pl.registry.remove("http://10.0.0.5:8000")
    with pytest.raises(Exception) as e:
        side.choose(PROMPT)
    assert getattr(e.value, "status", None) == 503


def test_config_needs_exactly_one_decode(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    (tmp_path / "tokenizer.json").write_text("{}")
    ok = RouterConfig(model_dir=str(tmp_path), decode=(D,), prefiller_header=True)
    assert ok.decode == (D,) and ok.mode == "disaggregated"
    RouterConfig(model_dir=str(tmp_path), prefill=("http://10.0.0.5:8000",), decode=(D,), prefiller_header=True)
    for bad in ({"decode": (D, "http://127.0.0.1:8001")}, {"decode": ()}, {"colocated": (D,)}):
        with pytest.raises(RouterConfigError, match="exactly one --decode"):
            RouterConfig(model_dir=str(tmp_path), prefiller_header=True, **bad)  # type: ignore[arg-type]
