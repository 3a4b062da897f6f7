"""The healthy look-alike of a wedge: a process whose thread reads slowly through FUSE, in ``D`` most
of the time, yet makes progress.

A worker streaming weights from a network file system, swapping, or reading a FUSE-backed store
sleeps in uninterruptible sleep (``D``) while each read waits, and may be found in ``D`` at every
1 Hz sample; only its context switches (one per answered read) tell it from a wedge. A
:class:`~tests.support.fuse_stall.FuseStall` answers every READ of its ``slow_read_path``
after 100-300 ms; :func:`slow_reader_cmd` is the argv of a process whose helper thread reads that
file for a while, checking every byte, while its main thread waits (``S``), as a rank's main
thread serves while a loader thread reads. Tests and scripts share it::

    with FuseStall() as stall:
        child = subprocess.Popen(slow_reader_cmd(stall, 6.0), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, start_new_session=True)
        reader_tid = int(child.stdout.readline())   # the reading thread, in D most of the time
        ...                                         # watch it
        result = SlowReadResult.parse(child.stdout.readline())   # when its time is up
        child.stdin.close()                         # then it exits 0

The reader's numbers come back as one typed record (:class:`SlowReadResult`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from tests.support.fuse_stall import SLOW_READ_PERIOD, FuseStall

__all__ = ["SLOW_READER_CODE", "SlowReadResult", "slow_reader_cmd"]

# argv: the slow-read path, seconds to read, bytes per read. Prints the reading thread's id, reads
# until the time is up (each read(2) one READ request: the file is opened for direct I/O), checks
# each byte against the file's pattern, prints "<reads> <bytes> <mismatches> <longest wait in s>",
# then waits for stdin to close and exits 0 (so that it is alive, and healthy, until its owner is
# done with it). A read that fails ends the reading early; its error is printed on stderr.
SLOW_READER_CODE = f"""\
import os, sys, threading, time
PERIOD = {SLOW_READ_PERIOD}
path, seconds, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
pattern = bytes(range(PERIOD)) * (size // PERIOD + 2)
result = []
started = threading.Event()
def read():
    fd = os.open(path, os.O_RDONLY)
    started.set()
    reads = nbytes = mismatches = 0
    longest = 0.0
    offset = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            before = time.monotonic()
            data = os.pread(fd, size, offset)
            longest = max(longest, time.monotonic() - before)
            if not data:
                break
            start = offset % PERIOD
            mismatches += data != pattern[start:start + len(data)]
            reads += 1
            nbytes += len(data)
            offset += len(data)
    except OSError as exc:
        sys.stderr.write(f"slow read failed: {{exc}}\\n")
    finally:
        try:
            os.close(fd)  # the FLUSH of a released mount fails: that changes nothing read
        except OSError:
            pass
    result.append(f"{{reads}} {{nbytes}} {{mismatches}} {{longest:.3f}}")
reader = threading.Thread(target=read, name="slow-reader")
reader.start()
started.wait(60)
sys.stdout.write(f"{{reader.native_id}}\\n"); sys.stdout.flush()
reader.join()
sys.stdout.write((result[0] if result else "0 0 0 0") + "\\n"); sys.stdout.flush()
sys.stdin.read()
"""


def slow_reader_cmd(stall: FuseStall, seconds: float, read_size: int = 4096) -> list[str]:
    """argv of a process whose helper thread reads ``stall``'s slow-read file for ``seconds``,
    ``read_size`` bytes per read (one READ request each).

    Start it with ``stdin=PIPE, stdout=PIPE`` and ``start_new_session=True``. Its first line is the
    reading thread's id (printed once the file is open, so the thread reads from then on), its
    second, after ``seconds``, the :class:`SlowReadResult`; it exits 0 once stdin is closed.
    Raises ``ValueError`` for a ``seconds`` or ``read_size`` that is not positive.
    """
    if seconds <= 0 or read_size <= 0:
        raise ValueError(f"seconds and read_size must be positive, not {seconds} and {read_size}")
    return [sys.executable, "-I", "-S", "-c", SLOW_READER_CODE, stall.slow_read_path, repr(float(seconds)),
            str(read_size)]


@dataclass(frozen=True)
class SlowReadResult:
    """What a slow reader reports: completed reads, bytes, reads whose bytes were wrong, and the
    longest single read (seconds; the longest the thread waited in one READ)."""

    reads: int
    nbytes: int
    mismatches: int
    longest_read_s: float

    @classmethod
    def parse(cls, line: bytes | str) -> SlowReadResult:
        """The record from the reader's second line. Raises ``ValueError`` on anything else."""
        text = line.decode() if isinstance(line, bytes) else line
        parts = text.split()
        if len(parts) != 4:
            raise ValueError(f"not a slow reader's result: {text!r}")
        reads, nbytes, mismatches = (int(part) for part in parts[:3])
        return cls(reads, nbytes, mismatches, float(parts[3]))
