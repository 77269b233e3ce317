"""A tiny OTLP/gRPC trace collector for the tests, built from opentelemetry-proto's published service definitions:
``python -m tests.integration.otlp_collector PORT OUT`` listens on 127.0.0.1:PORT and appends each span it is sent
to OUT as one JSON line (service, trace, span and parent ids in hex, name, kind, times, attributes, events).

:class:`Collector` runs it as a child process for a test and reads what it received."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(request: Any) -> list[dict[str, Any]]:
    """The spans of one ExportTraceServiceRequest as plain dicts."""
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({"service": resource.get("service.name", ""), "resource": resource,
                            "scope": ss.scope.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                            "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                            "status": s.status.code, "attributes": _attrs(s.attributes),
                            "events": [{"name": e.name, "attributes": _attrs(e.attributes)} for e in s.events]})
    return out


def serve(port: int, out: Path) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    lock = threading.Lock()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the service's method name)
            lines = "".join(json.dumps(s) + "\n" for s in spans_of(request))
            with lock, out.open("a") as f:
                f.write(lines)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("listening", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()


class Collector:
    """The collector as a child process on a free port: ``endpoint`` for ``--otlp-traces-endpoint``, :meth:`spans`
    for what it received, :meth:`wait_for` to poll (exporters batch: seconds), :meth:`stop`."""

    def __init__(self, folder: Path) -> None:
        from pdserve.launch.ports import free_port

        self.port = free_port()
        self.out = folder / "spans.jsonl"
        self.out.touch()
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.otlp_collector", str(self.port),
                                      str(self.out)], cwd=root, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root)})
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "listening"
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def spans(self, trace_id: str | None = None) -> list[dict[str, Any]]:
        rows = [json.loads(line) for line in self.out.read_text().splitlines() if line]
        return [s for s in rows if trace_id is None or s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, ready: Any, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The trace's spans once ``ready(spans)`` holds (AssertionError with what came, past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.spans(trace_id)
            if ready(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: {sorted((s['service'], s['name']) for s in got)}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def tree(spans: list[dict[str, Any]]) -> str:
    """The spans of one trace as an indented tree (service: name, ms), children in start order."""
    ids = {s["span_id"] for s in spans}
    kids: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        kids.setdefault(s["parent_span_id"] if s["parent_span_id"] in ids else "", []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(kids.get(parent, []), key=lambda s: s["start_ns"]):
            ms = (s["end_ns"] - s["start_ns"]) / 1e6
            lines.append(f"{'  ' * depth}{s['service']}: {s['name']} ({ms:.1f} ms)")
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return "\n".join(lines)


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
