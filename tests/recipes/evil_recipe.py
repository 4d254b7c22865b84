"""A module no machine should import: importing it leaves a marker file (``TT_EVIL_MARKER``), as
code from a stranger could do anything. Tests check the marker never appears."""

from __future__ import annotations

import os
from pathlib import Path

Path(os.environ.get("TT_EVIL_MARKER", "/tmp/tensorturn-evil-imported")).write_text("imported\n")


class Evil:  # never reached: the import above is the harm
    pass
