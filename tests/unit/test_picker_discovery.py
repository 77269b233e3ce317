"""The picker's DNS membership (--prefill-dns / --decode-dns): ready addresses join its registry with their
role, one gone from DNS for two rounds leaves, a DNS failure changes nothing; a bad NAME:PORT is refused with
the fix."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.kube.discovery import DiscoveryConfigError
from pdserve.picker.discovery import RegistryMembership, follow_dns, pools
from pdserve.router.fleet.registry import WorkerRegistry


def test_dns_membership_follows_the_pools():
    answers = {"p.svc": {"10.0.0.5", "10.0.0.6"}, "d.svc": {"10.0.0.7"}}

    def resolver(host: str, port: int) -> set[str] | None:
        return answers[host]

    async def main() -> None:
        reg = WorkerRegistry()
        task = asyncio.create_task(follow_dns(RegistryMembership(reg), pools("p.svc:8000", "d.svc:8001"), 0.01, resolver))
        await asyncio.sleep(0.05)
        assert {w.url: w.roles for w in reg} == {"http://10.0.0.5:8000": {"prefill"},
                                                 "http://10.0.0.6:8000": {"prefill"},
                                                 "http://10.0.0.7:8001": {"decode"}}
        answers["d.svc"] = None  # DNS failing: nobody leaves
        answers["p.svc"] = {"10.0.0.5"}  # 10.0.0.6 scaled away: leaves after two rounds
        await asyncio.sleep(0.1)
        assert sorted(w.url for w in reg) == ["http://10.0.0.5:8000", "http://10.0.0.7:8001"]
        task.cancel()

    asyncio.run(main())


def test_a_pool_spec_must_be_name_and_port():
    assert pools("", "") == ()
    with pytest.raises(DiscoveryConfigError, match="NAME:PORT"):
        pools("pd-pdserve-prefill", "")
