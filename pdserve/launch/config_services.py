"""The launcher's settings for the processes beside the workers: the KV pool (master and node) and the supervisor
that restarts whatever exits (:mod:`.supervisor`). Checks of :class:`~pdserve.launch.config.LauncherConfig`."""

from __future__ import annotations

from ..settings import ConfigError
from .config_shapes import LaunchShape


def check_pool(cfg: LaunchShape) -> None:
    """KV pool settings (pdserve.store): sizes parse (``pool`` itself is resolved by the config)."""
    from ..store.config import StoreConfigError, parse_size

    if cfg.pool and cfg.pool_backend == "pdserve" and cfg.kv_connector != "pdserve":
        raise ConfigError(f"pool=true with kv_connector={cfg.kv_connector!r}: pdserve's KV pool saves and loads "
                          f"through pdserve's connector; use --pool-backend mooncake (Mooncake Store) or --no-pool "
                          f"with --kv-connector {cfg.kv_connector}")
    if cfg.pool_backend == "mooncake" and cfg.kv_connector == "pdserve":
        raise ConfigError("pool_backend=mooncake with kv_connector='pdserve': pdserve's connector has its own pool; "
                          "use --kv-connector nixl or mooncake with Mooncake Store, or --pool-backend pdserve")
    if cfg.pool and not cfg.connector:
        raise ConfigError("pool=true needs the connector (it saves and loads KV through it): add --connector, "
                          "or pool=false")
    try:
        mem, disk = parse_size(cfg.pool_mem, "pool_mem"), parse_size(cfg.pool_disk, "pool_disk")
    except StoreConfigError as e:
        raise ConfigError(str(e)) from None
    if cfg.pool and mem < 1 << 20:
        raise ConfigError(f"pool_mem={cfg.pool_mem!r}: lend the pool at least 1MiB (e.g. 1GiB), or pool=false")
    if disk < 0:
        raise ConfigError(f"pool_disk={cfg.pool_disk!r}: a size >= 0 (0 = no SSD tier)")
    if cfg.pool and "pool_master" in cfg.connector_extra:
        raise ConfigError("connector_extra.pool_master is set by the launcher when pool=true; set pool=false to "
                          "point workers at a pool of your own")


def check_supervision(cfg: LaunchShape) -> None:
    """Restart settings of the launcher's supervisor (pdserve/launch/supervisor.py): each value is checked by
    the table; here, the rule between two of them."""
    if cfg.restart_backoff_max_s < cfg.restart_backoff_s:
        raise ConfigError(f"restart_backoff_max_s={cfg.restart_backoff_max_s:g} is below restart_backoff_s="
                          f"{cfg.restart_backoff_s:g}: the cap must be at least the first wait (defaults 30 and 1)")
