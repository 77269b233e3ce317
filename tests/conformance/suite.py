"""Run conformance cases against a router and one plain worker and judge each: ``identical``, a known difference
that holds (its name in compare.KNOWN), or ``different`` with what differs."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.router.api.fields import FIELDS

from .cases import ENDPOINTS, Case
from .compare import KNOWN, differences, post, summary

# fields whose streamed answers the quick tier checks too (the rest: the full tier)
STREAMED = {"stream", "stream_options", "stream_interval", "logprobs", "top_logprobs", "n", "stop",
            "include_stop_str_in_output", "return_token_ids", "prompt", "messages", "truncate_prompt_tokens",
            "min_tokens", "bad_words", "tools", "tool_choice", "echo", "response_format", "max_tokens", "use_beam_search"}
# values that make sampling random: the case is seeded, and must be identical to one worker's
SEEDED = 7


# differences the suite found and nobody has fixed yet (issue 25's follow-ups), by case key: each must still
# differ on every run that sends it (strict: a fixed one fails the test until its line goes)
OPEN: dict[str, str] = {}


@dataclass
class Verdict:
    case: Case
    stream: bool
    kind: str  # "identical", a compare.KNOWN key, "open" (in OPEN) or "different"
    detail: str = ""

    @property
    def key(self) -> str:
        return self.case.name + (" (streamed)" if self.stream else "")


def _random(body: dict[str, Any]) -> bool:
    t = body.get("temperature")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0


def judge(router_url: str, worker_url: str, case: Case, stream: bool) -> Verdict:
    body = case.body()
    chat = case.endpoint == "chat"
    if stream:
        body["stream"] = True
    if _random(body):
        body.setdefault("seed", SEEDED)
    path = ENDPOINTS[case.endpoint]
    use = FIELDS[case.endpoint][case.field][0]
    mine_status, mine_answer = post(router_url + path, body)
    mine = summary(mine_status, mine_answer, chat, bool(body.get("stream")))
    if use == "refused" and case.value not in (None, False, [], {}):
        ok = mine["status"] == 400 and mine.get("param") == case.field
        return Verdict(case, stream, "refused" if ok else "different", "" if ok else f"router: {mine}")
    ref_status, ref_answer = post(worker_url + path, body)
    ref = summary(ref_status, ref_answer, chat, bool(body.get("stream")))
    diffs = differences(mine, ref)
    if not diffs:
        return Verdict(case, stream, "identical")
    return Verdict(case, stream, "different", "; ".join(diffs)[:600])


def run(router_url: str, worker_url: str, cases: list[Case], stream_all: bool,
        log: Callable[[str], None] | None = None, clients: int = 4) -> tuple[list[Verdict], float]:
    """Every case, unstreamed, and streamed when ``stream_all`` or its field is in :data:`STREAMED`; ``clients``
    cases at a time (greedy fp32 answers do not depend on the batch they share)."""
    t0 = time.monotonic()
    runs = [(case, stream) for case in cases
            for stream in ((False, True) if stream_all or case.field in STREAMED else (False,))]

    def one(item: tuple[Case, bool]) -> Verdict:
        t = time.monotonic()
        v = judge(router_url, worker_url, *item)
        if v.kind == "different" and v.key in OPEN:
            v.kind = "open"
        if log is not None:
            log(f"{time.monotonic() - t:6.2f}s {v.kind} {v.key}")
        return v

    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, runs))
    return out, time.monotonic() - t0


def field_table(verdicts: list[Verdict]) -> str:
    """Per endpoint, over every value tried of each field (streamed and not): fields whose every case was
    identical, fields with a known difference (the kinds seen), open, refused by name, different."""
    lines = ["| vLLM request fields | total | identical (every value) | known difference | open | refused by name "
             "| different |", "|---|---|---|---|---|---|---|"]
    for endpoint, path in ENDPOINTS.items():
        kinds: dict[str, set[str]] = {}
        for v in verdicts:
            if v.case.endpoint == endpoint and not v.case.tag:
                kinds.setdefault(v.case.field, set()).add(v.kind)
        count = {k: sorted(f for f, ks in kinds.items() if _field_kind(ks) == k)
                 for k in ("identical", "known", "open", "refused", "different")}
        known = ", ".join(f"`{f}`: {'/'.join(sorted(kinds[f] - {'identical'}))}" for f in count["known"])
        served = len(kinds) - len(count["refused"])
        lines.append(f"| {path} | {len(kinds)} | {len(count['identical'])} of {served} served | "
                     f"{len(count['known'])}{f' ({known})' if known else ''} | {len(count['open'])} | "
                     f"{len(count['refused'])} | {len(count['different'])} |")
    return "\n".join(lines)


def _field_kind(kinds: set[str]) -> str:
    """One field's class from the verdicts of all its cases."""
    if "different" in kinds:
        return "different"
    if "open" in kinds:
        return "open"
    if kinds <= {"identical"}:
        return "identical"
    if "refused" in kinds and kinds <= {"refused", "identical"}:
        return "refused"
    return "known"


def report(verdicts: list[Verdict]) -> list[dict[str, Any]]:
    """Every verdict as JSON (``$PDSERVE_CONFORMANCE_REPORT``): for tables and before/after counts."""
    return [{"key": v.key, "endpoint": v.case.endpoint, "field": v.case.field, "value": repr(v.case.value)[:80],
             "stream": v.stream, "kind": v.kind, "detail": v.detail} for v in verdicts]


def table(verdicts: list[Verdict]) -> str:
    """Per endpoint: fields, and how many cases were identical / each known difference / different."""
    kinds = ["identical", *KNOWN, "open", "different"]
    lines = ["| endpoint | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for endpoint in ENDPOINTS:
        mine = [v for v in verdicts if v.case.endpoint == endpoint]
        lines.append(f"| {endpoint} | {len(mine)} | " + " | ".join(str(sum(v.kind == k for v in mine))
                                                                   for k in kinds) + " |")
    return "\n".join(lines)
