"""Two router replicas on one port over real vLLM workers (issue 24, items 1 and 2), run from a test module whose
launch has ``routers=2`` and the conductor (tests/integration/test_conductor_vllm.py):

- both replicas hold the same prefix index, though each request went through only one of them (the workers
  publish, each replica subscribes to each worker);
- a worker removed and added back through one replica is gone from, then back in, both (the shared membership
  file), its index entries restored from its publisher's replay, and both place on it;
- one replica killed with SIGKILL: the other serves every following request at once; the supervisor restarts
  the killed one, which comes back with the current membership and index and takes its share again.

Each replica says who it is in ``GET /v1/pdserve/workers`` (``replica.pid``); the kernel picks the replica per
connection, so a replica is reached by asking until it answers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from typing import Any

BLOCK = 128


def _post(url: str, body: dict, method: str = "POST", timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def listings(router: str, pids: set[int] | None = None, timeout_s: float = 30.0) -> dict[int, dict[str, Any]]:
    """One membership listing per replica (by pid), asking until every one of ``pids`` (default: 2 replicas)
    has answered."""
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(router + "/v1/pdserve/workers", timeout=10) as resp:
            body = json.loads(resp.read())
        seen[body["replica"]["pid"]] = body
        if (pids is not None and pids <= set(seen)) or (pids is None and len(seen) >= 2):
            return seen
    raise AssertionError(f"replicas {pids or 'two'} did not all answer in {timeout_s} s; saw {sorted(seen)}")


def _index(body: dict[str, Any]) -> dict[str, int]:
    return {w["url"]: w.get("indexed_blocks", 0) for w in body["workers"]}


def _until_same_index(router: str, pids: set[int], holder: str, blocks: int, timeout_s: float = 30.0
                      ) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = listings(router, pids, timeout_s)
        indexes = [_index(seen[p]) for p in pids]
        if all(ix.get(holder, 0) >= blocks for ix in indexes) and all(ix == indexes[0] for ix in indexes):
            return seen
        assert time.monotonic() < deadline, f"replicas' indexes differ or lack {holder}: {indexes}"
        time.sleep(0.2)


def _prefix_request(router: str, prefix: list[int], tail: int) -> dict:
    body = {"model": "rl", "prompt": prefix + [200 + tail] * 20, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "pdserve_timings": True}
    return _post(router + "/v1/completions", body)


def run_replica_case(cluster: Any) -> None:
    router = cluster.router_url
    pids = {c.pid for c in cluster.routers}
    assert len(pids) == 2
    # 1. one request (through one replica): both replicas index the holder's blocks alike
    rng = random.Random(24)
    prefix = [rng.randrange(1000, 30000) for _ in range(6 * BLOCK + 20)]
    holder = _prefix_request(router, prefix, 0)["pdserve_timings"]["prefill_worker"]
    seen = _until_same_index(router, pids, holder, 6)
    assert all(seen[p]["replica"]["routers"] == 2 for p in pids)

    # 2. the holder removed through one replica, then added back with its publisher: both follow
    spec = next(w for w in cluster.plan.workers if w.url == holder)
    _post(router + "/v1/pdserve/workers", {"url": holder}, method="DELETE")
    deadline = time.monotonic() + 10
    while any(holder in _index(b) for b in listings(router, pids).values()):
        assert time.monotonic() < deadline, "a removal through one replica did not reach the other"
        time.sleep(0.2)
    other = next(u for u in cluster.worker_urls("prefill") if u != holder)
    assert _prefix_request(router, prefix, 1)["pdserve_timings"]["prefill_worker"] == other
    _post(router + "/v1/pdserve/workers", {"url": holder, "role": "prefill", "kv_events": spec.kv_events_endpoint,
                                           "kv_replay": spec.kv_events_replay})
    # its blocks come back into both indexes from its publisher's replay buffer, with no new traffic there
    before = {p: b["decisions"].get("disaggregated", 0) for p, b in
              _until_same_index(router, pids, holder, 6).items()}
    for i in range(8):  # new connections each: the kernel spreads them over both replicas
        assert _prefix_request(router, prefix, 10 + i)["pdserve_timings"]["prefill_worker"] == holder
    after = {p: b["decisions"].get("disaggregated", 0) for p, b in listings(router, pids).items()}
    assert all(after[p] > before[p] for p in pids), f"one replica placed nothing: {before} -> {after}"

    # 3. one replica killed: every following request succeeds at once; the supervisor brings it back
    victim = cluster.routers[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    for i in range(6):
        out = _prefix_request(router, prefix, 30 + i)
        assert out["pdserve_timings"]["prefill_worker"] == holder and out["choices"][0]["text"] is not None
    cluster.supervise_in_background(0.2)
    deadline = time.monotonic() + 120
    while cluster.routers[1].pid == victim.pid:
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.2)
    back = {c.pid for c in cluster.routers}
    # the restarted replica has the current membership (the re-added holder) and its index, by replay
    seen = _until_same_index(router, back, holder, 6, timeout_s=120)
    assert {w["url"] for w in seen[cluster.routers[1].pid]["workers"]} == set(cluster.worker_urls())
