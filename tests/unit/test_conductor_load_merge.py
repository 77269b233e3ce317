"""Merging the load view with router replicas (issue 24): what one replica knows of the others' requests comes
only from the workers' own /metrics, so it lags by a report; these tests pin what that lag does and does not do.

- lag: a report is trusted for ``load_staleness_s`` and no longer; this replica's own changes between two reports
  are never counted twice; a request of its own that ended after the report was taken shows as another
  replica's for one report only;
- a replica that left: its requests vanish from the next report (vLLM aborts them) and stop counting at once;
  a worker that stops answering stops counting after the staleness;
- duplicate reports: a level, not an increment: the same report any number of times gives the same view."""

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel, PlacementRequest
from pdserve.conductor.cost_model import Priors
from pdserve.conductor.load import DecodeJob, PrefillJob, WorkerLoad
from pdserve.hashing import block_hashes

from .fake_clock import Clock

BS = 16


def make(clock: Clock, staleness_s: float = 3.0) -> Conductor:
    cost = OnlineCostModel(1000, Priors(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.001, 0.0),
                                        bandwidth_bytes_s=1e9, transfer_overhead_s=0.0, handoff_s=0.05))
    c = Conductor(ConductorConfig(block_size=BS, local_prefill_tokens=0, replicas=2,
                                  load_staleness_s=staleness_s), cost, clock)
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        c.add_worker(wid, role, 100_000)
    return c


def req(rid: str, n: int = 160) -> PlacementRequest:
    tokens = [hash((rid, i)) % 30000 for i in range(n)]
    return PlacementRequest(rid, n, block_hashes(tokens, BS), 8)


def idle(c: Conductor, *wids: str) -> None:
    for wid in wids:
        c.report_load(wid, waiting=0, running=0, kv_usage=0.0)


def test_a_report_counts_until_its_staleness_and_not_one_moment_longer():
    clock = Clock()
    c = make(clock, staleness_s=3.0)
    c.report_load("d0", waiting=0, running=5, kv_usage=0.0)
    clock.t += 3.0
    c.expire_reports()  # exactly as old as the staleness: still trusted
    assert c.workers["d0"].others_decodes == 5
    clock.t += 0.01
    c.expire_reports()
    assert c.workers["d0"].others is None and c.workers["d0"].in_flight() == 0


def test_a_fresh_report_restarts_the_staleness_window():
    clock = Clock()
    c = make(clock, staleness_s=3.0)
    c.report_load("d0", waiting=0, running=5, kv_usage=0.0)
    clock.t += 2.0
    c.report_load("d0", waiting=0, running=2, kv_usage=0.0)  # the next round: the level, not the sum
    clock.t += 2.0
    c.expire_reports()
    assert c.workers["d0"].others_decodes == 2


def test_own_placement_after_a_report_is_counted_once_then_matched_by_the_next_report():
    clock = Clock()
    c = make(clock)
    c.finished(c.place(req("warm")).request_id)
    c.report_load("p0", waiting=2, running=0, kv_usage=0.0)  # two of another replica's prefills on p0
    idle(c, "p1", "d0", "d1")
    d = c.place(req("r1"))  # p0 looks busier: this replica places on p1
    assert d.prefill == "p1"
    p1 = c.workers["p1"]
    assert p1.in_flight() == 1 and p1.others_prefills == 0  # before the worker reports it: its own, once
    c.report_load("p1", waiting=1, running=0, kv_usage=0.0)  # the worker now shows it: still this replica's
    assert p1.others_prefills == 0 and p1.in_flight() == 1


def test_own_request_that_ended_after_the_report_shows_as_another_replicas_for_one_report():
    w = WorkerLoad("d0", "decode", 100_000)
    w.decodes["mine"] = DecodeJob("mine", 100, 10, 200, started_at=1.0)
    w.merge_report(5.0, waiting=0, running=1)
    assert w.others_decodes == 0
    del w.decodes["mine"]  # it finished; the worker's next report was taken before the end reached it
    w.merge_report(5.1, waiting=0, running=1)
    assert w.others_decodes == 1  # the lag: one request, for one report
    w.merge_report(6.1, waiting=0, running=0)
    assert w.others_decodes == 0


def test_a_replica_that_left_stops_counting_at_the_next_report():
    clock = Clock()
    c = make(clock)
    c.finished(c.place(req("warm")).request_id)
    c.report_load("p0", waiting=3, running=1, kv_usage=0.0)
    c.report_load("d0", waiting=0, running=9, kv_usage=0.0)
    idle(c, "p1", "d1")
    d = c.place(req("r1"))
    assert (d.prefill, d.decode) == ("p1", "d1")
    c.finished("r1")
    clock.t += 1.0  # the other replica was killed: vLLM aborted its requests, the workers say so
    c.report_load("p0", waiting=0, running=0, kv_usage=0.0)
    c.report_load("d0", waiting=0, running=0, kv_usage=0.0)
    c.expire_reports()
    assert c.workers["p0"].others_prefills == 0 and c.workers["d0"].others_decodes == 0
    assert c.workers["p0"].queue_s(clock.t) == 0.0


def test_a_worker_that_stops_answering_keeps_its_last_report_only_until_stale():
    clock = Clock()
    c = make(clock, staleness_s=3.0)
    c.report_load("d0", waiting=0, running=9, kv_usage=0.0)
    idle(c, "d1")
    for _ in range(3):  # rounds where d0 does not answer (no report_load) while d1 does
        clock.t += 1.0
        idle(c, "d1")
        c.expire_reports()
    assert c.workers["d0"].others_decodes == 9  # 3 s: within the staleness
    clock.t += 1.0
    c.expire_reports()
    assert c.workers["d0"].others is None


def test_the_same_report_any_number_of_times_gives_the_same_view():
    clock = Clock()
    c = make(clock)
    c.finished(c.place(req("warm")).request_id)
    views = []
    for _ in range(5):
        c.report_load("p0", waiting=2, running=1, kv_usage=0.25)
        p0 = c.workers["p0"]
        views.append((p0.others_prefills, p0.in_flight(), round(p0.queue_s(clock.t), 9),
                      p0.queued_prefill_tokens(), p0.kv_used_tokens(clock.t, 3.0)))
    assert len(set(views)) == 1 and views[0][0] == 3


def test_a_whole_worker_splits_its_report_into_prefills_and_decodes():
    w = WorkerLoad("e0", "elastic", 100_000)
    w.prefills["p"] = PrefillJob("p", 300, 0, 0.3, 0.0)  # own queued prefill
    w.decodes["d"] = DecodeJob("d", 100, 10, 200, started_at=1.0)  # own decode
    w.merge_report(5.0, waiting=3, running=4)
    assert (w.others_prefills, w.others_decodes) == (2, 3)
    assert w.in_flight() == 2 + 5


def test_others_prefills_cost_this_replicas_last_prefill_where_it_has_none_there():
    clock = Clock()
    c = make(clock)
    c.place(req("r0", n=320))  # placed on some P: the last prefill anywhere
    other = "p1" if c.workers["p0"].prefills else "p0"
    c.report_load(other, waiting=2, running=0, kv_usage=0.0)
    w = c.workers[other]
    assert c.last_prefill is not None
    assert w.mean_prefill_s == c.last_prefill.predicted_s > 0
    assert w.queued_prefill_tokens() == 2 * c.last_prefill.new_tokens
