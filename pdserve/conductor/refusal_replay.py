"""False refusals: which early rejections the measured requests show would have met their target (issue 40).

An early rejection (429, code ``slo``) is a prediction: "this request would miss the TTFT (or TPOT) target".
Nobody can run the refused request to check it without spending the capacity the rejection saved, but the
requests the conductor *did* place on the same worker at the same moment were run, and their measured TTFT bounds
what the refused one's would have been. The replay uses only those measurements and two facts of vLLM's scheduler
(its waiting queue is first come, first served; more prompt tokens never take less compute), no prediction:

- **Upper bound (false refusal).** A request placed on the same worker ``dt`` seconds *after* the refusal (within
  ``window_s``), with at least as many tokens to compute and as long a prompt, found everything the refused one
  would have waited for still ahead of it, and more compute of its own. Had the refused request been admitted it
  would have had its first token no later than that request did: TTFT <= dt + its measured TTFT. When that is
  within the target, the refusal was false.
- **Lower bound (right refusal).** A request placed on the same worker ``dt`` seconds *before* the refusal was
  ahead of it in the queue; the refused request could not have finished before it: TTFT >= its measured TTFT -
  dt. When that is over the target, the refusal was right.
- Neither bound decides (no neighbour placed close enough, or the bounds contradict each other): **unverified**,
  counted apart and never in the share. So the share ``false / (false + right)`` counts only verdicts a
  measurement proves (up to the measurement noise of one request).

A TPOT refusal is judged the same way from the measured TPOT of requests decoding on the same worker placed within
the window: one with at least the refused request's context that met the target makes it false, one with at most
its context that missed makes it right. That bound is looser than TTFT's: the refused request would have added one
sequence to that worker's batch. A refusal for KV room has no such measure and stays unverified.

Bounded: at most ``max_pending`` refusals wait for their verdict (the oldest are declared unverified), each keeps
at most :data:`MAX_NEAR` neighbours, the newest ``max_placed`` placements are kept for ``horizon_s``, and a refusal
whose neighbours have not all closed by then is judged on those that have. A verdict comes at the first event
after its window (a refusal, a placement's close, a scrape of /metrics).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

VERDICTS = ("false_refusal", "right", "unverified")
MAX_NEAR = 64  # neighbours a refusal keeps (the first ones placed beside it)
TARGETS = ("ttft", "tpot", "kv")


@dataclass
class Neighbour:
    """A placed request as the replay sees it: when it was decided, where, how much work, what it measured."""

    at: float
    computes: str  # the worker computing its prompt
    decodes: str
    new_tokens: int
    prompt_tokens: int
    context_tokens: int  # prompt + max_tokens: what its decode holds at most
    ttft_s: float | None = None
    tpot_s: float | None = None
    closed: bool = False


@dataclass
class Refusal:
    """An early rejection waiting for its verdict."""

    request_id: str
    at: float
    target: str  # "ttft", "tpot" or "kv"
    target_s: float
    worker: str  # the worker whose queue (TTFT) or batch (TPOT) it was refused for
    new_tokens: int
    prompt_tokens: int
    context_tokens: int
    # placed on its worker within the window: (request id, its figures, placed after the refusal)
    near: list[tuple[str, Neighbour, bool]] = field(default_factory=list)

    def on_its_worker(self, n: Neighbour) -> bool:
        return (n.computes if self.target == "ttft" else n.decodes) == self.worker


@dataclass
class Verdict:
    """What the replay concluded: the verdict, the bound that proved it (seconds; None when unverified) and the
    request whose measurement gave it."""

    verdict: str
    target: str
    bound_s: float | None = None
    by: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"verdict": self.verdict, "target": self.target,
                "bound_s": None if self.bound_s is None else round(self.bound_s, 6), "by": self.by}


@dataclass
class RefusalReplay:
    """The replay (module docstring). ``clock``: the same monotonic seconds the caller stamps decisions with."""

    clock: Callable[[], float]
    window_s: float = 2.0
    horizon_s: float = 600.0
    max_pending: int = 1024
    max_placed: int = 8192
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (target, verdict) -> refusals
    on_verdict: list[Callable[[str, Verdict], None]] = field(default_factory=list)
    _placed: OrderedDict[str, Neighbour] = field(default_factory=OrderedDict)
    _pending: deque[Refusal] = field(default_factory=deque)

    def refused(self, r: Refusal) -> None:
        """An early rejection: judged once its window has passed and its neighbours have closed."""
        for rid, n in reversed(self._placed.items()):  # the placements just before it (newest first)
            if n.at < r.at - self.window_s:
                break
            if r.on_its_worker(n) and len(r.near) < MAX_NEAR:
                r.near.append((rid, n, False))
        self._pending.append(r)
        while len(self._pending) > self.max_pending:
            old = self._pending.popleft()
            self._conclude(old, Verdict("unverified", old.target))
        self.resolve()

    def placed(self, request_id: str, n: Neighbour) -> None:
        """A request placed (its first placement); its measurement comes with :meth:`closed`."""
        self._placed[request_id] = n
        self._placed.move_to_end(request_id)
        while len(self._placed) > self.max_placed:
            self._placed.popitem(last=False)
        for r in reversed(self._pending):  # the refusals just before it (newest first)
            if r.at < n.at - self.window_s:
                break
            if r.on_its_worker(n) and len(r.near) < MAX_NEAR:
                r.near.append((request_id, n, True))

    def closed(self, request_id: str, ttft_s: float | None, tpot_s: float | None) -> None:
        """The placement's measured TTFT and TPOT (None: not measured)."""
        n = self._placed.get(request_id)
        if n is None or n.closed:
            return
        n.ttft_s, n.tpot_s, n.closed = ttft_s, tpot_s, True
        self.resolve()

    def resolve(self) -> None:
        """Judge every pending refusal whose window has passed and whose neighbours have all closed (or that is
        past the horizon); drop placements older than the horizon."""
        now = self.clock()
        while self._placed:
            first = next(iter(self._placed.values()))
            if now - first.at <= self.horizon_s:
                break
            self._placed.popitem(last=False)
        keep: deque[Refusal] = deque()
        while self._pending and self._pending[0].at + self.window_s <= now:  # due: its window has passed
            r = self._pending.popleft()
            if any(not n.closed for _, n, _ in r.near) and now - r.at <= self.horizon_s:
                keep.append(r)
            else:
                self._conclude(r, judge(r, r.near))
        keep.extend(self._pending)
        self._pending = keep

    def _conclude(self, r: Refusal, v: Verdict) -> None:
        key = (v.target, v.verdict)
        self.counts[key] = self.counts.get(key, 0) + 1
        for hook in self.on_verdict:
            hook(r.request_id, v)

    def share(self) -> float | None:
        """False refusals among the verified ones (None before any verdict)."""
        false = sum(n for (_, v), n in self.counts.items() if v == "false_refusal")
        right = sum(n for (_, v), n in self.counts.items() if v == "right")
        return false / (false + right) if false + right else None

    def pending(self) -> int:
        return len(self._pending)


