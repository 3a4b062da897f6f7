"""Fidelity of the upstream-shaped fakes (tests/fakes/): what a real user sees WITHOUT the extension.

Each test runs a child interpreter in its own session with ``PYTHONPATH`` set to one fake tree, so
the fake ``tensorrt_llm`` is never imported into pytest's process, and with
``TRTLLM_WORKER_LIVENESS`` removed, so no code of the extension runs there (each child checks that
``trtllm_liveness.integrations`` was never imported). The child prints one result line; the test
asserts on it. The facts these tests pin are listed in docs/upstream-contract.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker

FAKES = Path(__file__).resolve().parents[2] / "fakes"
TREES = {"v12": FAKES / "trtllm_v12", "main": FAKES / "trtllm_main"}
# Variables that would change what the child sees: the extension's switch and upstream's knobs.
_DROPPED_ENV = ("PYTHONPATH", "TRTLLM_WORKER_LIVENESS", "TLLM_LLMAPI_ZMQ_DEBUG", "TLLM_WORKER_USE_SINGLE_PROCESS")

pytestmark = [pytest.mark.timeout(60), needs("mpi")]

# Prepended to every child: proves which tensorrt_llm it runs and that the extension is absent.
_PRELUDE = """
import os, sys
import tensorrt_llm
def report(*words):
    assert "trtllm_liveness.integrations" not in sys.modules, "the extension was imported"
    os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())
report("TREE", os.path.dirname(os.path.dirname(os.path.abspath(tensorrt_llm.__file__))))
"""


def run_child(procs: ProcessTracker, tree: str, body: str, *, env: dict[str, str] | None = None,
              timeout: float = 30.0) -> tuple[int, list[str], str]:
    """Run ``_PRELUDE + body`` against ``tree``; return (status, stdout lines, stderr). Bounded."""
    environ = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    environ.update(PYTHONPATH=str(TREES[tree]), PYTHONUNBUFFERED="1", **(env or {}))
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=environ, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The child's own session (start_new_session): its MPI helpers go with it.
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"child did not finish within {timeout} s\nstdout:\n{out.decode()}\n"
                    f"stderr:\n{err.decode()[-3000:]}")
    lines = out.decode().splitlines()
    assert lines and lines[0] == f"TREE {TREES[tree]}", (lines, err.decode()[-3000:])
    return proc.returncode, lines[1:], err.decode()


def _result(lines: list[str], err: str, key: str) -> list[str]:
    found = [line.split()[1:] for line in lines if line.split()[:1] == [key]]
    assert found, f"no {key} line in {lines}\nstderr:\n{err[-3000:]}"
    return found[0]


# ----------------------------------------------------------------------------- (a) blocking PAIR put

_PUT_TO_GONE_PEER = """
import threading
import time
import zmq
from zmq.utils.monitor import recv_monitor_message
from tensorrt_llm.executor.ipc import ZeroMqQueue
from tensorrt_llm.executor.request import CancellingRequest

server = ZeroMqQueue(is_server=True, name="proxy_request_queue")           # the proxy's end (binds)
report("HWM", server.socket.get_hwm())
monitor = server.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
client = ZeroMqQueue(server.address, is_server=False, name="worker_request_queue")  # the leader's end
client.setup_lazily()                                                     # connect first: a PAIR put
server.put("hello")                                                       # without a peer would block
assert client.get() == "hello"                                            # the pipe exists
client.close()                                                            # the peer is gone
assert monitor.poll(10000), "the server never saw the disconnect"
assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
done = threading.Event()
def send():
    # What _abort_all_requests() does: one abort_request() per pending request. The first put may
    # still land in the old pipe while libzmq tears it down; once the socket has no peer, one blocks.
    for request_id in range(20):
        server.put(CancellingRequest(request_id))
        time.sleep(0.01)
    done.set()
