"""Fake ``tensorrt_llm.executor.executor`` (main): ``create`` routes; base ``check_health`` and the fatal error."""

from __future__ import annotations

import threading
from typing import Any

from _trtllm_fake_common import GenerationExecutorBase, create_executor


class GenerationExecutor(GenerationExecutorBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fatal_error: BaseException | None = None
        self._fatal_error_lock = threading.Lock()

    def _set_fatal_error(self, error: BaseException) -> None:
        """The first error wins."""
        with self._fatal_error_lock:
            if self._fatal_error is None:
                self._fatal_error = error

    def check_health(self) -> bool:
        """Base version (what the rpc proxy and Ray have): shutdown or a fatal error -> False."""
        return not self.doing_shutdown and self._fatal_error is None

    @staticmethod
    def _create_ray_executor(worker_kwargs: dict[str, Any], model_world_size: int, postproc_worker_config: Any,
                             is_llm_executor: Any, tp_size: int) -> Any:
        from .ray_executor import RayExecutor

        return RayExecutor(worker_kwargs, model_world_size=model_world_size,
                           postproc_worker_config=postproc_worker_config, is_llm_executor=is_llm_executor,
                           tp_size=tp_size)

    @staticmethod
    def _create_rpc_executor(worker_kwargs: dict[str, Any], model_world_size: int, mpi_session: Any,
                             postproc_worker_config: Any, is_llm_executor: Any) -> Any:
        from .rpc_proxy import GenerationExecutorRpcProxy

        return GenerationExecutorRpcProxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                          postproc_worker_config=postproc_worker_config,
                                          is_llm_executor=is_llm_executor)

    @staticmethod
    def _create_ipc_executor(worker_kwargs: dict[str, Any], model_world_size: int, mpi_session: Any,
                             postproc_worker_config: Any, is_llm_executor: Any, use_worker: bool = False) -> Any:
        if use_worker:
            from .worker import GenerationExecutorWorker

            return GenerationExecutorWorker(worker_kwargs, is_llm_executor=is_llm_executor)
        from .proxy import GenerationExecutorProxy  # at call time, as upstream

        return GenerationExecutorProxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                       postproc_worker_config=postproc_worker_config,
                                       is_llm_executor=is_llm_executor)

    @staticmethod
    def create(engine: Any = None, **kwargs: Any) -> Any:
        return create_executor(GenerationExecutor, engine, **kwargs)
