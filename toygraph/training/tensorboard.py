"""A TensorBoard event file of scalars, written with no TensorFlow, PyTorch or protobuf.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, the bytes,
their masked CRC-32C), each an ``Event`` protocol buffer. Scalars need only a few fields,
encoded here by hand (tensorflow/core/util/event.proto, summary.proto):

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record names the format (``file_version: "brain.Event:2"``), as TensorFlow's
writer does. tensorboard's own reader (EventAccumulator) reads the files back in the tests.

>>> w = ScalarWriter("runs/x/tensorboard")            # doctest: +SKIP
>>> w.add_scalars({"train/loss": 2.5}, step=1)          # doctest: +SKIP
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from toygraph.atomic import open_append


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1   # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc(length)) + data
            + struct.pack("<I", masked_crc(data)))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # int64 as protobuf writes it (two's complement)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """An Event message: wall time, step, and a file version or a summary of scalars."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode())
                                       + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


class ScalarWriter:
    """Appends scalar summaries to a new event file in ``logdir`` (one file per writer, as
    TensorBoard expects: a resumed run adds a file beside the earlier ones)."""

    def __init__(self, logdir):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.logdir / name
        self.fd = open_append(self.path)   # a fresh name; never through a planted link
        os.write(self.fd, record(event(now, file_version="brain.Event:2")))

    def add_scalars(self, scalars: dict[str, float], step: int, wall_time: float | None = None):
        """One event holding every scalar of a step (each written as float32)."""
        if scalars:
            data = event(time.time() if wall_time is None else wall_time, step, scalars=scalars)
            os.write(self.fd, record(data))

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
