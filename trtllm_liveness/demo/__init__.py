"""Reference executor: TensorRT-LLM's proxy/worker protocol over real ``mpi4py.futures`` workers.

Runs end to end without a GPU, so the liveness integration can be exercised and demonstrated for
real. Needs the ``mpi`` extra (mpi4py, the Open MPI wheel, pyzmq). See :mod:`._executor_proxy` for
how it mirrors upstream 1.2.x and main, and where it departs.

Real faults for the demo, the tests and the benchmarks: :mod:`._cgroup_faults` (freezer, memory and cpu
cgroups) and :mod:`._fuse_stall` (a FUSE mount whose requests are held: real ``D`` without cgroup
v1; its protocol server is :mod:`._fuse_server`, its mounts and their clean-up :mod:`._fuse_mounts`).
The healthy look-alike of a wedge: :mod:`._fuse_slow_reads` (a reader of the mount's slow-read
file, every READ answered after 100-300 ms: in ``D`` most of the time, yet making progress).
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor_protocol import (
        READY_SIGNAL,
        WORKER_PROCESS_IDENTITIES_SIGNAL,
        EngineDeadError,
        ErrorResponse,
        GenerationRequest,
        GenerationResult,
        RequestError,
        TokenResponse,
    )
    from ._executor_proxy import PROXY_CLASSES, GenerationExecutor, GenerationExecutorProxy, MainGenerationExecutorProxy
    from ._executor_worker import worker_main
    from ._mpi_env import MPI_ENV_DEFAULTS, configure_mpi_env
    from ._mpi_pool_session import MpiPoolSession

__all__ = ["EngineDeadError", "ErrorResponse", "GenerationExecutor", "GenerationExecutorProxy", "GenerationRequest",
           "GenerationResult", "MPI_ENV_DEFAULTS", "MainGenerationExecutorProxy", "MpiPoolSession", "PROXY_CLASSES",
           "READY_SIGNAL", "RequestError", "TokenResponse", "WORKER_PROCESS_IDENTITIES_SIGNAL", "configure_mpi_env",
           "worker_main"]

_SOURCES = {
    "._executor_protocol": ("EngineDeadError", "ErrorResponse", "GenerationRequest", "GenerationResult", "READY_SIGNAL",
        "RequestError", "TokenResponse", "WORKER_PROCESS_IDENTITIES_SIGNAL"),
    "._executor_proxy": ("GenerationExecutor", "GenerationExecutorProxy", "MainGenerationExecutorProxy",
        "PROXY_CLASSES"),
    "._executor_worker": ("worker_main",),
    "._mpi_env": ("MPI_ENV_DEFAULTS", "configure_mpi_env"),
    "._mpi_pool_session": ("MpiPoolSession",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
