"""The view of the fleet: worker clients and probes, the registry and membership, placement and tickets, KV events."""
