"""``python -m services.decode``: run one decode worker."""

from __future__ import annotations

import sys

from services.decode.server import main

sys.exit(main())
