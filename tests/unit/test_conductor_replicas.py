"""The load view with router replicas (:class:`pdserve.conductor.load.Others`): what a worker reports beyond this
replica's own requests counts as the other replicas' load, bounded in lag (a stale report is dropped: a worker
that stopped answering, a replica that left), never double-counting this replica's own, and a repeated report
changes nothing."""

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.load import DecodeJob, PrefillJob, WorkerLoad
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16


def make(replicas: int, clock: Clock) -> Conductor:
    cost = OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))
    c = Conductor(ConductorConfig(block_size=BS, local_prefill_tokens=0, replicas=replicas,
                                  load_staleness_s=3.0), cost, clock)
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        c.add_worker(wid, role, 100_000)
    return c


def req(rid: str, n: int = 160) -> PlacementRequest:
    tokens = [hash((rid, i)) % 30000 for i in range(n)]
    return PlacementRequest(rid, n, block_hashes(tokens, BS), 8)


def test_merge_counts_only_what_exceeds_this_replicas_own():
    w = WorkerLoad("d0", "decode", 100_000)
    w.decodes["mine"] = DecodeJob("mine", 100, 10, 200, started_at=1.0)
    w.decodes["on-the-way"] = DecodeJob("on-the-way", 100, 10, 200)  # its prefill runs: not on D yet
    w.merge_report(5.0, waiting=0, running=4)
    assert w.others_decodes == 3 and w.running_decodes() == 5 and w.in_flight() == 5
    w.merge_report(5.5, waiting=0, running=4)  # the same report twice: the same view, not twice the load
    assert w.others_decodes == 3
    w.merge_report(6.0, waiting=0, running=1)  # fewer than this replica's own: never negative
    assert w.others_decodes == 0
    p = WorkerLoad("p0", "prefill", 0)
    p.prefills["a"] = PrefillJob("a", 400, 0, 0.4, 0.0)
    p.merge_report(5.0, waiting=2, running=1)
    assert p.others_prefills == 2 and p.mean_prefill_s == 0.4 and p.queued_prefill_tokens() == 400 + 800
    assert abs(p.queue_s(0.0) - (0.4 + 2 * 0.4)) < 1e-9


def test_other_replicas_load_steers_placement_until_the_report_goes_stale():
    clock = Clock()
    c = make(2, clock)
    c.finished(c.place(req("r0")).request_id)  # this replica's own history: what a prefill costs
    c.report_load("p0", waiting=6, running=1, kv_usage=0.0)  # another replica filled p0 and d0
    c.report_load("d0", waiting=0, running=12, kv_usage=0.0)
    for wid in ("p1", "d1"):
        c.report_load(wid, waiting=0, running=0, kv_usage=0.0)
    d = c.place(req("r1"))
    assert (d.kind, d.prefill, d.decode) == ("disaggregated", "p1", "d1")
    c.finished("r1")
    clock.t += 3.5  # p0 and d0 stop answering (or the other replica left): their reports go stale
    c.expire_reports()
    assert c.workers["d0"].others is None and c.workers["p0"].others is None
    assert c.workers["d0"].running_decodes() == 0


def test_one_replica_ignores_reported_counts():
    clock = Clock()
    c = make(1, clock)
    c.report_load("d0", waiting=0, running=12, kv_usage=0.0)
    assert c.workers["d0"].others is None and c.workers["d0"].running_decodes() == 0
