"""Fake GenerationExecutor: ``create`` routes to ``GenerationExecutor._create_ipc_executor`` by name."""

from __future__ import annotations

from typing import Any

from trtllm_liveness.reference._proxy import GenerationExecutor as _ReferenceExecutor


class GenerationExecutor(_ReferenceExecutor):
    @staticmethod
    def _create_ipc_executor(
        worker_kwargs: dict[str, Any],
        model_world_size: int,
        mpi_session: Any,
        postproc_worker_config: Any = None,
        is_llm_executor: Any = None,
        use_worker: bool = False,
    ) -> Any:
        if use_worker:
            raise NotImplementedError("the fake has no single-process worker")
        from .proxy import GenerationExecutorProxy

        return GenerationExecutorProxy(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session,
                                       postproc_worker_config=postproc_worker_config,
                                       is_llm_executor=is_llm_executor)

    @staticmethod
    def create(*, model_world_size: int = 1, mpi_session: Any = None, llm_args: Any = None,
               **worker_kwargs: Any) -> Any:  # type: ignore[override]
        worker_kwargs["llm_args"] = llm_args
        return GenerationExecutor._create_ipc_executor(worker_kwargs, model_world_size=model_world_size,
                                                       mpi_session=mpi_session, is_llm_executor=True)
