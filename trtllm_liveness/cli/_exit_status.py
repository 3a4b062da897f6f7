"""The ``trtllm-liveness`` command's exit statuses, shared by its subcommands, and their help text."""

from __future__ import annotations

__all__ = ["EXIT_DIED", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STATUS_HELP", "EXIT_USAGE",
           "EXIT_WEDGED"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIED = 3
EXIT_WEDGED = 4
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = """\
exit status:
  0    nothing to report (scan: every process healthy)
  1    runtime failure (scan: no process matched the filter, or a /proc entry was unreadable)
  2    bad arguments (watch: also a pid that does not exist or cannot be watched)
  3    a process died (watch), or a scanned process is a zombie or gone (scan: also a pid that
       does not exist, reported beside the others)
  4    a process is wedged in D or unkillable (watch), or stuck in D, unkillable or stopped (scan)
  130  interrupted (Ctrl-C)
  doctor: 0 covered, 1 degraded, 3 inert, 4 tensorrt_llm not installed, 5 invalid settings (see 'doctor --help')
  config check: 0 valid, 1 invalid (see 'config --help')
  quarantine status: 0 OK, 1 quarantined, 2 unknown (see 'quarantine --help')
  drill: 0 detected, 1 not, 3 host quarantined, 4 could not run (no TensorRT-LLM, no engine), 78 invalid settings
         (see 'drill --help')
"""
