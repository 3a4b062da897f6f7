"""A Kubernetes API stand-in for one test host: ``python -m tests.programs.kube_node_api PORT RECORD``.

Serves :mod:`tests.support.kube_api`'s node answers on ``127.0.0.1:PORT`` of the network namespace
it runs in (a test host's own loopback: only that host's processes reach it), appends each request
to the file ``RECORD`` (one JSON line), prints ``ready`` once it listens and serves until it is
killed (with its host).
"""

from __future__ import annotations

import sys
import time

from tests.support.kube_api import serve_nodes


def main(port: int, record: str) -> int:
    with serve_nodes(port, record):
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
