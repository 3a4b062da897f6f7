"""What a remote host's silence means: suspect, lost, or heard again (the hub's rule).

Silence alone proves nothing (docs/multihost.md, "Silence is one signal, never a verdict", gives
the rule, its table the cases). :class:`SilenceRule`, read by the hub's thread for each connection
when a decision may be due, makes a host whose agent sent nothing for the heartbeat timeout
**suspect** and **lost** only with a second signal (:meth:`SilenceRule.lost_because`): the
engine's own progress (:class:`~trtllm_liveness.monitor._progress_clock.ProgressClock`) stopped
for the timeout with requests pending (longer where the engine's recent steps were long:
:meth:`~trtllm_liveness.monitor._progress_clock.ProgressClock.quiet_bound`) and the host went silent
no later than :data:`ONSET_SHARE` of the timeout (or 1.5 long steps) after the engine's last
progress; a host that went silent later than that, once the engine had stopped, is lost only after
:data:`LATE_SILENCE_TIMEOUTS` timeouts of silence; or the ceiling of silence passed while the engine
showed no progress (an idle engine). Heard again, the host is
connected as before. A connection without a session is cut after the ceiling. Guarded by the
hub's lock (its thread calls in with it held).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from .._events import WorkerState
from ..monitor._progress_clock import ProgressClock
from ._hub_records import Session, Update
from ._tcp import Ending, Silence

__all__ = ["LATE_SILENCE_TIMEOUTS", "ONSET_SHARE", "SilenceRule"]

logger = logging.getLogger(__name__.rpartition(".")[0] + "._hub")

Apply = Callable[[list[Update]], None]
Lose = Callable[[Session, Ending, float, str], None]

ONSET_SHARE = 0.25
"""A host lost at the timeout because the engine stopped must have gone silent no later than this
share of the heartbeat timeout after the engine's last progress (or 1.5 of its longest recent step,
where that is longer). A host that dies stops every step at once, its last heartbeat before that;
a host that goes silent once another fault has already stopped the engine may not be why it
stopped (a heartbeat missed on a loaded machine while another host's rank stalls)."""

LATE_SILENCE_TIMEOUTS = 5
"""A host that went silent after the engine had stopped is lost after this many heartbeat timeouts
of silence: longer than a heartbeat missed on a loaded machine, far shorter than the ceiling for a
host that died inside an unusually long step, or after its own ranks had hung."""


class SilenceRule:
    """The hub's reading of its hosts' silences; see the module docstring."""

    def __init__(self, timeout_s: float, ceiling_s: float, progress: ProgressClock | None) -> None:
        self.timeout_s = timeout_s
        self.ceiling_s = max(ceiling_s, timeout_s)
        self.progress = progress
        self.suspect_episodes = 0  # how many times a host became suspect (benchmarks read it)

    def engine_stalled(self, now: float | None = None) -> bool:
        """Whether the engine made no progress for the timeout with requests pending: the moment a
        silent host's verdict is due."""
        progress = self.progress
        quiet = progress.quiet_s(now) if progress is not None else None
        return progress is not None and quiet is not None and quiet >= progress.quiet_bound(self.timeout_s, now)

    def stall_due(self) -> float | None:
        """When the engine's progress would have stopped for the timeout (monotonic), if requests
        are pending and no progress comes before; None while idle (or without a progress clock)."""
        progress = self.progress
        if progress is None or progress.pending() <= 0:
            return None
        return progress.last_progress() + progress.quiet_bound(self.timeout_s)

    def check_locked(self, silences: Iterable[Silence], session_of: Callable[[Silence], Session | None],
                     apply: Apply, lose: Lose, cut: Callable[[Silence], None]) -> float:
        """Judge each connection's ``silence`` (``session_of`` it: None when none is connected):
        suspect, heard again, or lost (``lose`` it, then ``cut`` the connection); ``apply`` sets its
        ranks' states. Returns how soon the next decision may be due, in seconds."""
        timeout = self.timeout_s
        quiet = self.progress.quiet_s() if self.progress is not None else None
        next_s = timeout
        for silence in silences:
            session = session_of(silence)
            if session is None:
                if silence.seconds >= self.ceiling_s:
                    cut(silence)
                else:
                    next_s = min(next_s, self.ceiling_s - silence.seconds)
                continue
            if silence.seconds < timeout:
                if session.suspect_since is not None:
                    self._heard_again(session, silence.seconds, apply)
                next_s = min(next_s, timeout - silence.seconds)
                continue
            if session.suspect_since is None:
                self._suspect(session, silence.seconds, silence.mute, apply)
            elif not session.suspect_warned and silence.seconds >= 2 * timeout:
                session.suspect_warned = True
                logger.warning("liveness: %s", self.suspect_text(session, silence.seconds, silence.mute, quiet))
            why = self.lost_because(silence.seconds, quiet)
            if why is None:
                next_s = min(next_s, self.recheck_s(silence.seconds, quiet))
                continue
            lose(session, Ending.MUTE if silence.mute else Ending.SILENT, silence.seconds, why)
            cut(silence)
        return max(0.005, next_s)

    def lost_because(self, silence_s: float, quiet_s: float | None) -> str | None:
        """The second signal that makes a silent host lost, in words, or None while it stays
        suspect (``quiet_s``: the engine's seconds without progress with requests pending; None
        while idle; ``quiet_s - silence_s``: how long after the engine's last progress the host
        went silent)."""
        timeout = self.timeout_s
        progress = self.progress
        needed = progress.quiet_bound(timeout) if progress is not None else timeout
        if progress is not None and quiet_s is not None and quiet_s >= needed and progress.iterations_seen:
            late = self._late_onset(silence_s, quiet_s)
            if late is None or silence_s >= LATE_SILENCE_TIMEOUTS * timeout:
                why = (": every step needs every rank" if late is None else
                       f"; the host went silent {late:.2f} s after the engine stopped, so its silence had to "
                       f"last {LATE_SILENCE_TIMEOUTS} heartbeat timeouts")
                return (f"and no progress of the engine (output, executor iterations) for {quiet_s:.2f} s with "
                        f"{progress.pending()} request(s) pending{why}")
        if silence_s >= self.ceiling_s and (quiet_s is None or quiet_s >= needed):
            shown = "the engine idle" if quiet_s is None else f"no engine progress for {quiet_s:.2f} s"
            return f"beyond heartbeat_ceiling_s ({self.ceiling_s:g} s), {shown}"
        return None

    def _late_onset(self, silence_s: float, quiet_s: float | None) -> float | None:
        """How long after the engine's last progress the host went silent, where that is later
        than :data:`ONSET_SHARE` of the timeout (or 1.5 long steps) on an engine that reports
        iterations; None otherwise (idle, no iterations, or a silence that began with the stop)."""
        progress = self.progress
        if progress is None or quiet_s is None or not progress.iterations_seen:
            return None
        onset = quiet_s - silence_s
        return onset if onset > progress.quiet_bound(self.timeout_s * ONSET_SHARE) else None

    def recheck_s(self, silence_s: float, quiet_s: float | None) -> float:
        """How soon a suspect host's verdict may change: when the engine's quiet reaches the
        timeout, when a late silence's bound or the ceiling passes, and at least every half timeout
        (requests may arrive)."""
        due = [self.timeout_s / 2, self.ceiling_s - silence_s]
        if quiet_s is not None:
            needed = self.progress.quiet_bound(self.timeout_s) if self.progress is not None else self.timeout_s
            late_bound = LATE_SILENCE_TIMEOUTS * self.timeout_s
            # Reached already, the quiet decided nothing (no iterations, or a silence that began
            # late): no reason to look sooner than the other bounds.
            if quiet_s < needed:
                due.append(needed - quiet_s)
            elif silence_s < late_bound and self._late_onset(silence_s, quiet_s) is not None:
                due.append(late_bound - silence_s)
        return max(0.005, min(due))

    def suspect_text(self, session: Session, silence_s: float, mute: bool, quiet_s: float | None = None) -> str:
        why = "its host still acknowledges: its process is silent" if mute else "host or process silent"
        head = (f"host {session.host}'s agent (rank {session.agent.rank}, pid {session.agent.pid}) sent nothing for "
                f"{silence_s:.2f} s ({why}); host {session.host} is suspect. ")
        late = self._late_onset(silence_s, quiet_s)
        if late is not None and self.progress is not None:
            # Lost once silent for the late bound and quiet for the quiet bound (long steps raise it).
            silent_s = max(LATE_SILENCE_TIMEOUTS * self.timeout_s, self.progress.quiet_bound(self.timeout_s) - late)
            return (head + f"The engine had made no progress for {late:.2f} s when the host went "
                    f"silent (another fault may have stopped it); the host is lost after "
                    f"{min(silent_s, self.ceiling_s):.3g} s without contact")
        return (head + f"The engine keeps serving while it makes progress; the host is lost if progress stops "
                f"with requests pending, or after {self.ceiling_s:g} s without contact")

    def _suspect(self, session: Session, silence_s: float, mute: bool, apply: Apply) -> None:
        session.suspect_since = time.monotonic() - silence_s
        session.suspect_warned = False
        self.suspect_episodes += 1
        detail = (f"suspect: no heartbeat from host {session.host}'s agent for {silence_s:.2f} s"
                  f"{' (its process silent, its host acknowledging)' if mute else ''}; the engine's progress decides")
        apply(session.updates(WorkerState.SUSPECT, detail))

    def _heard_again(self, session: Session, silence_s: float, apply: Apply) -> None:
        since = session.suspect_since if session.suspect_since is not None else time.monotonic()
        session.suspect_since = None
        logger.info("liveness: host %s's agent heard again after %.2f s without contact (it was suspect)",
                    session.host, time.monotonic() - since - silence_s)
        apply(session.updates(WorkerState.ALIVE))