def judge(r: Refusal, near: list[tuple[str, Neighbour, bool]]) -> Verdict:
    """The verdict on ``r`` from the measured neighbours placed on its worker within the window."""
    if r.target == "ttft":
        return _judge_ttft(r, near)
    if r.target == "tpot":
        return _judge_tpot(r, near)
    return Verdict("unverified", r.target)


def _judge_ttft(r: Refusal, near: list[tuple[str, Neighbour, bool]]) -> Verdict:
    upper: tuple[float, str] | None = None
    lower: tuple[float, str] | None = None
    for rid, n, after in near:
        if n.ttft_s is None:
            continue
        dt = n.at - r.at
        if after and n.new_tokens >= r.new_tokens and n.prompt_tokens >= r.prompt_tokens:
            b = dt + n.ttft_s  # the refused request would have had its first token by then
            if upper is None or b < upper[0]:
                upper = (b, rid)
        if not after:
            b = n.ttft_s + dt  # ... and not before this one, which was ahead of it
            if lower is None or b > lower[0]:
                lower = (b, rid)
    met = upper is not None and upper[0] <= r.target_s
    missed = lower is not None and lower[0] > r.target_s
    if met and not missed and upper is not None:  # (both: two measurements disagree, noise; no verdict)
        return Verdict("false_refusal", "ttft", upper[0], upper[1])
    if missed and not met and lower is not None:
        return Verdict("right", "ttft", lower[0], lower[1])
    return Verdict("unverified", "ttft")


def _judge_tpot(r: Refusal, near: list[tuple[str, Neighbour, bool]]) -> Verdict:
    met: tuple[float, str] | None = None
    missed: tuple[float, str] | None = None
    for rid, n, _ in near:
        if n.tpot_s is None:
            continue
        if n.context_tokens >= r.context_tokens and n.tpot_s <= r.target_s and (met is None or n.tpot_s < met[0]):
            met = (n.tpot_s, rid)
        if n.context_tokens <= r.context_tokens and n.tpot_s > r.target_s and (
                missed is None or n.tpot_s > missed[0]):
            missed = (n.tpot_s, rid)
    if met is not None and missed is None:
        return Verdict("false_refusal", "tpot", met[0], met[1])
    if missed is not None and met is None:
        return Verdict("right", "tpot", missed[0], missed[1])
    return Verdict("unverified", "tpot")
