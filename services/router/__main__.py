"""``python -m services.router``: run the router."""

from __future__ import annotations

import sys

from services.router.app import main

sys.exit(main())
