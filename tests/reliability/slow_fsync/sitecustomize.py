"""Test hook (on PYTHONPATH only in the kill trials): with ECHELON3_TEST_SLOW_FSYNC=<seconds>,
fsync of a checkpoint's temp file waits that long first, so a kill can land mid-write."""

import os

_DELAY = float(os.environ.get("ECHELON3_TEST_SLOW_FSYNC", "0") or 0)

if _DELAY > 0:
    import time

    _real_fsync = os.fsync

    def _slow_fsync(fd):
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{int(fd)}"))
        except (OSError, TypeError, ValueError):
            name = ""
        if name.endswith(".tmp") and ".tar." in name:
            time.sleep(_DELAY)
        return _real_fsync(fd)

    os.fsync = _slow_fsync
