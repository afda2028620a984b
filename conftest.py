"""Test-session settings shared by every package's tests (pytest loads this from the rootdir).

Rich sizes its consoles from ``COLUMNS`` when output is not a terminal (80 otherwise), and the CLI
creates its consoles at import. Messages that name long temporary paths (``/tmp/pytest-of-root/
pytest-N/popen-gw1/...`` under xdist) would then wrap at a place that depends on the path's length,
so assertions on a message's first line would pass or fail by chance. One wide, fixed width makes
them deterministic; it is set before any test module imports the CLI.
"""

from __future__ import annotations

import os

os.environ["COLUMNS"] = "1000"
