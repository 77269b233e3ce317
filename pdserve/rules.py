"""Config rules shared by the launcher, the router and the conductor: one check and one message per rule.

:class:`pdserve.config.LauncherConfig`, :class:`pdserve.router.config.RouterConfig` and
:class:`pdserve.conductor.config.ConductorConfig` each validate the placement policy, the SLO targets and the
decode-local threshold. They name the setting their own way (``policy``, ``--policy``; ``ttft_slo_ms``,
``ttft_slo_s``) and raise their own error class, so every check takes the ``label`` to print and the ``error``
to raise; the rule and the advice are written once, here.
"""

from __future__ import annotations

from typing import Any

POLICIES = ("round_robin", "least_loaded", "conductor")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_policy(policy: Any, label: str = "policy", error: type[Exception] = ValueError) -> None:
    """``policy`` is one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise error(f"{label}={policy!r}: choose one of {', '.join(POLICIES)} (conductor: prefix-, load- and "
                    "SLO-aware placement; the others are baselines)")


def check_slo(value: Any, label: str, unit: str = "ms", error: type[Exception] = ValueError) -> None:
    """An SLO target (TTFT or TPOT): a number > 0 in ``unit``, or None for no target."""
    if value is not None and (not _is_number(value) or not value > 0):
        raise error(f"{label}={value!r}: a target in {unit} > 0, or unset for none (requests predicted to miss "
                    "it get 429 + Retry-After)")


def check_slo_needs_conductor(value: Any, label: str, policy: str, error: type[Exception] = ValueError) -> None:
    """A target is only meaningful with the conductor policy (the baselines neither predict nor reject)."""
    if value is not None and policy != "conductor":
        raise error(f"{label} needs policy=conductor (only the conductor predicts and rejects); policy is {policy!r}")


def check_local_prefill_tokens(value: Any, label: str = "local_prefill_tokens",
                               error: type[Exception] = ValueError) -> None:
    """The decode-local threshold: an integer >= 0 (0 never runs a request decode-local), or None to learn it."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise error(f"{label}={value!r}: use an integer >= 0 (0 never runs a request decode-local), or leave it "
                    "unset to let the conductor learn the threshold")
