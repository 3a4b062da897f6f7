"""Reference executor: TensorRT-LLM's proxy/worker protocol over real ``mpi4py.futures`` workers.

Runs end to end without a GPU, so the liveness integration can be exercised and demonstrated for
real. Needs the ``mpi`` extra (mpi4py, the Open MPI wheel, pyzmq). See :mod:`._executor_proxy` for
how it mirrors upstream 1.2.x and main, and where it departs.

Real faults for the demo, the tests and the benchmarks: :mod:`._cgroup_faults` (freezer and memory
cgroups) and :mod:`._fuse_stall` (a FUSE mount whose requests are held by its own protocol server:
real ``D`` without cgroup v1; its mounts and their clean-up are :mod:`._fuse_mounts`).
The tests' stall (``tests/support/fuse_stall.py``) adds the healthy look-alike of a wedge: a file
whose every READ is answered after 100-300 ms, its reader in ``D`` most of the time, yet making progress.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor_proxy import PROXY_CLASSES, GenerationExecutorProxy, MainGenerationExecutorProxy
    from ._mpi_env import configure_mpi_env

__all__ = ["GenerationExecutorProxy", "MainGenerationExecutorProxy", "PROXY_CLASSES", "configure_mpi_env"]

_SOURCES = {
    "._executor_proxy": ("GenerationExecutorProxy", "MainGenerationExecutorProxy", "PROXY_CLASSES"),
    "._mpi_env": ("configure_mpi_env",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
