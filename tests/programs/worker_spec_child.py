"""Child program for the worker-spec tests: every rank of a real ``mpirun`` job runs the rank entry
with a worker spec the test names, as a rank of an engine's session does.

Usage: ``mpirun -n N python -m tests.programs.worker_spec_child '{"case": CASE}'`` (the tests run it
through ``tests.programs.mpirun_exec``). Every rank builds the same spec, breaks it as ``CASE`` says
(the way a record unpickled from another version of the package can be broken: unpickling runs no
checks), sends it through pickle as MPI does and calls
:func:`~trtllm_liveness.integrations.trtllm._worker_entry.liveness_worker_entry` with upstream's
argument (a tag). The task is an ``allgather`` over ``COMM_WORLD``: it returns only when every rank
reached it, so a rank that entered another collective first (the agents' placement gather) or
stopped would leave the others waiting. Cases:

- ``good``: the spec as the proxy builds it (no optional part): the task runs;
- ``bad_hub``: the hub settings carry a 5-byte secret: each rank rejects the spec, logs one ERROR and
  runs the task without liveness;
- ``no_task``: the task is None: each rank rejects the spec and the entry raises its error.

Each rank prints one JSON line: ``{"rank": r, "result": [...]}`` or ``{"rank": r, "error": "..."}``,
then ends normally.
"""

from __future__ import annotations

import json
import logging
import pickle
import sys
from typing import Any

from trtllm_liveness.integrations.trtllm._worker_entry import liveness_worker_entry
from trtllm_liveness.integrations.trtllm._worker_spec import SPEC_KWARG, WorkerSpec
from trtllm_liveness.multihost._agent import AgentSettings


def gather_tags(tag: str) -> list[str]:
    """Upstream's task in this program: a collective every rank must reach."""
    from mpi4py import MPI

    result: list[str] = MPI.COMM_WORLD.allgather(tag)
    return result


def spec_for(case: str) -> WorkerSpec:
    if case == "good":
        return WorkerSpec(gather_tags)
    settings = AgentSettings("tcp://127.0.0.1:1", b"s" * 32, 1.0, None)
    spec = WorkerSpec(gather_tags, hub=settings)
    if case == "bad_hub":
        object.__setattr__(settings, "secret", b"short")
    elif case == "no_task":
        object.__setattr__(spec, "fn", None)
    else:
        raise SystemExit(f"unknown case {case!r}")
    return spec


def main(options: dict[str, Any]) -> None:
    from mpi4py import MPI

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    rank = MPI.COMM_WORLD.Get_rank()
    wire = pickle.loads(pickle.dumps(spec_for(str(options["case"]))))
    try:
        record: dict[str, Any] = {"rank": rank, "result": liveness_worker_entry(f"tag{rank}", **{SPEC_KWARG: wire})}
    except Exception as exc:
        record = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
