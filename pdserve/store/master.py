"""The pool master process: metadata only. Nodes register their arena (a transfer-engine segment) and SSD
capacity and heartbeat; clients ask where to write (put_start/put_end) and where to read (get, leased);
the master never sees KV bytes. A maintenance thread drops silent nodes, reclaims abandoned puts and keeps
every node's tiers between the watermarks (spilling arena objects to the node's SSD tier).

RPC methods (msgpack over :mod:`pdserve.store.rpc`, HMAC-authenticated, args as a map):

=============  =====================================================================================
register       node joins/re-joins with ``objects`` it holds (after a master or node restart)
heartbeat      node is alive; reply carries its journal (objects added/removed on it) or ``known: false``
put_start      ``keys, sizes[, replicas]`` -> per key ``alloc`` (where to write) / ``exists`` / ``full``
put_end        ``keys, ok`` -> written objects become visible
get            ``keys`` -> per key ``{"r": [[node, offset], ...], "size"}`` (leased) or None; + ``nodes``
release        ``keys``: the reader is done (ends the lease early)
exists/prefix  ``keys`` -> [bool] / number of leading keys present
remove         ``keys`` -> removed count (leased ones go when their lease ends)
keys           every visible key (the conductor's full resync)
disk_keys      the visible keys on SSD only (the pool's disk tier, for the same resync)
events         ``since`` -> ``{"events": [[seq, "stored"|"removed"|"spilled"|"promoted", key], ...], "next",
               "reset"}`` (spilled: now on SSD only; promoted: back in memory)
stats          counters and gauges (also Prometheus text on ``metrics_port``)
=============  =====================================================================================
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .catalog import Catalog
from .config import MasterConfig
from .records import Spill
from .rpc import RpcClient, RpcServer, StoreError

log = logging.getLogger("pdserve.store.master")


def _keys(args: dict[str, Any]) -> list[int]:
    keys = args["keys"]
    if not isinstance(keys, list) or not all(isinstance(k, int) and 0 <= k < 1 << 64 for k in keys):
        raise StoreError("bad_request", "keys must be a list of uint64 block keys")
    return keys


class Master:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.catalog = Catalog(config.replicas, config.high_watermark, config.low_watermark, config.get_lease_s,
                               config.node_timeout_s, config.put_timeout_s, config.events_kept)
        self._links: dict[tuple[str, int], RpcClient] = {}
        self._links_lock = threading.Lock()
        self._stop = threading.Event()
        handlers = {
            "register": self._register, "heartbeat": self._heartbeat, "put_start": self._put_start,
            "put_end": self._put_end, "get": self._get, "release": self._release, "exists": self._exists,
            "prefix": self._prefix, "remove": self._remove, "keys": self._keys, "events": self._events,
            "disk_keys": lambda a: self.catalog.disk_keys(),
            "stats": lambda a: self.catalog.stats(), "ping": lambda a: "pong",
        }
        self.server = RpcServer(config.host, config.port, config.secret, handlers, "pdserve-store-master")
        self.port = self.server.port
        self._maint = threading.Thread(target=self._maintenance, name="pdserve-store-maint", daemon=True)
        self._maint.start()
        self.http: ThreadingHTTPServer | None = None
        if config.metrics_port:
            self.http = _metrics_server(self, config.host, config.metrics_port)
        log.info("pool master on %s:%d (replicas %d, watermarks %.2f/%.2f, lease %.1fs)", config.host, self.port,
                 config.replicas, config.low_watermark, config.high_watermark, config.get_lease_s)

    # ---- node calls
    def _link(self, node_id: str) -> RpcClient | None:
        with self.catalog.lock:
            node = self.catalog.nodes.get(node_id)
            rpc = node.rpc if node else None
        if rpc is None:
            return None
        with self._links_lock:
            link = self._links.get(rpc)
            if link is None:
                link = self._links[rpc] = RpcClient(rpc[0], rpc[1], self.config.secret, timeout_s=30.0)
            return link

    # ---- handlers
    def _register(self, a: dict[str, Any]) -> dict[str, Any]:
        res = self.catalog.register_node(str(a["node_id"]), a["rpc"], a["segment"], int(a["mem_capacity"]),
                                         int(a["ssd_capacity"]), a.get("objects") or ())
        log.info("node %s registered (%d objects adopted, %d rejected)", a["node_id"], res["adopted"],
                 res["rejected"])
        return res

    def _heartbeat(self, a: dict[str, Any]) -> dict[str, Any]:
        res = self.catalog.heartbeat(str(a["node_id"]), int(a.get("ack", 0)))
        return {"known": False} if res is None else {"known": True, **res}

    def _put_start(self, a: dict[str, Any]) -> dict[str, Any]:
        keys, sizes = _keys(a), a["sizes"]
        if len(sizes) != len(keys) or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise StoreError("bad_request", "sizes must be one positive byte count per key")
        res = self.catalog.put_start(keys, sizes, a.get("replicas"))
        full = [i for i, r in enumerate(res) if r["s"] == "full"]
        if full:  # make room now (least recently used objects leave), then try those keys once more
            need = sum(sizes[i] for i in full)
            for node_id in list(self.catalog.nodes):
                self._run_spills(self.catalog.make_room(node_id, need))
            for i, r in zip(full, self.catalog.put_start([keys[i] for i in full], [sizes[i] for i in full],
                                                         a.get("replicas"))):
                res[i] = r
        nodes = {n for r in res if r["s"] == "alloc" for n, _ in r["r"]}
        return {"res": res, "nodes": self.catalog.segments(nodes)}

    def _put_end(self, a: dict[str, Any]) -> int:
        return self.catalog.put_end(_keys(a), [bool(x) for x in a["ok"]])

    def _get(self, a: dict[str, Any]) -> dict[str, Any]:
        keys = _keys(a)
        out: list[dict | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for round_ in range(3):
            if not todo:
                break
            res = self.catalog.get_start([keys[i] for i in todo], nospace=round_ < 2)
            promote: dict[str, list[int]] = defaultdict(list)
            waiting: list[int] = []
            room: dict[str, int] = defaultdict(int)
            for i, r in zip(todo, res):
                if r["s"] == "nospace":  # an SSD object to promote, but its node's arena is full
                    room[r["node"]] += r["size"]
                    waiting.append(i)
                if r["s"] == "mem":
                    out[i] = {"r": r["r"], "size": r["size"]}
                elif r["s"] == "promote":
                    promote[r["node"]].append(i)
                    out[i] = r
                elif r["s"] == "wait":
                    waiting.append(i)
            for node_id, idx in promote.items():
                self._promote(node_id, [keys[i] for i in idx], [out[i] for i in idx], out, idx)
            for node_id, nbytes in room.items():
                self._run_spills(self.catalog.make_room(node_id, nbytes))
            if waiting:
                self.catalog.wait_promotions([keys[i] for i in waiting], self.config.get_lease_s)
            todo = waiting
        nodes = {n for r in out if r for n, _ in r["r"]}
        return {"loc": out, "nodes": self.catalog.segments(nodes)}

    def _promote(self, node_id: str, keys: list[int], plans: list[Any], out: list[Any], idx: list[int]) -> None:
        items = [[k, p["offset"], p["size"]] for k, p in zip(keys, plans)]
        link = self._link(node_id)
        try:
            oks = link.call("promote", items=items) if link else [False] * len(items)
        except StoreError as exc:
            log.warning("promote of %d objects on node %s failed: %s", len(items), node_id, exc)
            oks = [False] * len(items)
        for (key, offset, size), ok, i in zip(items, oks, idx):
            good = self.catalog.finish_promote(key, node_id, offset, size, bool(ok))
            out[i] = {"r": [[node_id, offset]], "size": size} if good else None

    def _release(self, a: dict[str, Any]) -> None:
        self.catalog.release(_keys(a))

    def _exists(self, a: dict[str, Any]) -> list[bool]:
        return self.catalog.exists(_keys(a))

    def _prefix(self, a: dict[str, Any]) -> int:
        return self.catalog.prefix(_keys(a))

    def _remove(self, a: dict[str, Any]) -> int:
        return self.catalog.remove(_keys(a))

    def _keys(self, a: dict[str, Any]) -> list[int]:
        return self.catalog.keys()

    def _events(self, a: dict[str, Any]) -> dict[str, Any]:
        return self.catalog.events_since(int(a.get("since", 0)), int(a.get("limit", 10000)))

    # ---- maintenance
    def _maintenance(self) -> None:
        while not self._stop.wait(self.config.maintenance_s):
            try:
                for node_id in self.catalog.drop_silent_nodes():
                    log.warning("node %s missed heartbeats for %.1fs: dropped with its objects", node_id,
                                self.config.node_timeout_s)
                self.catalog.reclaim_stale_puts()
                self._run_spills(self.catalog.plan_evictions())
            except Exception:
                log.exception("pool maintenance pass failed; next pass in %.2fs", self.config.maintenance_s)

    def _run_spills(self, spills: list[Spill]) -> None:
        by_node: dict[str, list[Spill]] = defaultdict(list)
        for s in spills:
            by_node[s.node].append(s)
        for node_id, group in by_node.items():
            link = self._link(node_id)
            try:
                oks = link.call("spill", items=[[s.key, s.offset, s.size] for s in group]) if link else []
            except StoreError as exc:
                log.warning("spill of %d objects on node %s failed: %s", len(group), node_id, exc)
                oks = []
            for i, s in enumerate(group):
                self.catalog.finish_spill(s, bool(oks[i]) if i < len(oks) else False)

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        with self._links_lock:
            for link in self._links.values():
                link.close()


def prometheus_text(stats: dict[str, Any]) -> str:
    """Counters as ``pdserve_store_<name>_total``, gauges as ``pdserve_store_<name>``."""
    from .records import METRIC_COUNTERS

    lines = []
    for name, value in stats.items():
        if name in METRIC_COUNTERS:
            lines += [f"# TYPE pdserve_store_{name}_total counter", f"pdserve_store_{name}_total {value}"]
        else:
            lines += [f"# TYPE pdserve_store_{name} gauge", f"pdserve_store_{name} {value}"]
    return "\n".join(lines) + "\n"


def _metrics_server(master: Master, host: str, port: int) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0] not in ("/metrics", "/health"):
                self.send_error(404)
                return
            body = (prometheus_text(master.catalog.stats()) if self.path.startswith("/metrics") else "ok").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    httpd = ThreadingHTTPServer((host, port), H)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="pdserve-store-metrics", daemon=True).start()
    return httpd
