"""``python -m services.prefill``: run one prefill worker."""

from __future__ import annotations

import sys

from services.prefill.server import PREFILL_WORKER
from services.worker.runtime import worker_main

sys.exit(worker_main(PREFILL_WORKER, sys.argv[1:]))
