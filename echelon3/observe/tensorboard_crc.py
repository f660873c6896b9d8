"""TensorBoard's record checksum in C, when ``google-crc32c`` is installed.

Without TensorFlow, TensorBoard's event writer computes every record's masked CRC-32C in
pure Python, about 15 microseconds per hundred bytes, on a thread that takes the GIL
from the one that trains. ``google-crc32c`` (in the ``tensorboard`` extra) computes the
same checksum in C; :func:`install` puts it in the writer's place. The value is
TensorBoard's own, bit for bit (tests/test_tensorboard_crc.py compares them); without
the package nothing changes.
"""

from __future__ import annotations

_MASK_DELTA = 0xA282EAD8  # the masking TFRecord files use (TensorFlow's record format)


def masked(crc: int) -> int:
    """TFRecord's mask over a CRC-32C."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def install() -> bool:
    """Compute TensorBoard's record checksums in C; False when ``google-crc32c`` is
    missing, or has only its pure-Python fallback (then nothing changes)."""
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", "c") != "c":
        return False
    value = google_crc32c.value
    record_writer.masked_crc32c = lambda data: masked(value(data))
    return True
