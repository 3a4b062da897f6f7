"""One rank of a multi-host test job (``tests/support/testhosts.py``); mpi4py, standard library.

Usage: ``mpirun ... python -u multihost_rank.py [--ft]``. Prints (flushed, one line each)::

    RANK rank=R size=N pid=<pid in its host> host=<hostname> pidns=<PID-namespace inode> t=<monotonic>
    READY rank=R t=<monotonic>                      # after a barrier of all ranks

then, without ``--ft``, sleeps until killed (MPI's default error handling, the baseline). With
``--ft`` (run it under ``mpirun --with-ft ulfm``) errors return instead of aborting: the rank posts
a receive from every peer (never matched) and tests them every 10 ms, printing::

    FAILED rank=R peer=P class=<MPI error class> name=<its name> t=<monotonic>

when one completes in error (ULFM's MPI_ERR_PROC_FAILED once the peer is known dead). ``t`` is
``time.monotonic()``: CLOCK_MONOTONIC is one clock for the whole machine, so a caller on the same
machine can compare it with its own.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from mpi4py import MPI


def emit(line: str) -> None:
    sys.stdout.write(f"{line} t={time.monotonic():.6f}\n")
    sys.stdout.flush()


def main() -> None:
    ft = "--ft" in sys.argv
    comm = MPI.COMM_WORLD
    if ft:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = comm.Get_rank(), comm.Get_size()
    pidns = os.stat("/proc/self/ns/pid").st_ino
    emit(f"RANK rank={rank} size={size} pid={os.getpid()} host={socket.gethostname()} pidns={pidns}")
    comm.Barrier()
    emit(f"READY rank={rank}")
    if not ft:
        while True:
            time.sleep(1)
    buffers = {peer: bytearray(1) for peer in range(size) if peer != rank}
    pending = {peer: comm.Irecv([buf, MPI.BYTE], source=peer, tag=77) for peer, buf in buffers.items()}
    while True:
        for peer, request in list(pending.items()):
            try:
                request.Test()
            except MPI.Exception as exc:
                emit(f"FAILED rank={rank} peer={peer} class={exc.Get_error_class()} "
                     f"name={MPI.Get_error_string(exc.Get_error_class()).split(':')[0].replace(' ', '_')}")
                del pending[peer]
        time.sleep(0.01)


if __name__ == "__main__":
    main()
