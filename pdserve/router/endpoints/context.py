"""What the endpoints are given of the router: its parts, built and started by the app (``app.py``). Each endpoint
module of this package has ``add_routes(app, ctx)`` and takes what it needs from here."""

from __future__ import annotations

from dataclasses import dataclass

from ..api.model_catalog import ModelCatalog
from ..api.tokenizer import PromptTokenizer
from ..config import RouterConfig
from ..fleet.calibration import Calibration
from ..fleet.health_monitor import HealthMonitor
from ..fleet.kv_feeds import KVFeeds
from ..fleet.placement import Placement
from ..fleet.registry import WorkerRegistry
from ..fleet.shared_membership import MembershipFile
from ..metrics import RouterMetrics
from ..workers.session import WorkerSession
from .intake import Intake


@dataclass(frozen=True)
class RouterContext:
    config: RouterConfig
    tokenizer: PromptTokenizer
    metrics: RouterMetrics
    models: ModelCatalog  # the served model and its LoRA adapters
    registry: WorkerRegistry  # the one owner of membership and health
    placement: Placement
    workers: WorkerSession  # the HTTP session to the workers
    intake: Intake  # the front door every generation endpoint goes through
    health: HealthMonitor
    calibration: Calibration
    kv: KVFeeds  # the workers' KV event publishers
    shared: MembershipFile | None  # run-time membership shared with the other replicas
