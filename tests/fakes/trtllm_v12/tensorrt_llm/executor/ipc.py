"""Fake ``tensorrt_llm.executor.ipc`` (1.2.x): PAIR, default high-water mark, no thread check."""

from _trtllm_fake_common import ZeroMqQueueBase


class ZeroMqQueue(ZeroMqQueueBase):
    SET_HWM_ZERO = False  # this version sets no HWM (libzmq's default, 1000 messages)
    THREAD_CHECK = False  # no TLLM_LLMAPI_ZMQ_DEBUG check in this version


IpcQueue = ZeroMqQueue

__all__ = ["IpcQueue", "ZeroMqQueue"]
