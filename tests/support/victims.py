"""Whether an error a scenario reported names the rank its fault hit, as the package names one:
``rank R (pid P)``."""

from __future__ import annotations

from trtllm_liveness.demo._scenario_records import ScenarioResult, Victim

__all__ = ["named_in", "names_a_victim"]


def named_in(victim: Victim, text: str | None) -> bool:
    """Whether ``text`` (a fatal or init error) names ``victim``'s rank and pid as the package does."""
    return bool(text) and f"rank {victim.rank} (pid {victim.pid})" in str(text)


def names_a_victim(result: ScenarioResult, text: str | None) -> bool:
    """Whether ``text`` names one of ``result``'s victims by rank and pid."""
    return any(named_in(v, text) for v in result.victims)
