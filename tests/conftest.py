"""Settings for the whole suite.

Services and benches the tests start load the draft eager: with the default
`--draft-compile auto` each process would compile it (10-60 s on 2 cores).
tests/test_draft_compile.py and test_exactness.py compile it where that is the subject.
"""

from __future__ import annotations

import os

os.environ.setdefault("SPECDEC_DRAFT_COMPILE", "off")
