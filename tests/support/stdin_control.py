"""Control of a test child through its stdin, inside its asyncio loop (no thread blocks on it)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable


async def serve_stdin_until_quit(timeout_s: float, commands: dict[str, Callable[[], str]] | None = None) -> None:
    """Return when stdin says ``quit`` or closes, or after ``timeout_s`` (``TimeoutError``).

    Each other line naming one of ``commands`` runs it and writes its answer as one stdout line.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    known = commands or {}

    def on_stdin() -> None:
        line = sys.stdin.readline()
        command = line.strip()
        if command in known:
            sys.stdout.write(known[command]() + "\n")
            sys.stdout.flush()
        elif (not line or command == "quit") and not done.done():
            done.set_result(None)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    try:
        await asyncio.wait_for(done, timeout_s)
    finally:
        loop.remove_reader(sys.stdin.fileno())
