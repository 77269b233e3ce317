"""Compatibility name for :mod:`pdserve.launch`: the plan (:mod:`pdserve.launch.plan`) and the cluster that runs
it (:mod:`pdserve.launch.cluster`). Tests, benchmarks and scripts import :class:`Cluster` from here."""

from . import launch as _launch
from .launch import *  # noqa: F403  (the same names, listed once in pdserve.launch.__all__)

__all__ = _launch.__all__
