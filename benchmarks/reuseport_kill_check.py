"""What kill -9 of one SO_REUSEPORT listener does to the connections waiting in its accept queue.

    python benchmarks/reuseport_kill_check.py          # needs unshare (root, or unprivileged user namespaces)

`pdserve serve --routers N` runs N router processes on one port with SO_REUSEPORT: the kernel hashes each new
connection to one listener, where it waits in that listener's accept queue until its process accepts it. When a
router replica is killed, what happens to the connections still in its queue (the handshake done, the client
already sending its request, the process never read it)? Linux decides by ``net.ipv4.tcp_migrate_req`` (5.14+):
0, the default, resets them; 1 hands them to another listener of the same group.

The check runs in a fresh network namespace (``unshare -n``; the sysctl is per namespace, so the host's is never
touched), once with each value: listener A binds and never accepts (a replica busy or about to die), listener B
binds the same port and answers every connection; the client opens 40 connections and sends a request on each,
the ones the kernel gave to A wait in A's queue; then kill -9 A and see what each of those gets.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

PORT = 18080
CONNECTIONS = 40


def _listener() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", PORT))
    s.listen(128)
    return s


def never_accepts() -> None:
    s = _listener()  # kept open (and never accepted from) until the process dies
    print("up", flush=True)
    time.sleep(600)
    s.close()


def answers() -> None:
    s = _listener()
    print("up", flush=True)
    while True:
        c, _ = s.accept()
        c.recv(100)
        c.sendall(b"served")
        c.close()


def one_case(migrate: int) -> dict:
    """Inside the namespace: set the sysctl, run A and B, queue connections on A, kill -9 A."""
    with open("/proc/sys/net/ipv4/tcp_migrate_req", "w") as f:
        f.write(str(migrate))
    a = subprocess.Popen([sys.executable, __file__, "--never-accepts"], stdout=subprocess.PIPE)
    b = subprocess.Popen([sys.executable, __file__, "--answers"], stdout=subprocess.PIPE)
    try:
        for p in (a, b):
            assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        queued, served_at_once = [], 0
        for _ in range(CONNECTIONS):
            c = socket.create_connection(("127.0.0.1", PORT))
            c.sendall(b"request")
            c.settimeout(0.3)
            try:
                if c.recv(100) == b"served":
                    served_at_once += 1
                c.close()
            except TimeoutError:
                queued.append(c)  # the kernel gave it to A, which never accepts
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        after: dict[str, int] = {}
        for c in queued:
            c.settimeout(3.0)
            try:
                got = c.recv(100)
                k = "served by the other listener" if got == b"served" else "closed"
            except ConnectionResetError:
                k = "reset"
            except TimeoutError:
                k = "no answer in 3 s"
            after[k] = after.get(k, 0) + 1
            c.close()
        return {"tcp_migrate_req": migrate, "connections": CONNECTIONS, "served_by_B_at_once": served_at_once,
                "queued_on_killed_A": len(queued), "after_kill": after}
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    if "--never-accepts" in sys.argv:
        never_accepts()
        return 0
    if "--answers" in sys.argv:
        answers()
        return 0
    if "--case" in sys.argv:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        print(json.dumps(one_case(int(sys.argv[sys.argv.index("--case") + 1]))))
        return 0
    unshare = shutil.which("unshare")
    if unshare is None:
        print("needs util-linux's unshare", file=sys.stderr)
        return 2
    prefix = [unshare, "-n"] if os.geteuid() == 0 else [unshare, "-rn"]
    rows = []
    for migrate in (0, 1):
        out = subprocess.run(prefix + [sys.executable, __file__, "--case", str(migrate)], capture_output=True,
                             text=True, timeout=120)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'tcp_migrate_req':>15} {'connections':>11} {'to B':>5} {'queued on A':>11}  after kill -9 of A")
    for r in rows:
        print(f"{r['tcp_migrate_req']:>15} {r['connections']:>11} {r['served_by_B_at_once']:>5} "
              f"{r['queued_on_killed_A']:>11}  {r['after_kill']}")
    print(json.dumps({"bench": "reuseport_kill_check", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
