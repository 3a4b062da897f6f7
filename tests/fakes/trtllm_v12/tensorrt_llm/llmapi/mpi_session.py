"""Fake ``tensorrt_llm.llmapi.mpi_session`` (1.2.x): no ``release_exit_joins``/``abandon``/``check_worker_error``."""

from _trtllm_fake_common import (
    MpiCommSessionBase,
    MpiPoolSessionBase,
    MpiSessionBase,
    RemoteMpiCommSessionClientBase,
    RemoteTask,
    serve_comm_workers,
)

from ..executor.ipc import ZeroMqQueue


class MpiSession(MpiSessionBase):
    pass


class MpiPoolSession(MpiPoolSessionBase, MpiSession):
    pass


class MpiCommSession(MpiCommSessionBase, MpiSession):
    pass


class RemoteMpiCommSessionClient(RemoteMpiCommSessionClientBase, MpiSession):
    queue_cls = ZeroMqQueue


__all__ = ["MpiCommSession", "MpiPoolSession", "MpiSession", "RemoteMpiCommSessionClient", "RemoteTask",
           "serve_comm_workers"]