sender = threading.Thread(target=send, daemon=True)
sender.start()
returned = done.wait(3.0)
report("PUT", "returned" if returned else "blocked")
os._exit(0)                                                               # the sender never ends
"""


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_pair_put_to_a_gone_peer_stays_blocked(procs: ProcessTracker, tree: str) -> None:
    status, lines, err = run_child(procs, tree, _PUT_TO_GONE_PEER)
    assert status == 0, err[-3000:]
    # main sets the high-water mark to 0 (no limit); the 1.2-era file sets none (libzmq's 1000).
    assert _result(lines, err, "HWM") == (["0"] if tree == "main" else ["1000"])
    # The send blocks because a PAIR socket without a peer has no pipe, whatever the HWM.
    assert _result(lines, err, "PUT") == ["blocked"]


# ----------------------------------------------------------------------------- (b) ZMQ debug thread check

_SEND_FROM_SECOND_THREAD = """
import threading
from tensorrt_llm.executor.ipc import ZeroMqQueue

queue = ZeroMqQueue(is_server=True, name="proxy_request_queue")
queue.put_noblock("first", retry=0)                   # the owning thread (no peer: only logged)
outcome = []
def other():
    try:
        queue.put_noblock(None, retry=0)              # e.g. pre_shutdown's sentinel from a helper thread
        outcome.append("ok")
    except RuntimeError as error:
        outcome.append("raised " + str(error).split(":")[0])
thread = threading.Thread(target=other)
thread.start()
thread.join(10)
report("SECOND", *(outcome or ["hung"]))
os._exit(0)
"""


@pytest.mark.parametrize(("tree", "debug", "expected"), [
    ("main", "1", ["raised", "ZMQ", "thread", "safety", "violation", "detected", "in", "[proxy_request_queue]"]),
    ("main", "0", ["ok"]),
    ("v12", "1", ["ok"]),  # the 1.2-era ipc.py has no such check
])
def test_zmq_debug_mode_rejects_a_second_thread(procs: ProcessTracker, tree: str, debug: str,
                                                expected: list[str]) -> None:
    status, lines, err = run_child(procs, tree, _SEND_FROM_SECOND_THREAD, env={"TLLM_LLMAPI_ZMQ_DEBUG": debug})
    assert status == 0, err[-3000:]
    assert _result(lines, err, "SECOND") == expected


# ----------------------------------------------------------------------------- (c) strict llm_args

_STRICT_ARGS = """
from tensorrt_llm import LLM
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from _trtllm_fake_common import FakeEngine

def attempt(name, **kwargs):
    try:
        LLM(FakeEngine(), **kwargs)
    except ValueError as error:
        report(name, "ValueError", str(error).split(":")[-1].strip())
    else:
        report(name, "accepted")

attempt("UNKNOWN", unknown_key=1)
attempt("LIVENESS", worker_liveness={"d_state_timeout_s": 30})
try:
    TorchLlmArgs(worker_liveness={})
    report("ARGS", "accepted")
except ValueError as error:
    report("ARGS", "ValueError", "extra_forbidden" in str(error))
# env_overrides (main) reaches os.environ before the keys are checked; 1.2 rejects the key itself.
attempt("ENV", env_overrides={"TRTLLM_FIDELITY_PROBE": "7"}, unknown_key=1)
report("ENVIRON", os.environ.get("TRTLLM_FIDELITY_PROBE", "unset"))
"""


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_llm_args_are_strict(procs: ProcessTracker, tree: str) -> None:
    status, lines, err = run_child(procs, tree, _STRICT_ARGS)
    assert status == 0, err[-3000:]
    assert _result(lines, err, "UNKNOWN") == ["ValueError", "unknown_key"]
    assert _result(lines, err, "LIVENESS") == ["ValueError", "worker_liveness"]
    assert _result(lines, err, "ARGS") == ["ValueError", "True"]
    if tree == "main":
        assert _result(lines, err, "ENV") == ["ValueError", "unknown_key"]
        assert _result(lines, err, "ENVIRON") == ["7"]
    else:
        assert _result(lines, err, "ENV") == ["ValueError", "env_overrides"]
        assert _result(lines, err, "ENVIRON") == ["unset"]


# ----------------------------------------------------------------------------- (d) interpreter-exit order

_EXIT_WITHOUT_SHUTDOWN = """
from trtllm_liveness.demo import configure_mpi_env
configure_mpi_env()
import threading
from tensorrt_llm.executor import GenerationExecutor, GenerationExecutorProxy
from _trtllm_fake_common import FakeEngine

