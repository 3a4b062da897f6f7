"""Fake worker entry: a function of this module, so workers unpickle it from ``tensorrt_llm``."""

from __future__ import annotations

from typing import Any

from trtllm_liveness.reference._worker import worker_main as _reference_worker_main


def worker_main(**kwargs: Any) -> None:
    _reference_worker_main(**kwargs)
