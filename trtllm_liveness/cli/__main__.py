"""``python -m trtllm_liveness.cli``: the ``trtllm-liveness`` command."""

import sys

from ._main import main

sys.exit(main())
