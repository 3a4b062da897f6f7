"""A loopback stand-in for the Kubernetes API server's ``/api/v1/nodes/<name>``: no API server can run
here, so the official ``kubernetes`` client talks to this one, which answers with a node and records
every request (verb, path, content type, JSON body). The shape of the calls is the client's own.

Each request is also appended, as one JSON line ``[verb, path, content type, body]``, to the
file ``record`` names, if any: what a stand-in in another process recorded
(``tests/programs/kube_node_api.py``, one per test host), read with :func:`recorded_requests`.

:func:`serve_nodes` runs it (a context manager); :func:`write_kubeconfig` writes a kubeconfig that
points a process's client at it (``KUBECONFIG``), for a command that builds its own client.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

# The node every request is answered with: a taint of another owner, which a taint must keep.
NODE: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-7"},
                        "spec": {"taints": [{"key": "other", "value": "x", "effect": "NoExecute"}]}}


class NodeApiRecorder(BaseHTTPRequestHandler):
    """Answers every GET and PATCH with :attr:`node`; appends ``(verb, path, content type, body)``
    to :attr:`requests`. Subclassed per server (:func:`serve_nodes`), so each has its own lists."""

    requests: ClassVar[list[tuple[str, str, str, Any]]] = []
    node: ClassVar[dict[str, Any]] = {}
    record: ClassVar[str] = ""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        request = (self.command, self.path, self.headers.get("Content-Type", ""), body)
        type(self).requests.append(request)
        if type(self).record:
            with open(type(self).record, "a") as handle:
                handle.write(json.dumps(request) + "\n")
        data = json.dumps(type(self).node).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


@contextmanager
def serve_nodes(port: int = 0, record: str = "") -> Iterator[tuple[str, type[NodeApiRecorder]]]:
    """``(base URL, the recorder class whose requests list fills)``, on loopback's ``port`` (0: a
    free one); ``record``: the file each request is also appended to. The server is shut down and
    its thread joined on exit."""
    handler = type("Recorder", (NodeApiRecorder,), {"requests": [], "node": json.loads(json.dumps(NODE)),
                                                    "record": record})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def recorded_requests(record: str | Path) -> list[tuple[str, str, str, Any]]:
    """The requests appended to ``record`` (none: no such file)."""
    try:
        lines = Path(record).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [tuple(json.loads(line)) for line in lines]  # type: ignore[misc]


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig (JSON is YAML) whose one context talks to ``server`` without credentials."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path
