"""The test suite's stand-in for upstream's ``trtllm-llmapi-launch``: ``mpirun ... python -m
tests.programs.fake_llmapi_launch COMMAND [ARGS...]``.

Upstream's launcher (``tensorrt_llm/llmapi/trtllm-llmapi-launch``) runs COMMAND on rank 0 and makes
every other rank an MPI worker of the session COMMAND's ``LLM`` opens. The fakes (tests/fakes) have
no such script, so here rank 0 becomes COMMAND itself (``exec``: the proxy is rank 0 of
``COMM_WORLD``, whose ``MpiCommSession`` the test passes in, ``tests.support.drill_engine:
comm_session``) and every other rank serves that session's tasks (the fake's ``serve_comm_workers``,
upstream's worker-node entry). Differences from upstream: upstream's rank 0 runs COMMAND as a child
without the MPI environment, next to a leader process that serves a ``RemoteMpiCommSessionClient``;
here COMMAND is rank 0 and its session an ``MpiCommSession``.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: fake_llmapi_launch COMMAND [ARGS...]")
    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
        os.execvp(argv[0], argv)
    # The executor package first: the fake's llmapi.mpi_session imported on its own is a circular import.
    import tensorrt_llm.executor  # type: ignore[import-not-found]  # noqa: F401
    from tensorrt_llm.llmapi.mpi_session import serve_comm_workers  # type: ignore[import-not-found]

    serve_comm_workers()
    os._exit(0)  # the session is over: no MPI finalize to hang on a peer that died


if __name__ == "__main__":
    main(sys.argv[1:])
