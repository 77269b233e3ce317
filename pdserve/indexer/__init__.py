"""The KV indexer service (issue 39): which worker holds which KV block, in which tier, for every router replica.

Modules: table (the tiered index, placeholders and lookups), placeholders (fresh placements' bounded entries),
snapshot (the file and its resume points), service (the one owner of the feed, the pool follower and the
snapshots), app (the HTTP API, Mooncake's where it defines one), __main__ (``pdserve indexer``). docs/indexer.md.
"""
