"""What ``--kv-checksum`` covers in a launch, said in one line at start-up and in ``--dry-run``.

pdserve's connector checksums every KV block it moves (P -> D reads at any TP pairing, its KV pool's objects in
memory and on disk: docs/architecture.md section 4, "KV integrity"). vLLM 0.32's own data planes (NixlConnector,
MooncakeConnector, and Mooncake Store through MooncakeStoreConnector) move KV blocks with no checksum (a
compatibility hash at the handshake only), and pdserve does not wrap them, so with ``--kv-connector nixl`` /
``mooncake`` or ``--pool-backend mooncake`` the setting cannot apply: the launch says so rather than drop it."""

from __future__ import annotations

from .config import LauncherConfig

PLANES = {"nixl": "vLLM's NixlConnector", "mooncake": "vLLM's MooncakeConnector"}


def checksums_on(config: LauncherConfig) -> bool:
    """Whether the workers are asked to checksum (``--kv-checksum`` and no ``kv_checksum: false`` extra)."""
    return bool(config.kv_checksum) and config.connector_extra.get("kv_checksum", True) is not False


def checksum_note(config: LauncherConfig) -> str:
    """One line: which of this launch's KV planes verify the blocks they move, and which do not."""
    if not config.connector:
        return "kv checksum: no KV crosses a process (no connector)"
    if not checksums_on(config):
        return "kv checksum: off (--no-kv-checksum): KV blocks cross processes unverified"
    if config.kv_connector == "pdserve":
        pool = " and every KV pool object (memory and disk tiers)" if config.pool else ""
        return f"kv checksum: on: every P -> D read (any TP degrees){pool} is verified before vLLM uses it"
    planes = PLANES.get(config.kv_connector, config.kv_connector)
    if config.pool and config.pool_backend == "mooncake":
        planes += " and Mooncake Store"
    return (f"kv checksum: NOT applied: {planes} move KV blocks unverified (vLLM 0.32 checks a compatibility hash "
            "at the handshake, no checksum of the bytes); --kv-checksum covers pdserve's connector and pool only "
            "(--kv-connector pdserve)")
