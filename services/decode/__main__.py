"""``python -m services.decode``: run one decode worker."""

from __future__ import annotations

import sys

from services.decode.server import DECODE_WORKER
from services.worker.runtime import worker_main

sys.exit(worker_main(DECODE_WORKER, sys.argv[1:]))
