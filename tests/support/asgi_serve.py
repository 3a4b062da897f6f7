"""A minimal HTTP/1.1 GET server for one ASGI app mounted at ``/prometheus/metrics``: stands in for
uvicorn (not installed here) where tests serve a Prometheus page the way trtllm-serve mounts it.
Imports nothing of prometheus_client (some tests check that it was not imported)."""

from __future__ import annotations

import asyncio
from typing import Any

MOUNT = "/prometheus/metrics"


async def handle(app: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        method, target, _version = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        path, _, query = target.partition("?")
        if method != "GET" or not path.startswith(MOUNT):
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        scope = {"type": "http", "method": "GET", "path": path[len(MOUNT):] or "/",
                 "query_string": query.encode(), "headers": []}
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
        headers = b"".join(k + b": " + v + b"\r\n" for k, v in start["headers"])
        writer.write(b"HTTP/1.1 %d OK\r\n" % start["status"] + headers
                     + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    finally:
        await writer.drain()
        writer.close()
