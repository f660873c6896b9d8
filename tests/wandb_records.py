"""What an offline W&B run wrote, read back from its ``.wandb`` file.

wandb 0.31 has no Python reader of its transaction log any more (the writer lives in
``wandb-core``), so this reads the file's framing here and leaves every record to
wandb's own protobuf classes (``wandb.proto.wandb_internal_pb2.Record``). The framing is
LevelDB's log format behind a 7-byte header: ``:W&B``, the magic ``0xBEE1`` and a version
byte; then 32 KiB blocks of chunks, each ``crc32c (4) | length (2, LE) | type (1) | data``,
type 1 a whole record, 2 / 3 / 4 its first, middle and last pieces.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK = 7  # crc, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every ``Record`` of a ``.wandb`` file, in order."""
    data = Path(path).read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a W&B transaction log"
    out, pos, pieces = [], len(HEADER), b""
    while pos + CHUNK <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + CHUNK])
        if kind == 0 and length == 0:  # zero fill at the end of a block
            pos += left
            continue
        chunk = data[pos + CHUNK:pos + CHUNK + length]
        pos += CHUNK + length
        pieces = chunk if kind in (FULL, FIRST) else pieces + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
    return out


def _value(item):
    return json.loads(item.value_json)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of run ``run_id`` under ``wandb_dir``, one per attempt, oldest
    first. An offline run resumed in a new process gets a folder of its own,
    ``offline-run-<time>-<id>``, with ``-1``, ``-2``... added within the same second."""
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for folder in Path(wandb_dir, "wandb").glob(f"offline-run-*-{run_id}*"):
        match = name.fullmatch(folder.name)
        if match and (folder / f"run-{run_id}.wandb").is_file():
            found.append(((match[1], int(match[2] or 0)), folder / f"run-{run_id}.wandb"))
    return [path for _, path in sorted(found)]


def history(paths: list[Path]) -> list[dict]:
    """The history rows the files hold, in the order they were sent: ``{_step, key: value}``
    (wandb's own ``_runtime`` / ``_timestamp`` left out)."""
    rows = []
    for path in paths:
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                row = {_key(item): _value(item) for item in record.history.item}
                rows.append({k: v for k, v in row.items() if k not in ("_runtime",
                                                                        "_timestamp")})
    return rows


def summary(paths: list[Path]) -> dict:
    """The run's summary as the files leave it (later updates over earlier ones)."""
    out: dict = {}
    for path in paths:
        for record in records(path):
            if record.WhichOneof("record_type") == "summary":
                out.update({_key(item): _value(item) for item in record.summary.update})
                for item in record.summary.remove:
                    out.pop(_key(item), None)
    return out


def runs(paths: list[Path]) -> list:
    """The ``RunRecord`` of each attempt (id, project, name, config...)."""
    return [r.run for path in paths for r in records(path)
            if r.WhichOneof("record_type") == "run"]