def traced(name, method):
    def wrapper(self, *args, **kwargs):
        report("CALL", name, "main-thread" if threading.current_thread() is threading.main_thread() else "other",
               "doing_shutdown=" + str(self.doing_shutdown))
        return method(self, *args, **kwargs)
    return wrapper

# Patched on the class before the build: upstream registers the bound methods at construction.
GenerationExecutorProxy.pre_shutdown = traced("pre_shutdown", GenerationExecutorProxy.pre_shutdown)
GenerationExecutorProxy.shutdown = traced("shutdown", GenerationExecutorProxy.shutdown)
try:
    from tensorrt_llm.executor.worker_process_monitor import WorkerProcessMonitor
except ImportError:
    pass
else:
    WorkerProcessMonitor.close = traced("monitor.close", WorkerProcessMonitor.close)
    WorkerProcessMonitor.doing_shutdown = "n/a"

executor = GenerationExecutor.create(FakeEngine(token_delay_s=0.001), model_world_size=1)
report("BUILT", type(executor).__name__)
assert executor.generate_async([1, 2, 3], max_tokens=2).result(timeout=20).finished
report("SERVED")
# ends without shutdown(): the interpreter's exit handlers run
"""


@pytest.mark.mpi
@pytest.mark.real_process
@pytest.mark.parametrize("tree", ["main", "v12"])
def test_exit_without_shutdown_runs_pre_shutdown_before_shutdown(procs: ProcessTracker, tree: str) -> None:
    status, lines, err = run_child(procs, tree, _EXIT_WITHOUT_SHUTDOWN, timeout=40)
    assert status == 0, f"{lines}\n{err[-3000:]}"
    assert _result(lines, err, "BUILT") == ["GenerationExecutorProxy"]
    calls = [line.split()[1:] for line in lines if line.startswith("CALL ")]
    # threading._register_atexit(pre_shutdown) runs in the main thread before atexit's shutdown();
    # shutdown() then finds doing_shutdown already set. main's pre_shutdown closes its monitor.
    expected = [["pre_shutdown", "main-thread", "doing_shutdown=False"]]
    if tree == "main":
        expected.append(["monitor.close", "main-thread", "doing_shutdown=n/a"])
    expected.append(["shutdown", "main-thread", "doing_shutdown=True"])
    assert calls == expected, f"{lines}\n{err[-3000:]}"


# ----------------------------------------------------------------------------- (e) create() routes

_ROUTES = """
from types import SimpleNamespace
from tensorrt_llm.executor import GenerationExecutor
from _trtllm_fake_common import FakeEngine

def route(name, env=None, **kwargs):
    if env:
        os.environ.update(env)
    try:
        executor = GenerationExecutor.create(FakeEngine(), **kwargs)
        report(name, type(executor).__module__ + "." + type(executor).__name__)
        executor.shutdown()
    finally:
        for key in env or ():
            del os.environ[key]

route("RPC", llm_args=SimpleNamespace(orchestrator_type="rpc"))
route("RAY", llm_args=SimpleNamespace(orchestrator_type="ray"))
route("LOGITS", return_logits=True)
route("SINGLE", env={"TLLM_WORKER_USE_SINGLE_PROCESS": "1"})
try:
    GenerationExecutor.create(FakeEngine(), llm_args=SimpleNamespace(orchestrator_type="carrier-pigeon"))
    report("OTHER", "accepted")
except ValueError:
    report("OTHER", "ValueError")
