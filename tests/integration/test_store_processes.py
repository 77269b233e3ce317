"""KV pool across real processes: a master and two store nodes (`pdserve store ...`), a client here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.launch.procs import free_port
from pdserve.store import ClientConfig, StoreClient
from pdserve.transfer import TransferConfig, TransferEngine

from .conftest import ROOT, SECRET

pytestmark = pytest.mark.integration
BLOCK = 64 << 10


class Proc:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_TRANSFER_SECRET=SECRET)
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.store.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        line = self.proc.stdout.readline()
        assert line, f"pdserve store {args[0]} exited with {self.proc.wait()}"
        self.info = json.loads(line)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


@pytest.fixture
def pool(tmp_path: Path):
    procs: list[Proc] = []

    def start(*args: str) -> Proc:
        p = Proc(*args)
        procs.append(p)
        return p

    port = free_port()
    master = start("master", "--port", str(port), "--node-timeout-s", "1.5", "--lease-s", "3")
    nodes = [start("node", "--master", f"127.0.0.1:{port}", "--mem", "8MiB", "--disk-dir", str(tmp_path / f"n{i}"),
                   "--disk", "32MiB", "--node-id", f"n{i}", "--heartbeat-s", "0.2") for i in range(2)]
    engine = TransferEngine(TransferConfig(secret=SECRET))
    src = np.random.default_rng(1).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    engine.register("src", src)
    engine.register("dst", dst)
    client = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET, timeout_s=3.0), engine)
    deadline = time.time() + 10
    while client.stats()["nodes"] < 2:
        assert time.time() < deadline, "nodes did not register"
        time.sleep(0.05)
    ns = {"master": master, "nodes": nodes, "client": client, "src": src, "dst": dst, "port": port,
          "start": start}
    yield ns
    client.close()
    engine.close()
    for p in procs:
        p.stop()


def items(keys, region: str, split: bool = False):
    """Object k = block k of the region (two pieces when split, to exercise gather/scatter)."""
    out = []
    for k in keys:
        off = (k % 64) * BLOCK
        out.append((k, [(region, off, BLOCK // 2), (region, off + BLOCK // 2, BLOCK // 2)] if split
                    else [(region, off, BLOCK)]))
    return out


def blocks_equal(pool, keys) -> bool:
    return all(np.array_equal(pool["src"][(k % 64) * BLOCK:(k % 64 + 1) * BLOCK],
                              pool["dst"][(k % 64) * BLOCK:(k % 64 + 1) * BLOCK]) for k in keys)


def test_put_get_byte_exact_across_two_nodes(pool) -> None:
    c = pool["client"]
    keys = list(range(1, 41))
    assert c.put(items(keys, "src", split=True)) == ["stored"] * 40
    assert c.put(items(keys[:3], "src")) == ["exists"] * 3
    assert c.exists(keys + [999]) == [True] * 40 + [False]
    assert c.get_into(items(keys, "dst")) == [True] * 40
    assert blocks_equal(pool, keys)
    st = c.stats()
    assert st["hits"] == 40 and st["bytes_mem"] == 40 * BLOCK and st["leased"] == 0  # leases released


def test_spill_to_ssd_and_promote_back_byte_exact(pool) -> None:
    c = pool["client"]
    keys = list(range(100, 400))  # 300 x 64 KiB = 18.75 MiB > 2 x 8 MiB of arenas: most go to SSD
    statuses = c.put(items(keys, "src"))
    assert statuses.count("stored") >= 250
    time.sleep(0.5)
    st = c.stats()
    assert st["spills"] > 0 and st["bytes_ssd"] > 0
    stored = [k for k, s in zip(keys, statuses) if s == "stored"]
    present = [k for k, e in zip(stored, c.exists(stored)) if e]
    oldest = present[:20]  # least recently used: spilled to SSD
    # the master's log and disk_keys say which pooled objects are on SSD only (the index's pool_disk tier)
    on_disk = set(c.master.call("disk_keys"))
    since = c.events(0, limit=100000)
    spilled = {k for _, kind, k in since["events"] if kind == "spilled"}
    assert set(oldest) <= on_disk <= spilled and on_disk <= set(stored)
    pool["dst"][:] = 0
    assert c.get_into(items(oldest, "dst")) == [True] * 20
    assert blocks_equal(pool, oldest)
    assert c.stats()["promotes"] > 0
    promoted = {k for _, kind, k in c.events(since["next"], limit=100000)["events"] if kind == "promoted"}
    assert set(oldest) <= promoted and not set(oldest) & set(c.master.call("disk_keys"))


def test_killed_node_objects_reported_missing_without_hanging(pool) -> None:
    c = pool["client"]
    keys = list(range(1, 31))
    assert c.put(items(keys, "src")) == ["stored"] * 30
    pool["nodes"][0].stop()
    t0 = time.time()
    got = c.get_into(items(keys, "dst"))
    assert time.time() - t0 < 5, "a dead node must fail its reads at once, not hang"
    assert 0 < sum(got) < 30  # the other node's objects still arrive
    assert blocks_equal(pool, [k for k, g in zip(keys, got) if g])
    deadline = time.time() + 5
    while c.stats()["nodes"] != 1:
        assert time.time() < deadline, "the master did not drop the silent node"
        time.sleep(0.1)
    assert c.exists(keys) == got  # the master now reports the dead node's objects missing


def test_master_restart_nodes_reregister_objects_reachable(pool) -> None:
    c = pool["client"]
    keys = list(range(1, 31))
    assert c.put(items(keys, "src")) == ["stored"] * 30
    time.sleep(0.6)  # a few heartbeats: the nodes learn what they hold
    pool["master"].stop()
    pool["start"]("master", "--port", str(pool["port"]), "--node-timeout-s", "1.5")
    deadline = time.time() + 10
    while True:
        try:
            if c.stats()["objects"] == 30:
                break
        except Exception:
            pass
        assert time.time() < deadline, "objects did not come back after the master restart"
        time.sleep(0.1)
    assert c.get_into(items(keys, "dst")) == [True] * 30
    assert blocks_equal(pool, keys)
    assert c.put(items([500], "src")) == ["stored"]  # and it allocates around the adopted objects


def test_two_replicas_on_distinct_nodes_survive_a_node_kill(pool, tmp_path: Path) -> None:
    port = free_port()
    start = pool["start"]
    start("master", "--port", str(port), "--replicas", "2", "--node-timeout-s", "1.5")
    nodes = [start("node", "--master", f"127.0.0.1:{port}", "--mem", "8MiB", "--node-id", f"r{i}",
                   "--heartbeat-s", "0.2") for i in range(2)]
    c = StoreClient(ClientConfig("127.0.0.1", port, secret=SECRET, timeout_s=3.0), pool["client"].engine)
    try:
        deadline = time.time() + 10
        while c.stats()["nodes"] < 2:
            assert time.time() < deadline
            time.sleep(0.05)
        keys = list(range(1, 21))
        assert c.put(items(keys, "src")) == ["stored"] * 20
        assert c.stats()["bytes_mem"] == 2 * 20 * BLOCK  # every object twice
        nodes[0].stop()
        assert c.get_into(items(keys, "dst")) == [True] * 20  # the dead node's copies fail over at once
        assert blocks_equal(pool, keys)
    finally:
        c.close()
