"""Reference executor: TensorRT-LLM's proxy/worker protocol over real ``mpi4py.futures`` workers.

Runs end to end without a GPU, so the liveness integration can be exercised and demonstrated for
real. Needs the ``mpi`` extra (mpi4py, the Open MPI wheel, pyzmq). See :mod:`._proxy` for how it
mirrors upstream 1.2.x and main, and where it departs.
"""

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

__all__ = [
    "MPI_ENV_DEFAULTS",
    "PROXY_CLASSES",
    "READY_SIGNAL",
    "WORKER_PROCESS_IDENTITIES_SIGNAL",
    "EngineDeadError",
    "ErrorResponse",
    "GenerationExecutor",
    "GenerationExecutorProxy",
    "GenerationRequest",
    "GenerationResult",
    "MainGenerationExecutorProxy",
    "MpiPoolSession",
    "RequestError",
    "TokenResponse",
    "configure_mpi_env",
    "worker_main",
]
