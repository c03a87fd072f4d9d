"""``python -m services.prefill``: run one prefill worker."""

from __future__ import annotations

import sys

from services.prefill.server import main

sys.exit(main())
