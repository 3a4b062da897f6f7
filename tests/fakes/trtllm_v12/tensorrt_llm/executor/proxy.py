"""Fake ``tensorrt_llm.executor.proxy`` (1.2.x): the shape of ``_trtllm_fake_common.ProxyCore``.

No ``check_health``, ``_fatal_error``, ``_error_monitor_loop``, ``_worker_process_monitor``,
``_mark_engine_dead`` or ``WORKER_PROCESS_IDENTITIES_SIGNAL``: the extension must detect that.
"""

from _trtllm_fake_common import ProxyCore

from ..llmapi.mpi_session import MpiCommSession, MpiPoolSession, RemoteMpiCommSessionClient
from .executor import GenerationExecutor
from .ipc import IpcQueue
from .request import CancellingRequest, GenerationRequest
from .result import GenerationResult
from .utils import ErrorResponse
from .worker import worker_main

__all__ = ["GenerationExecutorProxy"]
_IMPORTED = (CancellingRequest, ErrorResponse, GenerationRequest, GenerationResult, IpcQueue, MpiCommSession,
             MpiPoolSession, RemoteMpiCommSessionClient, worker_main)  # module globals, looked up at call time


class GenerationExecutorProxy(ProxyCore, GenerationExecutor):
    pass