"""


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_create_routes_give_distinct_classes(procs: ProcessTracker, tree: str) -> None:
    status, lines, err = run_child(procs, tree, _ROUTES)
    assert status == 0, err[-3000:]
    rpc = _result(lines, err, "RPC")
    ray = _result(lines, err, "RAY")
    logits = _result(lines, err, "LOGITS")
    single = _result(lines, err, "SINGLE")
    assert rpc == ["tensorrt_llm.executor.rpc_proxy.GenerationExecutorRpcProxy"]
    assert ray == ["tensorrt_llm.executor.ray_executor.RayExecutor"]
    assert logits == single == ["tensorrt_llm.executor.worker.GenerationExecutorWorker"]
    assert _result(lines, err, "OTHER") == ["ValueError"]
    # None of them is the MPI proxy the extension wraps (the default route; built in the exit test).
    assert all("GenerationExecutorProxy" not in r[0] for r in (rpc, ray, logits))


# ----------------------------------------------------------------------------- (f) dispatch of a late response

_LATE_RESPONSE = """
import logging
import queue
import weakref
from _trtllm_fake_common import Response
from tensorrt_llm.executor.ipc import ZeroMqQueue
from tensorrt_llm.executor.proxy import GenerationExecutorProxy
from tensorrt_llm.llmapi.utils import ManagedThread

records = []
class Records(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.threadName, record.getMessage()))
upstream_logger = logging.getLogger("tensorrt_llm")
upstream_logger.addHandler(Records())
upstream_logger.setLevel(logging.DEBUG)

class Pending:                                           # a GenerationResult, as the dispatch loop sees it
    def __init__(self):
        self.queue = queue.Queue()
server = ZeroMqQueue(is_server=True, name="proxy_result_queue")    # the proxy's end
client = ZeroMqQueue(server.address, is_server=False, name="worker_result_queue")
proxy = GenerationExecutorProxy.__new__(GenerationExecutorProxy)  # only the dispatch loop runs
known = Pending()
proxy._results = {7: known}
proxy.result_queue = server
errors = queue.Queue()
thread = ManagedThread(weakref.WeakMethod(proxy.dispatch_result_task), error_queue=errors,
                       name="proxy_dispatch_result_thread")
thread.start()
client.put(Response(99, 1, False))                        # its request was failed and forgotten
client.put(Response(7, 1, True))                          # a pending request's final response
client.put(None)                                          # the leader's end marker
thread.join(10)
report("ALIVE", thread.is_alive())
report("DELIVERED", known.queue.qsize(), 7 in proxy._results)
report("ERRORS", errors.qsize(), *(type(error).__name__ for error in list(errors.queue)))
logged = [message for level, name, message in records if level == "ERROR" and name == thread.name]
report("LOGGED", len(logged), sum(message.count("Traceback") for message in logged))
os._exit(0)
"""


@pytest.mark.parametrize("tree", ["main", "v12"])
def test_a_response_for_a_forgotten_request(procs: ProcessTracker, tree: str) -> None:
    """1.2-era ``proxy.py`` indexes its result table: a response whose request is no longer in it
    raises ``KeyError`` in the dispatch thread, which ``ManagedThread`` logs at ERROR with its
    traceback and puts on the error queue, and the thread goes on; main's drops the response."""
    status, lines, err = run_child(procs, tree, _LATE_RESPONSE)
    assert status == 0, err[-3000:]
    assert _result(lines, err, "ALIVE") == ["False"]  # the end marker ended it either way
    assert _result(lines, err, "DELIVERED") == ["1", "False"]  # the known request: delivered and removed
    if tree == "v12":
        assert _result(lines, err, "ERRORS") == ["1", "KeyError"]
        assert _result(lines, err, "LOGGED") == ["1", "1"]
    else:
        assert _result(lines, err, "ERRORS") == ["0"]
        assert _result(lines, err, "LOGGED") == ["0", "0"]
