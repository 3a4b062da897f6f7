"""The fatal verdict's snapshot as a typed record, for the records that outlive the process.

The diagnosis (:class:`~trtllm_liveness.diagnose._diagnosis.Diagnosis`) is rich and imports the
diagnosis package; the outcome record (:mod:`._outcome`) and the termination message
(:mod:`._termination_log`) are written by the process's ending with the standard library only. A
:class:`FatalSnapshot` is what they carry of it: per rank its host, state, wait channel, CPU class,
iterations, where its stacks came from (or why none) and its main thread's innermost Python frames,
plus the rank the evidence names and what that naming rests on. It round-trips through its JSON
form (:meth:`FatalSnapshot.to_dict` / :meth:`FatalSnapshot.from_dict`), strictly checked.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from .._record_fields import JsonRecord

__all__ = ["FatalSnapshot", "RankSnapshot"]

MAIN_FRAMES = 8
"""Innermost Python frames of a rank's main thread kept in the record."""


@dataclass(frozen=True)
class RankSnapshot(JsonRecord):
    """One rank at the fatal verdict. ``state`` is its main thread's state letter (empty: gone or
    not seen), ``cpu`` its CPU class over the window (``spinning``, ``sleeping``, ``in-d``, ...),
    ``iterations`` its last reported executor iteration count (None: none reported),
    ``stacks`` the stack source (``py-spy``, ``faulthandler``) or why there are none, and
    ``main_frames`` its main thread's innermost Python frames (innermost first)."""

    rank: int
    pid: int
    hostname: str
    state: str
    wchan: str
    cpu: str
    iterations: int | None
    stacks: str
    main_frames: tuple[str, ...] = ()

    def describe(self) -> str:
        """``rank 1 (pid 42) on host a: T, wchan do_signal_stop, stopped, 17 iterations, stacks
        skipped-stopped``: one rank for the diagnosis line."""
        parts = [self.state or "-", f"wchan {self.wchan or '-'}", self.cpu,
                 f"{self.iterations} iterations" if self.iterations is not None else "iterations -",
                 f"stacks {self.stacks}"]
        where = f" in {self.main_frames[0]}" if self.main_frames else ""
        return f"rank {self.rank} (pid {self.pid}) on host {self.hostname or '?'}: {', '.join(parts)}{where}"


@dataclass(frozen=True)
class FatalSnapshot(JsonRecord):
    """Every rank at the fatal verdict (taken before the bounded stop signalled one): ``reason`` the
    verdict (``died of rank 1``), ``named`` the evidence that singles a rank out (empty: none does)
    and ``named_rank`` that rank, ``taken_at`` wall clock, ``elapsed_ms`` what the snapshot took."""

    reason: str
    taken_at: float
    elapsed_ms: float
    named: str
    ranks: tuple[RankSnapshot, ...]
    named_rank: int | None = None

    json_form = ("reason", "taken_at", "elapsed_ms", "named", "named_rank", "ranks")
    json_optional = ("named_rank",)
    json_round: ClassVar[Mapping[str, int]] = {"elapsed_ms": 1}  # written rounded to a tenth

    def rank(self, number: int) -> RankSnapshot | None:
        """The snapshot of rank ``number``, if it was seen."""
        return next((rank for rank in self.ranks if rank.rank == number), None)

    def summary(self) -> str:
        """One line: every rank (:meth:`RankSnapshot.describe`), then the naming."""
        line = "; ".join(rank.describe() for rank in self.ranks) or "no rank seen"
        return line + (f"; named: {self.named}" if self.named else "")

    def to_json(self, limit: int) -> str:
        """The compact JSON form if it fits in ``limit`` bytes; otherwise the same without the
        ranks' frames, and if even that does not fit, without ranks past the first that fit (the
        JSON stays whole, never cut)."""
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if len(text.encode()) <= limit:
            return text
        ranks = [dataclasses.replace(rank, main_frames=()) for rank in self.ranks]
        while True:
            text = json.dumps(dataclasses.replace(self, ranks=tuple(ranks)).to_dict(), separators=(",", ":"))
            if len(text.encode()) <= limit or not ranks:
                return text
            ranks.pop()
