"""docs/doctor.md's first example is what ``trtllm-liveness doctor`` prints on the 1.2.x fake: no row
of the command's output is missing from it (the example shortens the proxy class to ``P``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60), needs("console-script")]

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "doctor.md"
CLI = Path(sys.executable).parent / "trtllm-liveness"


def test_every_line_doctor_prints_on_the_v12_fake_is_in_the_example() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRTLLM_WORKER_LIVENESS"}
    env["PYTHONPATH"] = "tests/fakes/trtllm_v12"
    result = subprocess.run([str(CLI), "doctor"], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=60 * WAIT_SCALE, start_new_session=True)
    assert result.returncode == 1, result
    example = DOC.read_text().split("## Examples", 1)[1].split("```\n", 2)[1].splitlines()
    printed = [line.replace(f"{ROOT}/", "").replace("tensorrt_llm.executor.proxy.GenerationExecutorProxy", "P")
               for line in result.stdout.splitlines()]
    assert len(printed) > 30
    missing = [line for line in printed if line not in example]
    assert missing == [], f"printed by the doctor, not in {DOC.name}'s example: {missing}"
