"""TensorBoard's record checksums computed in C (echelon3.observe.tensorboard_crc): the same
values as TensorBoard's own pure-Python ones, and event files its reader accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tensorboard")
pytest.importorskip("google_crc32c")

from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: E402
from tensorboard.summary.writer import record_writer  # noqa: E402

from echelon3.observe import tensorboard_crc  # noqa: E402
from echelon3.observe.loggers import TensorBoardLogger  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_the_c_checksum_is_tensorboards_own(data):
    import google_crc32c

    assert tensorboard_crc.masked(google_crc32c.value(data)) == masked_crc32c(data)


def test_an_event_file_written_with_it_reads_back_checksums_verified(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    monkeypatch.setattr(record_writer, "masked_crc32c", masked_crc32c)  # put back after
    logger = TensorBoardLogger(tmp_path)
    assert record_writer.masked_crc32c is not masked_crc32c  # installed by the logger
    records = [{"split": "train", "epoch": 1, "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    for record in records:
        logger.log(record)
    logger.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    # The reader checks each record's header and data checksums against its own Python
    # implementation, and raises on a mismatch.
    reader = PyRecordReader_New(str(events))
    read = 0
    while True:
        try:
            reader.GetNext()
        except Exception as e:
            assert type(e).__name__ == "OutOfRangeError", e  # the end, not a bad checksum
            break
        read += 1
    assert read == 1 + len(records)  # the file version event, then one per record
    assert len(list(RawEventFileLoader(str(events)).Load())) == read
