"""Fake ``tensorrt_llm.executor.executor`` (1.2.x): ``create`` routes; no ``check_health``."""

from __future__ import annotations

from typing import Any

from _trtllm_fake_common import GenerationExecutorBase, create_executor


class GenerationExecutor(GenerationExecutorBase):
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
