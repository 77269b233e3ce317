"""The LoRA adapter list shared by the router replicas of one host: the ``lora_adapters`` section (name -> path) of
their shared file (:mod:`.shared_file`), next to the workers.

The list's one owner in each replica stays its :class:`~..api.lora.ModelCatalog`: a load or unload made through
one replica (which reaches every worker) is written into the section, and every replica brings its catalog to the
section at its next poll (0.5 s), so every replica lists a runtime-loaded adapter and routes ``model=<adapter>``
to the workers that have it. A replica that starts (or restarts) with the section present takes it rather than
its ``--lora-modules``; the first replica of a launch creates it from its own list.
"""

from __future__ import annotations

import logging

from ..api.model_catalog import ModelCatalog
from .shared_file import Section, SectionFollower, SharedFile

log = logging.getLogger("pdserve.router.fleet.membership")


class AdapterFile(SectionFollower):
    """One replica's side of the ``lora_adapters`` section: its catalog follows it, its changes go into it."""

    key = "lora_adapters"

    def __init__(self, file: SharedFile, catalog: ModelCatalog) -> None:
        super().__init__(file)
        self.catalog = catalog
        catalog.changed = self.changed

    def mine(self) -> Section:
        return dict(self.catalog.adapters)

    def changed(self, name: str, path: str | None) -> None:
        """This replica loaded (``path``) or unloaded (None) adapter ``name``: write it into the section."""
        def change(adapters: Section) -> None:
            if path is None:
                adapters.pop(name, None)
            else:
                adapters[name] = path
        self.write(change)

    def apply(self, section: Section) -> None:
        adapters = {k: v for k, v in section.items() if isinstance(k, str) and isinstance(v, str)}
        if adapters != self.catalog.adapters:
            log.info("LoRA adapters now %s (shared with the other replicas)", ", ".join(sorted(adapters)) or "none")
            self.catalog.replace(adapters)
