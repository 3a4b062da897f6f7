"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd on loopback, as root.

Debian's ``slurm-wlm`` and ``munge`` packages. Everything lives in one directory the caller owns
(config, munge key and socket, state, spool, logs); the ports are free ones, so a packaged
Slurm on the machine is not touched. The daemons run in the foreground (``-F``/``-D``), started
through the caller's :class:`~tests.support.process_tracker.ProcessTracker`, which ends them by pid; :meth:`stop`
asks them to stop first (SIGTERM through the tracker's popens).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.children import free_port


def _which(name: str) -> str:
    for directory in (*os.environ.get("PATH", "").split(":"), "/usr/sbin", "/usr/bin"):
        path = os.path.join(directory, name)
        if directory and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(name)


class SlurmCluster:
    """One node named after this host; ``env`` points ``scontrol`` at it (``SLURM_CONF``)."""

    @staticmethod
    def node_name() -> str:
        return socket.gethostname().split(".")[0]

    def __init__(self, root: Path, *, health_check: str | None = None) -> None:
        self.root = root
        self.node = self.node_name()
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.popens: list[subprocess.Popen[bytes]] = []
        root.mkdir(parents=True, exist_ok=True)
        (root / "munge").mkdir(mode=0o700)
        (root / "state").mkdir()
        (root / "spool").mkdir()
        key = root / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        lines = [
            "ClusterName=tlq", f"SlurmctldHost={self.node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/ctld.pid", f"SlurmdPidFile={root}/d.pid",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SchedulerType=sched/builtin", "ReturnToService=2", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"SlurmctldLogFile={root}/ctld.log", f"SlurmdLogFile={root}/d.log",
        ]
        if health_check is not None:
            script = root / "healthcheck.sh"
            script.write_text(f"#!/bin/sh\nexport SLURM_CONF={self.conf}\nexec {health_check}\n")
            script.chmod(0o755)
            # slurmd runs it at start and then every interval (slurmctld asks for it).
            lines += [f"HealthCheckProgram={script}", "HealthCheckInterval=1", "HealthCheckNodeState=ANY"]
        lines += [f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN",
                  "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"]
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, track: object, timeout: float = 30.0) -> None:
        """Start the three daemons (each registered with ``track``: a ProcessTracker) and wait
        until the node answers as IDLE. Raises ``TimeoutError`` with the logs' tails."""
        root = self.root
        self._spawn(track, [_which("munged"), "-F", "--force", f"--key-file={root}/munge/key",
                            f"--socket={self.munge_socket}", f"--pid-file={root}/munge/pid",
                            f"--seed-file={root}/munge/seed", f"--log-file={root}/munge/log"], "munged")
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn(track, [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self.scontrol("ping").returncode == 0 and b"UP" in self.scontrol("ping").stdout,
                   timeout, "slurmctld")
        self._spawn(track, [_which("slurmd"), "-D", "-f", str(self.conf)], "slurmd")
        self._wait(lambda: self.node_state().startswith("IDLE"), timeout, "the node IDLE")

    def _spawn(self, track: object, argv: list[str], name: str) -> None:
        out = open(self.root / f"{name}.out", "wb")  # the child keeps its own copy
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        finally:
            out.close()
        track.popens.append(popen)  # type: ignore[attr-defined]
        track.track(popen.pid)  # type: ignore[attr-defined]
        self.popens.append(popen)

    def _wait(self, predicate: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready within {timeout}s:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        parts = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "ctld.log", "d.log"):
            with contextlib.suppress(OSError):
                parts.append(f"--- {name}\n" + (self.root / name).read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    def scontrol(self, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([_which("scontrol"), *args], capture_output=True, env=self.env, timeout=timeout,
                              check=False)

    def node_fields(self) -> dict[str, str]:
        """``scontrol show node -o``'s fields (``State``, ``Reason``, ...); {} when it fails."""
        done = self.scontrol("show", "node", "-o", self.node)
        if done.returncode != 0:
            return {}
        fields: dict[str, str] = {}
        key = ""
        for word in done.stdout.decode(errors="replace").split(" "):
            name, sep, value = word.partition("=")
            if sep and name.isalpha():
                key = name
                fields[key] = value
            elif key:
                fields[key] += " " + word  # a Reason with blanks
        return {name: value.strip() for name, value in fields.items()}

    def node_state(self) -> str:
        return self.node_fields().get("State", "")

    def resume(self) -> None:
        self.scontrol("update", f"NodeName={self.node}", "State=RESUME")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM each daemon (ours: its popen is unreaped, so the pid is still its), newest first."""
        for popen in reversed(self.popens):
            if popen.poll() is None:
                with contextlib.suppress(OSError):
                    popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout)
