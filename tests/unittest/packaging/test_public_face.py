"""The package's faces: the root exports what a user of the extension calls and reads, each name
documented there and by its object; the machinery is importable from its folder's face, not from
the root; every face resolves the names it lists on first use, through the one mechanism (``_lazy``).

(What importing the root costs, in a fresh interpreter: ``test_import_cost.py``.)
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import trtllm_liveness

pytestmark = pytest.mark.timeout(60)

# The root's face, whole: the executor class entry, the configuration, the errors an engine raises
# and the records its ``liveness_*`` members return.
ROOT_API = [
    "Diagnosis", "EventKind", "HostQuarantinedError", "LivenessConfig", "MonitorMethod", "PoolManagerDiedError",
    "RankStatus", "StopReport", "WorkerEvent", "WorkerFailedError", "WorkerState", "liveness_executor_class",
]
# Machinery, each name where it is importable (and not from the root).
MACHINERY = {
    "process": ["AccessDenied", "InvalidIdentityError", "LivenessError", "PidReused", "ProcessGone", "ProcessZombie",
                "ProcessIdentity", "capture_identity", "parse_identities"],
    "monitor": ["StallDetector", "StallInfo", "WorkerProcessMonitor"],
    "stop": ["StopOutcome", "StoppedWorker", "UnkillableWorker", "stop_processes"],
    "exit": ["FatalExitGuard"],
    "quarantine": ["QuarantineCheck", "QuarantineMarker", "QuarantinedProcess", "check_host", "quarantine_host",
                   "read_marker"],
    "diagnose": ["diagnose"],
}
FACES = ["", ".cli", ".demo", ".diagnose", ".exit", ".integrations.trtllm", ".monitor", ".multihost", ".process",
         ".quarantine", ".stop"]


def test_the_root_exports_exactly_what_a_user_calls_and_reads() -> None:
    assert trtllm_liveness.__all__ == sorted(ROOT_API)


@pytest.mark.parametrize("name", ROOT_API)
def test_each_root_name_is_documented_by_its_object_and_by_the_root(name: str) -> None:
    value = getattr(trtllm_liveness, name)
    assert (inspect.getdoc(value) or "").strip(), f"{name} has no docstring"
    role = ":func:" if inspect.isfunction(value) else ":class:"
    assert f"{role}`{name}`" in (trtllm_liveness.__doc__ or ""), f"the root's docstring does not say what {name} is"


@pytest.mark.parametrize(("face", "names"), MACHINERY.items())
def test_machinery_is_importable_from_its_folder_and_not_from_the_root(face: str, names: list[str]) -> None:
    module = importlib.import_module(f"trtllm_liveness.{face}")
    for name in names:
        assert name in module.__all__ and getattr(module, name) is not None
        # (``trtllm_liveness.diagnose`` is the folder itself, not its function)
        assert name not in trtllm_liveness.__all__ and getattr(trtllm_liveness, name, None) is not getattr(module, name)


@pytest.mark.parametrize("face", FACES)
def test_every_face_resolves_its_names_through_the_one_lazy_mechanism(face: str) -> None:
    module = importlib.import_module(f"trtllm_liveness{face}")
    assert set(module.__all__) <= set(dir(module))  # the root's too, before any name was looked up
    assert module.__dir__.__qualname__ == "lazy_exports.<locals>.__dir__"
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


# What the executor's proxy gains (besides upstream's overrides): what a user or a bridge reads.
# The extension's own needs are helpers outside the proxy (``_state.stall_under_way``).
PROXY_MEMBERS = ["liveness_config", "liveness_diagnosis", "liveness_events", "liveness_fatal_error", "liveness_monitor",
                 "liveness_shutdown_report", "liveness_state", "liveness_statuses"]


def test_the_proxy_gains_only_the_liveness_members_a_user_reads() -> None:
    from trtllm_liveness.integrations.trtllm import LivenessProxyMixin

    assert sorted(name for name in dir(LivenessProxyMixin) if name.startswith("liveness_")) == PROXY_MEMBERS
