"""``python -m loadtest.chaos``: the chaos harness's command (``loadtest.chaos.matrix``)."""

from __future__ import annotations

import sys

from loadtest.chaos.matrix import main

sys.exit(main())
