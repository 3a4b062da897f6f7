"""The worker spec: the one record the proxy hands every rank, and the rank's check of it.

A record crosses MPI pickled, and unpickling runs no checks: the rank's
:meth:`WorkerSpec.from_wire` must turn every malformed record into one clear error, and the rank
entry must then neither crash into a hang nor start half of its liveness.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations.trtllm import _worker_entry
from trtllm_liveness.integrations.trtllm._worker_entry import liveness_worker_entry
from trtllm_liveness.integrations.trtllm._worker_spec import (
    SPEC_KWARG,
    IdentityChannelSpec,
    ProgressSpec,
    ProxyIdentity,
    WorkerSpec,
    WorkerSpecError,
)
from trtllm_liveness.multihost._agent import AgentSettings
from trtllm_liveness.process._identity import ProcessIdentity, local_hostname
from trtllm_liveness.quarantine._quarantine_settings import QuarantineSettings

pytestmark = [pytest.mark.timeout(60)]

JOB_S = 60.0  # an mpirun job of 2 ranks on 2 shared cores, start to end


def quarantine() -> QuarantineSettings:
    """How each remote host's agent quarantines its host: what a server's hub hands it (a fresh
    record: :func:`tampered` changes the one it is given)."""
    return QuarantineSettings.from_config(LivenessConfig(quarantine_slurm_drain=True, quarantine_k8s_taint=True,
                                                         quarantine_hook="/usr/local/bin/hook"))


def task(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def full_spec() -> WorkerSpec:
    """A spec with every part, as an engine on several hosts with stall detection builds it (the
    proxy is on another host: the rank starts no watch)."""
    return WorkerSpec(task, ProxyIdentity(4242, 100, "elsewhere", 4026531836, "boot"),
                      IdentityChannelSpec("ipc:///tmp/x/identities", "a" * 32),
                      ProgressSpec("ipc:///tmp/x/progress", "b" * 32, 0.25),
                      AgentSettings("tcp://10.0.0.1:5555", b"k" * 32, 1.0, 5.0, quarantine=quarantine()))


def wire(spec: WorkerSpec) -> Any:
    """What a rank receives: the record through pickle, as mpi4py sends it."""
    return pickle.loads(pickle.dumps(spec))


def tampered(path: str, value: Any) -> Any:
    """A full spec whose field ``path`` (``part.field`` or ``field``) holds ``value``, as an
    unpickled record may (unpickling bypasses the checks), received through pickle."""
    spec = full_spec()
    owner: Any = spec
    *parts, name = path.split(".")
    for part in parts:
        owner = getattr(owner, part)
    object.__setattr__(owner, name, value)
    return wire(spec)


def test_a_full_spec_survives_the_wire_and_is_accepted() -> None:
    received = WorkerSpec.from_wire(wire(full_spec()))
    assert received == full_spec()
    assert received.proxy == ProxyIdentity(4242, 100, "elsewhere", 4026531836, "boot")
    assert WorkerSpec.from_wire(wire(WorkerSpec(task))).hub is None


def test_a_drills_agents_get_its_fault_handler_through_the_wire() -> None:
    """The class travels by reference (the rank imports the drill's module as it unpickles it)."""
    from trtllm_liveness.drill._drill_faults import AgentFaults

    settings = full_spec().hub
    assert settings is not None and settings.faults is not AgentFaults
    received = WorkerSpec.from_wire(wire(WorkerSpec(task, hub=dataclasses.replace(settings, faults=AgentFaults))))
    assert received.hub is not None and received.hub.faults is AgentFaults


@pytest.mark.parametrize(("raw", "named"), [
    (None, "no worker spec"),
    ({"fn": task}, "a dict, not a WorkerSpec"),
    (tampered("fn", "worker_main"), "task is not callable"),
    (tampered("proxy", [4242, 100, "elsewhere", 1]), "proxy identity: a list, not a ProxyIdentity"),
    (tampered("proxy.pid", True), "proxy identity: bad proxy pid"),
    (tampered("proxy.pid", 0), "proxy identity: bad proxy pid"),
    (tampered("proxy.hostname", None), "proxy identity: bad proxy hostname"),
    (tampered("proxy.pid_namespace", "4026531836"), "proxy identity: bad proxy PID namespace"),
    (tampered("channel", {"address": "ipc:///x", "token": "t"}), "identity channel: a dict"),
    (tampered("channel.address", 5), "identity channel: bad identity channel address"),
    (tampered("channel.address", "/tmp/x/identities"), "identity channel: bad identity channel address"),
    (tampered("channel.token", ""), "identity channel: bad identity channel token"),
    (tampered("progress.interval_s", math.nan), "progress channel: bad progress interval"),
    (tampered("progress.interval_s", -1), "progress channel: bad progress interval"),
    (tampered("progress.token", b"t"), "progress channel: bad progress channel token"),
    (tampered("hub", {"endpoint": "tcp://10.0.0.1:5555"}), "hub settings: not agent settings"),
    (tampered("hub.secret", b"short"), "hub settings: bad hub secret"),
    (tampered("hub.endpoint", "http://10.0.0.1:5555"), "hub settings: bad hub endpoint"),
    (tampered("hub.heartbeat_timeout_s", 0), "hub settings: bad heartbeat timeout"),
    (tampered("hub.scan_interval_s", "1"), "hub settings: bad scan interval"),
    (tampered("hub.faults", "trtllm_liveness.drill._drill_faults:AgentFaults"), "hub settings: bad fault handler"),
    (tampered("hub.faults", ProcessIdentity), "hub settings: bad fault handler"),
    (tampered("hub.quarantine", quarantine().to_spec()), "hub settings: quarantine settings: a dict, not"),
    (tampered("hub.quarantine.quarantine_dir", "run/q"), "hub settings: quarantine settings: quarantine_dir must be"),
    (tampered("hub.quarantine.quarantine_hook", 7), "hub settings: quarantine settings: quarantine_hook must be a"),
    (tampered("hub.quarantine.quarantine_slurm_drain", "1"), "hub settings: .*quarantine_slurm_drain must be a bool"),
    (tampered("hub.quarantine.quarantine_action_timeout_s", 0), "hub settings: .*quarantine_action_timeout_s must be"),
    (tampered("hub.quarantine.quarantine_action_timeout_s", math.inf), "hub settings: .*must be finite"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_malformed_spec_is_one_error_naming_the_part(raw: Any, named: str) -> None:
    with pytest.raises(WorkerSpecError, match=named):
        WorkerSpec.from_wire(raw)


def test_the_quarantine_settings_travel_in_the_hubs_settings() -> None:
    """The hub's settings carry the record every rank gets; a malformed one is an error naming it."""
    settings = AgentSettings("tcp://10.0.0.1:5555", b"k" * 32, 1.0, None, quarantine=quarantine())
    assert WorkerSpec.from_wire(wire(WorkerSpec(task, hub=settings))).hub == settings
    with pytest.raises(ValueError, match="quarantine_dir"):
        QuarantineSettings(**{**quarantine().to_spec(), "quarantine_dir": "relative"})


def test_a_record_of_another_version_is_rejected_by_its_missing_field() -> None:
    spec = full_spec()
    object.__delattr__(spec, "progress")  # what a record pickled before the field existed unpickles to
    with pytest.raises(WorkerSpecError, match="lacks progress"):
        WorkerSpec.from_wire(wire(spec))


@pytest.mark.parametrize("build", [
    lambda: WorkerSpec(None),  # type: ignore[arg-type]
    lambda: WorkerSpec(task, ProxyIdentity.from_sequence([4242, 100, "h"])),
    lambda: WorkerSpec(task, progress=ProgressSpec("ipc:///x", "t", 0)),
    lambda: WorkerSpec(task, hub=AgentSettings("tcp://h:1", b"k" * 31, 1.0, None)),
])
def test_the_proxy_cannot_build_a_malformed_spec(build: Callable[[], WorkerSpec]) -> None:
    with pytest.raises(ValueError):
        build()


def test_the_entry_pops_its_keyword_and_calls_the_task_with_upstreams_arguments_alone() -> None:
    received = liveness_worker_entry(1, "two", engine="e", **{SPEC_KWARG: wire(WorkerSpec(task))})
    assert received == ((1, "two"), {"engine": "e"})


def test_a_malformed_part_is_one_error_and_the_task_runs_without_liveness(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[WorkerSpec] = []
    monkeypatch.setattr(_worker_entry, "start_liveness", started.append)
    with caplog.at_level(logging.INFO, logger="trtllm_liveness"):
        received = liveness_worker_entry(7, engine="e", **{SPEC_KWARG: tampered("hub.secret", b"short")})
    assert received == ((7,), {"engine": "e"})
    assert started == []  # nothing of a spec that failed its check is used
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and caplog.records[-1].levelno == logging.ERROR, errors
    assert f"(pid {os.getpid()}) on host {local_hostname()}" in errors[0]
    assert "hub settings: bad hub secret" in errors[0] and "runs without liveness" in errors[0]


def test_a_spec_without_a_task_raises_its_error_after_logging_it(caplog: pytest.LogCaptureFixture) -> None:
    for raw in (None, tampered("fn", None), {"fn": task}):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trtllm_liveness"), pytest.raises(WorkerSpecError):
            liveness_worker_entry(1, **({} if raw is None else {SPEC_KWARG: raw}))
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "the task cannot run" in errors[0], errors


@pytest.mark.timeout(150)
@pytest.mark.mpi
@pytest.mark.real_process
@needs("mpi")
@pytest.mark.parametrize(("case", "logged"), [("good", 0), ("bad_hub", 1), ("no_task", 1)])
def test_real_ranks_given_a_malformed_spec_log_it_and_none_hangs(case: str, logged: int) -> None:
    """``mpirun -n 2``: each rank receives the same spec through pickle. With a malformed hub part
    (which, accepted, would make every rank enter the agents' placement gather) every rank logs
    one ERROR, enters no collective of its own, and the task's allgather completes on both; with no
    task each rank gets the error; the job ends by itself either way."""
    with HelperProcess("mpirun_exec", {"mpirun_args": [], "n": 2, "module": "worker_spec_child",
                                       "options": {"case": case}}, {"OMPI_MCA_mpi_ft_enable": "0"}) as job:
        records = [job.read_record(JOB_S * WAIT_SCALE, "rank") for _ in range(2)]
        status = job.wait_exit(JOB_S * WAIT_SCALE)
        log = job.stderr_tail(40000)
        assert status == 0, log[-4000:]
        by_rank = {record["rank"]: record for record in records}
        assert sorted(by_rank) == [0, 1], records
        if case == "no_task":
            assert all("WorkerSpecError" in r["error"] and "task is not callable" in r["error"]
                       for r in records), records
        else:
            assert all(r["result"] == ["tag0", "tag1"] for r in records), records
        assert log.count("rejected the proxy's worker spec") == 2 * logged, log[-4000:]
        assert job.close() == []
