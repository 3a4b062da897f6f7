"""Fake ``tensorrt_llm._utils``: the MPI communicator helpers (``mpi_comm`` is settable)."""

from _trtllm_fake_common import mpi_comm, mpi_rank, mpi_world_size, set_mpi_comm

__all__ = ["mpi_comm", "mpi_rank", "mpi_world_size", "set_mpi_comm"]
