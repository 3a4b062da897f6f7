"""A remote host's agent for the hub tests: ``unshare --uts python -m tests.programs.host_agent_child JSON``.

Runs in a UTS namespace of its own with the hostname ``host`` (so its ranks are another host's to
the hub in the test process, while pids stay comparable). Starts ``ranks`` sleeper children (its
host's other ranks, in sessions of their own), builds a :class:`HostAgent` whose own rank is this
process (rank ``first_rank``; the children take the next ones), prints one JSON line
``{"ready": true, "pid": ..., "ranks": [[rank, pid, start], ...]}`` once its hello is welcomed
(or ``{"ready": false}`` after 20 s), then serves until its rank is ended:
``on_proxy_lost`` (the proxy gone, or its stop done) prints ``{"ended": reason}`` and exits with 75.
Options: ``endpoint``, ``secret`` (hex), ``heartbeat_timeout_s``, ``d_state_timeout_s``,
``drill`` (the agent's engine is a drill's: it makes the faults its hub asks for, with the drill's
handler; otherwise it refuses them, as a server's agent does), ``slow_poll``
(each of the agent's polls returns 0.3 s late, as in a rank whose other threads hold the
interpreter: what the hub sent and the close of its connection then arrive in one round),
``die_with_agent`` (each sleeper gets SIGKILL when this process ends, ``PR_SET_PDEATHSIG``: a rig
of many hosts leaves nothing behind even when it is itself killed),
``dumps`` (the sleepers register their stack dump at start, as every rank does: stacks without
ptrace), ``beats`` (``[count, every_s]``: once welcomed, the agent is told ``count`` iterations of
each rank, one every ``every_s``, as its host's progress channel would; then one line
``{"beats_sent": count, "messages": n}``, n the iteration messages the agent sent),
``iterations_interval_s`` (the agent's interval between two iteration messages, default 1 s),
``watch`` (``[[rank, pid], ...]``: processes of the caller's watched as this host's ranks too, after
the sleepers), ``quarantine`` (how the agent quarantines this host, in the JSON form of
``QuarantineSettings.to_spec()``), ``observe`` (the engine observes) and ``die_at_group`` (this
process SIGKILLs itself as soon as its drill's freezer group is made, before anything is frozen: a
launcher's teardown there).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time


def emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def die_with_parent() -> None:
    """In a sleeper before its exec: SIGKILL when its parent (this agent) ends."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(options: dict[str, object]) -> int:
    socket.sethostname(str(options["host"]))
    from trtllm_liveness.drill._drill_faults import AgentFaults
    from trtllm_liveness.multihost import AgentSettings, HostAgent
    from trtllm_liveness.multihost._agent_faults import FaultHandler
    from trtllm_liveness.process._identity import capture_identity
    from trtllm_liveness.process._procfs import read_start_time
    from trtllm_liveness.quarantine._quarantine_settings import QuarantineSettings

    if options.get("die_at_group"):
        import signal

        from trtllm_liveness.demo import _cgroup_faults

        made = _cgroup_faults.FreezerGroup.__init__

        def made_then_die(self: _cgroup_faults.FreezerGroup, prefix: str = "trtllm-liveness",
                          name: str | None = None) -> None:
            made(self, prefix, name=name)
            os.kill(os.getpid(), signal.SIGKILL)

        _cgroup_faults.FreezerGroup.__init__ = made_then_die  # type: ignore[method-assign]
    if options.get("slow_poll"):
        import zmq

        poll = zmq.Poller.poll

        def slow(self: zmq.Poller, timeout: int | None = None) -> list[tuple[object, int]]:
            time.sleep(0.3)
            return poll(self, timeout)

        zmq.Poller.poll = slow  # type: ignore[method-assign]
    first = int(options.get("first_rank", 1))  # type: ignore[call-overload]
    with_agent = die_with_parent if options.get("die_with_agent") else None
    sleeper = "import time; time.sleep(600)"
    if options.get("dumps"):
        sleeper = ("from trtllm_liveness.diagnose._faulthandler_stacks import register_stack_dump; "
                   f"register_stack_dump(); {sleeper}")
    children = [subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True,
                                 preexec_fn=with_agent)  # before the agent starts any thread
                for _ in range(int(options.get("ranks", 1)))]  # type: ignore[call-overload]
    identities = [capture_identity(first + 1 + index, child.pid) for index, child in enumerate(children)]
    identities += [capture_identity(int(rank), int(pid)) for rank, pid in options.get("watch", [])]  # type: ignore[attr-defined]
    d = options.get("d_state_timeout_s")
    settings = AgentSettings(str(options["endpoint"]), bytes.fromhex(str(options["secret"])),
                             float(options.get("heartbeat_timeout_s", 1.0)),  # type: ignore[arg-type]
                             float(d) if d is not None else None,  # type: ignore[arg-type]
                             grace_s=0.5, kill_s=1.0,
                             faults=AgentFaults if options.get("drill") else FaultHandler,
                             observe=bool(options.get("observe")),
                             quarantine=QuarantineSettings(**options["quarantine"])  # type: ignore[arg-type]
                             if options.get("quarantine") else None,
                             iterations_interval_s=float(options.get("iterations_interval_s", 1.0)))  # type: ignore[arg-type]

    def ended(reason: str) -> None:
        emit({"ended": reason})
        os._exit(75)

    agent = HostAgent(settings, capture_identity(first), identities, on_proxy_lost=ended).start()
    ready = agent.welcomed.wait(20)
    emit({"ready": ready, "pid": os.getpid(), "start": read_start_time(os.getpid()),
          "ranks": [[i.rank, i.pid, i.start_time] for i in identities]})
    beats = options.get("beats")
    if isinstance(beats, list):
        count, every_s = int(beats[0]), float(beats[1])
        for number in range(1, count + 1):
            for identity in (capture_identity(first), *identities):
                agent.note_iteration(identity.rank, number, time.monotonic())
            time.sleep(every_s)
        time.sleep(settings.iterations_interval_s + 1.0)  # the last batch leaves
        emit({"beats_sent": count, "messages": agent.iteration_messages})
    time.sleep(300)
    return 1


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1])))
