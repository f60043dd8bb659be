"""The hand-written TensorBoard event files (toygraph/training/tensorboard.py), read back
with tensorboard's own reader."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from toygraph.training.tensorboard import ScalarWriter, crc32c, masked_crc, record


def test_crc32c_check_values():
    """CRC-32C's published check value, and RFC 3720's test vectors (iSCSI)."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def test_record_framing():
    data = b"hello"
    r = record(data)
    assert struct.unpack("<Q", r[:8])[0] == 5 and r[12:17] == data
    assert struct.unpack("<I", r[8:12])[0] == masked_crc(r[:8])
    assert struct.unpack("<I", r[17:])[0] == masked_crc(data)


def test_tensorboard_reads_the_scalars_back(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    w = ScalarWriter(tmp_path)
    written = {s: {"train/loss": 3.0 / s, "train/lr": 1e-3 * s, "eval/big": 1e30 * s}
               for s in (1, 2, 3, 1000000)}
    for step, values in written.items():
        w.add_scalars(values, step=step, wall_time=1700000000.5 + step)
    w.add_scalars({"train/loss": float("nan")}, step=2000000)
    w.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/big", "train/loss", "train/lr"]
    for tag in ("train/loss", "train/lr", "eval/big"):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = [(s, float(np.float32(v[tag]))) for s, v in written.items()]
        if tag == "train/loss":
            assert np.isnan(got.pop()[1])
        assert got == want
    assert [e.wall_time for e in acc.Scalars("train/lr")] == [1700000000.5 + s for s in written]
    assert acc.file_version == 2.0   # "brain.Event:2"; the reader checks both CRCs of every record
