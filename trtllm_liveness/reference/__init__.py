"""Reference executor: TensorRT-LLM's proxy/worker protocol over real ``mpi4py.futures`` workers.

Runs end to end without a GPU, so the liveness integration can be exercised and demonstrated for
real. Needs the ``mpi`` extra (mpi4py, the Open MPI wheel, pyzmq). See :mod:`._proxy` for how it
mirrors upstream 1.2.x and main, and where it departs.
"""

from ._env import MPI_ENV_DEFAULTS, configure_mpi_env
from ._protocol import (
    READY_SIGNAL,
    WORKER_PROCESS_IDENTITIES_SIGNAL,
    EngineDeadError,
    ErrorResponse,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TokenResponse,
)
from ._proxy import PROXY_CLASSES, GenerationExecutor, GenerationExecutorProxy, MainGenerationExecutorProxy
from ._session import MpiPoolSession
from ._worker import worker_main

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
