"""Fake ``tensorrt_llm.executor.ipc`` (main): PAIR, ``set_hwm(0)`` (no limit), debug thread check."""

from _trtllm_fake_common import ZeroMqQueueBase


class ZeroMqQueue(ZeroMqQueueBase):
    SET_HWM_ZERO = True
    THREAD_CHECK = True  # TLLM_LLMAPI_ZMQ_DEBUG=1: a second thread on one socket raises RuntimeError


IpcQueue = ZeroMqQueue

__all__ = ["IpcQueue", "ZeroMqQueue"]
