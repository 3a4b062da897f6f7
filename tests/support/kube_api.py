"""A loopback stand-in for the Kubernetes API server's ``/api/v1/nodes/<name>``: no API server can run
here, so the official ``kubernetes`` client talks to this one, which answers with a node and records
every request (verb, path, content type, JSON body). The shape of the calls is the client's own.

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

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        type(self).requests.append((self.command, self.path, self.headers.get("Content-Type", ""), body))
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
def serve_nodes() -> Iterator[tuple[str, type[NodeApiRecorder]]]:
    """``(base URL, the recorder class whose requests list fills)``; the server is shut down and its
    thread joined on exit."""
    handler = type("Recorder", (NodeApiRecorder,), {"requests": [], "node": json.loads(json.dumps(NODE))})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig (JSON is YAML) whose one context talks to ``server`` without credentials."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path
