"""Environment for Open MPI 5 (the PyPI wheel) as root on loopback, set before MPI starts.

Values are the ones measured in ENVIRONMENT.md. Only ``setdefault`` is used, so whatever the user
exported wins. ``PRTE_MCA_oob_tcp_if_include`` is deliberately never set: it breaks the spawn.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

MPI_ENV_DEFAULTS: dict[str, str] = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # Required for the singleton spawn that MPIPoolExecutor does.
    "PRTE_ALLOW_RUN_AS_ROOT": "1",
    "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_pml": "ob1",  # MPI_Init 1.07 s -> 0.09 s
    "OMPI_MCA_btl": "self,sm,tcp",  # do not drop tcp
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",  # more ranks than cores
}

# With the default error handler Open MPI aborts the parent ~40 ms after a worker dies; with
# ULFM (fault tolerance) on, the parent survives and its futures stay pending forever: the field
# failure this project exists for.
FT_ENABLE_VAR = "OMPI_MCA_mpi_ft_enable"


def configure_mpi_env(
    environ: MutableMapping[str, str] | None = None, *, fault_tolerant: bool = True
) -> MutableMapping[str, str]:
    """Fill in the Open MPI variables (``setdefault``) and put this venv's ``bin`` first on PATH.

    ``fault_tolerant`` also defaults ``OMPI_MCA_mpi_ft_enable=1``. Must run before ``mpi4py``
    initialises MPI (it reads the environment once). Not thread-safe (it edits the environment);
    returns the mapping it edited.
    """
    env = os.environ if environ is None else environ
    for key, value in MPI_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if fault_tolerant:
        env.setdefault(FT_ENABLE_VAR, "1")
    env.setdefault("OPAL_PREFIX", sys.prefix)  # help texts of the wheel
    # A plain-python spawn execs ``prte`` from PATH; Debian's or none makes every future hang.
    bindir = os.path.join(sys.prefix, "bin")
    path = env.get("PATH", "")
    parts = path.split(os.pathsep) if path else []
    if not parts or parts[0] != bindir:
        env["PATH"] = os.pathsep.join([bindir, *[p for p in parts if p != bindir]])
    return env
