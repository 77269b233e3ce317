"""The indexer's workers from DNS (the chart's indexer pod): each ready pod of a pool is followed at
tcp://<IP>:<kv events port> (replay on the next port) under the URL its vLLM publishes as topic; one gone from DNS
for two rounds is unregistered, a DNS failure changes nothing; a worker resumed from a snapshot or registered
by hand leaves when no pool resolves it."""

from __future__ import annotations

import asyncio

from pdserve.indexer.discovery import FeedMembership
from pdserve.indexer.service import IndexerConfig, IndexerService
from pdserve.kube.dns_follow import follow_dns, pools
from pdserve.router.fleet.kv_events import Publisher


async def _no_replay(*args, **kwargs):  # the workers' replay endpoints are not there: nothing to catch up
    return []


def test_dns_pools_are_followed_and_left():
    answers: dict[str, set[str] | None] = {"p.svc": {"10.0.0.5", "10.0.0.6"}, "d.svc": {"10.0.0.7"}}

    async def main() -> None:
        svc = IndexerService(IndexerConfig(block_size=16), replayer=_no_replay)
        await svc.start()
        svc.register("http://10.0.0.9:8000", Publisher("tcp://10.0.0.9:5557", ""))  # by hand, in no pool
        members = FeedMembership(svc, 5557, ("prefill", "decode"))
        task = asyncio.create_task(follow_dns(members, pools("p.svc:8000", "d.svc:8001"), 0.01,
                                              lambda h, p: answers[h]))
        try:
            await asyncio.sleep(0.1)
            assert svc.feed is not None
            pubs = {w: st.publisher for w, st in svc.feed.streams.items()}
            assert pubs == {"http://10.0.0.5:8000": Publisher("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
                            "http://10.0.0.6:8000": Publisher("tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558"),
                            "http://10.0.0.7:8001": Publisher("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")}
            answers["d.svc"] = None  # DNS failing: nobody leaves
            answers["p.svc"] = {"10.0.0.5"}  # 10.0.0.6 scaled away: unregistered after two rounds
            await asyncio.sleep(0.1)
            assert sorted(svc.followed()) == ["http://10.0.0.5:8000", "http://10.0.0.7:8001"]
            assert members.list_workers()["http://10.0.0.7:8001"] == {"decode"}
        finally:
            task.cancel()
            await svc.close(final_snapshot=False)

    asyncio.run(main())


def test_indexer_cli_takes_the_dns_flags():
    from pdserve.indexer.__main__ import build_parser, config_from
    from pdserve.settings.errors import ConfigError

    cfg, host, port = config_from(build_parser().parse_args(
        ["--prefill-dns", "p.svc:8000", "--decode-dns", "d.svc:8000", "--kv-events-port", "5557",
         "--indexer-host", "0.0.0.0", "--discovery-interval-s", "2"]))
    assert [(t.role, t.host, t.port) for t in cfg.dns] == [("prefill", "p.svc", 8000), ("decode", "d.svc", 8000)]
    assert (cfg.kv_events_port, cfg.discovery_interval_s, host, port) == (5557, 2.0, "0.0.0.0", 8100)
    try:
        config_from(build_parser().parse_args(["--prefill-dns", "p.svc:8000"]))
    except ConfigError as e:
        assert "--kv-events-port" in str(e)
    else:
        raise AssertionError("--prefill-dns without --kv-events-port was accepted")
