"""The Placement Controller's settings (:class:`ControllerConfig`): the ``[controller]`` section of ``kvsp-quic
index``'s file, as is (kvsp_app/config.py reads it once and hands it to
:class:`~kvsp_quic.roles.controller.PlacementController`, which re-exports it). No I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvsp_quic.roles.placement import PLACEMENT_POLICIES
from kvsp_quic.roles.status import SleepMode, SleepPolicy


@dataclass(frozen=True)
class ControllerConfig:
    """The Placement Controller's settings: the ``[controller]`` section of ``kvsp-quic index``'s file, as is.
    Durations are milliseconds; the asyncio adapter reads the ones it needs in seconds (``*_s``)."""

    start_hook: list[str] = field(default_factory=list)  # argv of a command that starts an instance; [] = none
    start_timeout_ms: int = 60_000  # how long a request waits for an instance the start hook starts
    start_interval_ms: int = 10_000  # at most one start hook run per interval
    max_cost_us: float | None = None  # above it a placement looks for more capacity (wake, start hook)
    prefetch_deadline_ms: int = 1000  # of the directives sent before a session starts
    prefetch_lease_ms: int = 5000
    request_timeout_ms: int = 10_000  # of each request to an instance
    tick_ms: int = 100  # failure checks: this often with a shared store or while migrations wait, else at expiries
    session_ttl_ms: int = 3_600_000  # a session without a checkpoint for this long is forgotten
    done_ttl_ms: int = 600_000  # a finished session stays readable for this long
    max_sessions: int = 100_000
    reshard_deadline_ms: int = 5000  # default deadline_ms of reshard plans
    lease_ms: int = 3000  # with a shared store: a replica placing a session holds it this long, renewed
    suspect_probe_ms: int = 300  # a suspect report's probe of the instance: no answer within it = the run failed
    suspect_wait_ms: int = 10_000  # how long a suspect report's answer waits for the session's new instance
    # Admission (issue 13; kvsp_quic.roles.controller_admission): per principal, beyond either limit 429 with
    # Retry-After = client_retry_ms rounded up to whole seconds.
    client_max_sessions: int = 1000  # sessions one principal owns that are not done, per replica
    client_max_in_flight: int = 64  # one principal's POST sessions being placed at once, per replica
    client_retry_ms: int = 1000  # what a refused client is told to wait
    placement_policy: str = "cost"  # a name in kvsp_quic.roles.placement.PLACEMENT_POLICIES
    sleep: Literal["load", "always", "never"] = "load"  # the policy for requested_state: sleeping (SleepPolicy)
    sleep_min_active: int = 1  # other active instances that must remain
    sleep_min_spare: int = 1  # spare batch slots the others must have beyond the requester's load
    sleep_max_kv_utilization: float = 0.9  # others fuller than this have no spare capacity

    def __post_init__(self) -> None:
        for name in ("prefetch_deadline_ms", "prefetch_lease_ms", "start_timeout_ms", "start_interval_ms",
                     "request_timeout_ms", "tick_ms", "session_ttl_ms", "done_ttl_ms", "max_sessions",
                     "reshard_deadline_ms", "lease_ms", "suspect_probe_ms", "suspect_wait_ms",
                     "client_max_sessions", "client_max_in_flight", "client_retry_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")
        if self.max_cost_us is not None and self.max_cost_us <= 0:
            raise ValueError("max_cost_us: must be positive")
        if self.placement_policy not in PLACEMENT_POLICIES:
            raise ValueError(f"placement_policy: unknown placement policy {self.placement_policy!r} "
                             f"(known: {', '.join(sorted(PLACEMENT_POLICIES))})")
        if self.sleep not in ("load", "always", "never"):
            raise ValueError(f"sleep: must be one of 'load', 'always', 'never', got {self.sleep!r}")
        for name in ("sleep_min_active", "sleep_min_spare"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative")
        if not 0.0 <= self.sleep_max_kv_utilization <= 1.0:
            raise ValueError("sleep_max_kv_utilization: must be in [0, 1]")

    @property
    def sleep_policy(self) -> SleepPolicy:
        """The policy that decides sleep requests (for the status table's :class:`LifecyclePolicy`)."""
        return SleepPolicy(SleepMode(self.sleep), self.sleep_min_active, self.sleep_min_spare,
                           self.sleep_max_kv_utilization)

    @property
    def request_timeout_s(self) -> float:
        return self.request_timeout_ms / 1000

    @property
    def tick_s(self) -> float:
        return self.tick_ms / 1000

    @property
    def client_retry_after_s(self) -> int:
        """``Retry-After`` of an admission refused by a per-client limit: ``client_retry_ms`` in whole seconds,
        rounded up."""
        return -(-self.client_retry_ms // 1000)


__all__ = ["ControllerConfig"]
