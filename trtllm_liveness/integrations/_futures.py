"""The worker futures as the extension handles them: mirrored, and failed when the world is dead.

Upstream waits on its MPI worker futures without a timeout (1.2.x's start-up loop and
``shutdown()``), so once the workers are dead or wedged the extension must complete them. It must
never complete mpi4py's own futures: mpi4py's manager thread calls ``set_result`` on a future when
its task returns and dies with ``InvalidStateError`` if somebody else finished it first. So
upstream is handed mirrors, and only those are failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError
from typing import Any


def mirror_future(real: Future[Any]) -> Future[Any]:
    """A future that completes as ``real`` does, unless the extension completed it first.

    Cancelling the mirror cancels ``real`` (mpi4py can withdraw a task still queued)."""
    mirror: Future[Any] = Future()

    def copy(done: Future[Any]) -> None:
        with contextlib.suppress(InvalidStateError):
            if done.cancelled():
                mirror.cancel()
            elif (error := done.exception()) is not None:
                mirror.set_exception(error)
            else:
                mirror.set_result(done.result(timeout=0))  # done: returns at once

    def forward_cancel(done: Future[Any]) -> None:
        if done.cancelled():
            real.cancel()

    real.add_done_callback(copy)
    mirror.add_done_callback(forward_cancel)
    return mirror


def fail_pending(futures: Iterable[Any], error: BaseException) -> None:
    """Set ``error`` on every future in ``futures`` not done yet (others are skipped)."""
    for future in futures:
        if isinstance(future, Future) and not future.done():
            with contextlib.suppress(InvalidStateError):  # finished meanwhile
                future.set_exception(error)
