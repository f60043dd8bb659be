"""Parse a GGUF file's header, metadata and tensor index, bounded against the file.

gguf-py's ``GGUFReader`` trusts every count and length it reads: a corrupted byte in a
key/value count, an array or string length, a dimension or a data offset makes it loop
for hours, allocate without limit, or fail with a bare numpy/unicode error. The reader
here is the same parser (same ``fields`` and ``tensors``) with every such number checked
against the bytes actually left before a loop or an allocation uses it, so a damaged
file ends in a one-line :class:`~toygraph.errors.GGUFError` naming the key or tensor.

It is also leaner on metadata: the stock reader slices its ``np.memmap`` once per
metadata value; for a 49k-token vocabulary that is ~250k memmap views, each dragging a
Python attribute dict and a fresh byte-order dtype (~160 MB resident for SmolLM2, 2.5 s).
Parsing from a plain ndarray view of the same mapping gives the same values in ~40 MB
and 0.5 s. An array's per-element parts are not built at all: :class:`ArrayParts` makes
each on demand from the element offsets (a 151,936-token vocabulary and its merges held
~125 MB of numpy views as lists). ``mmap`` keeps the original memmap for tensor data.

>>> r = BoundedReader("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
>>> len(r.tensors), r.fields["general.architecture"].contents()  # doctest: +SKIP
(272, 'llama')
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, ReaderField

from toygraph.errors import GGUFError

GGML_MAX_DIMS = 4
# The fewest bytes one entry can take, to bound counts by the bytes left before looping:
_MIN_KV_BYTES = 8 + 4 + 1                # key length, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_HEADER_BYTES = 4 + 4 + 8 + 8            # magic, version, tensor count, kv count


class PastEnd(GGUFError):
    """Something the file declares (a string, an array, tensor data) lies past its end."""


class ArrayParts:
    """A metadata array's parts as gguf-py's reader lists them -- the element type, the
    count, then one part per scalar or a length and a bytes part per string -- made on
    demand from the file's bytes and the elements' offsets, so ``ReaderField.contents()``
    reads them as ever while the field itself holds two small index arrays."""

    def __init__(self, head: list, *, values: np.ndarray | None = None, data=None,
                 starts: np.ndarray | None = None, lengths: np.ndarray | None = None):
        """Scalars: their ``values``; strings: the file's ``data`` with each string's
        ``starts`` (of its length field) and ``lengths``."""
        self.head, self.values = head, values
        self.data, self.starts, self.lengths = data, starts, lengths

    def __len__(self) -> int:
        if self.values is not None:
            return len(self.head) + len(self.values)
        return len(self.head) + 2 * len(self.starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if i < len(self.head):
            return self.head[i]
        k = i - len(self.head)
        if self.values is not None:
            return self.values[k:k + 1]
        pos = int(self.starts[k // 2])
        if k % 2 == 0:
            return self.data[pos:pos + 8].view(np.uint64)
        return self.data[pos + 8:pos + 8 + int(self.lengths[k // 2])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _utf8(raw: np.ndarray, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise GGUFError(f"{what} is not valid UTF-8") from None


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(int(raw))
    except ValueError:
        raise GGUFError(f"{what} has unknown value type id {int(raw)}") from None


def _check_header(path) -> None:
    """Magic and version before mapping anything (an empty file cannot even be mapped)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if head[:4] != b"GGUF":
        raise GGUFError(f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER_BYTES:
        raise PastEnd(f"{len(head)} bytes, shorter than a GGUF header ({_HEADER_BYTES} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:
        raise GGUFError("big-endian GGUF files are not supported")
    if version not in READER_SUPPORTED_VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported "
                        f"(supported: {', '.join(map(str, READER_SUPPORTED_VERSIONS))})")


class BoundedReader(GGUFReader):
    """GGUFReader that checks every count, length, shape and offset against the file."""

    def __init__(self, path: str | os.PathLike, mode: str = "r"):
        _check_header(path)
        super().__init__(path, mode)

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mm: np.memmap) -> None:  # GGUFReader.__init__ assigns the memmap here
        self.mmap = mm
        self._plain_data = mm.view(np.ndarray)
        self._size = len(mm)

    # -- primitive reads: never past the end ------------------------------------------
    def _get(self, offset, dtype, count=1, override_order=None):
        dt, offset, count = np.dtype(dtype), int(offset), int(count)
        end = offset + dt.itemsize * count
        if count < 0 or end > self._size:
            raise PastEnd(f"reading {count} x {dt} at byte {offset} runs past the end of the "
                          f"file ({self._size} bytes)")
        return self._plain_data[offset:end].view(dt)

    def _get_str(self, offset):
        length = self._get(offset, np.uint64)
        left = self._size - int(offset) - 8
        if int(length[0]) > left:
            raise PastEnd(f"string of {int(length[0])} bytes at byte {offset}, only {left} "
                          f"bytes left in the file")
        return length, self._get(offset + 8, np.uint8, length[0])

    def _check_count(self, what: str, count: int, offset: int, min_bytes: int) -> None:
        left = self._size - int(offset)
        if int(count) > left // min_bytes:
            raise PastEnd(f"{what} {int(count)} cannot fit in the {left} bytes left at byte "
                          f"{offset} (each needs at least {min_bytes})")

    # -- metadata -----------------------------------------------------------------------
    def _build_fields(self, offs, count):
        self._check_count("kv_count", count, offs, _MIN_KV_BYTES)
        for i in range(int(count)):
            start = offs
            try:
                klen, kdata = self._get_str(offs)
            except GGUFError as e:
                raise type(e)(f"metadata key #{i}: {e}") from None
            key = _utf8(kdata, f"metadata key #{i}")
            offs += 8 + len(kdata)
            try:
                raw_type = self._get(offs, np.uint32)
                size, parts, idxs, types = self._get_field_parts(offs + 4, raw_type[0])
            except GGUFError as e:
                raise type(e)(f"metadata {key!r}: {e}") from None
            if isinstance(parts, ArrayParts):   # the key's three parts come first
                parts.head = [klen, kdata, raw_type] + parts.head
                self._push_field(ReaderField(start, key, parts, range(idxs.start + 3, idxs.stop + 3,
                                                                    idxs.step), types), skip_sum=True)
            else:
                self._push_field(ReaderField(start, key, [klen, kdata, raw_type] + parts,
                                             [j + 3 for j in idxs], types), skip_sum=True)
            offs += 4 + size
        return offs

    def _get_field_parts(self, orig_offs, raw_type):
        """One metadata value as the stock reader's (size, parts, data indices, types), with
        a known value type and strings that are UTF-8 (the spec says so; checked once here
        so reading a value never fails later)."""
        gtype = _value_type(raw_type, "value")
        if gtype == GGUFValueType.ARRAY:
            return self._array_parts(orig_offs)
        if gtype == GGUFValueType.STRING:
            length, raw = self._get_str(orig_offs)
            _utf8(raw, "string value")
            return 8 + len(raw), [length, raw], [1], [gtype]
        value = self._get(orig_offs, self.gguf_scalar_to_np[gtype])
        return value.nbytes, [value], [0], [gtype]

    def _array_parts(self, orig_offs):
        """An array, its length checked against the bytes left before the element loop.
        Parts as the stock reader makes them (one per scalar, length + bytes per string),
        built from one bounded read (scalars) or a walk with one bounds check per string,
        instead of a recursive call per element (SmolLM2's vocabulary: 150k elements)."""
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, n = _value_type(raw_itype[0], "array element"), int(alen[0])
        if itype == GGUFValueType.ARRAY:
            raise GGUFError("arrays of arrays are not supported (nor by llama.cpp)")
        width = 8 if itype == GGUFValueType.STRING else np.dtype(self.gguf_scalar_to_np[itype]).itemsize
        pos = orig_offs + 12
        self._check_count(f"array of {itype.name} with length", n, pos, width)
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])
        if itype != GGUFValueType.STRING:
            values = self._get(pos, self.gguf_scalar_to_np[itype], n)
            parts = ArrayParts([raw_itype, alen], values=values)
            return 12 + values.nbytes, parts, range(2, 2 + n), types
        data = self._plain_data
        starts, lengths = np.empty(n, np.int64), np.empty(n, np.int64)
        for k in range(n):
            if pos + 8 > self._size:
                raise PastEnd(f"string #{k} of the array starts past the end of the file")
            length = int(data[pos:pos + 8].view(np.uint64)[0])
            end = pos + 8 + length
            if end > self._size:
                raise PastEnd(f"string #{k} of the array ({length} bytes) runs past "
                              f"the end of the file ({self._size} bytes)")
            _utf8(data[pos + 8:end], f"string #{k} of the array")
            starts[k], lengths[k] = pos, length
            pos = end
        parts = ArrayParts([raw_itype, alen], data=data, starts=starts, lengths=lengths)
        return pos - orig_offs, parts, range(3, 3 + 2 * n, 2), types

    def _push_field(self, field, skip_sum=False):
        if field.name in self.fields:
            raise GGUFError(f"duplicate metadata key {field.name!r}")
        return super()._push_field(field, skip_sum)

    # -- tensor index ---------------------------------------------------------------------
    def _build_tensor_info(self, offs, count):
        self._check_count("tensor_count", count, offs, _MIN_TENSOR_INFO_BYTES)
        align = self.fields.get("general.alignment")
        if align is not None:
            value = int(align.parts[-1][0]) if align.types == [GGUFValueType.UINT32] else 0
            if value == 0 or value & (value - 1):
                raise GGUFError("general.alignment must be a uint32 power of two, got "
                                f"{align.contents()!r} ({align.types[0].name})")
        return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs):
        try:
            name_len, name_data = self._get_str(orig_offs)
        except GGUFError as e:
            raise type(e)(f"tensor name at byte {orig_offs}: {e}") from None
        name = _utf8(name_data, f"tensor name at byte {orig_offs}")
        offs = orig_offs + 8 + len(name_data)
        try:
            n_dims = self._get(offs, np.uint32)
            if not 1 <= int(n_dims[0]) <= GGML_MAX_DIMS:
                raise GGUFError(f"{int(n_dims[0])} dimensions (1 to {GGML_MAX_DIMS} allowed)")
            dims = self._get(offs + 4, np.uint64, n_dims[0])
            if any(d < 1 or d >= 1 << 62 for d in dims.tolist()):
                raise GGUFError(f"bad dimensions {dims.tolist()}")
            offs += 4 + dims.nbytes
            raw_dtype, offset_tensor = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
        except GGUFError as e:
            raise type(e)(f"tensor {name!r}: {e}") from None
        return ReaderField(orig_offs, name,
                           [name_len, name_data, n_dims, dims, raw_dtype, offset_tensor],
                           [1, 3, 4, 5])

    def _build_tensors(self, start_offs, fields):
        """Type, row length, alignment and extent of each tensor's data, in Python ints
        (numpy's uint64 product of the dims would wrap), before the stock reader maps it."""
        seen = set()
        extents = []   # (first byte, end, name): two tensors must never share bytes
        for field in fields:
            _, _, _, dims, raw_type, offset = field.parts
            name = field.name
            if name in seen:
                raise GGUFError(f"duplicate tensor {name!r}")
            seen.add(name)
            try:
                qt = GGMLQuantizationType(int(raw_type[0]))
                block, type_size = GGML_QUANT_SIZES[qt]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name!r} has unknown ggml type id {int(raw_type[0])}") from None
            shape = [int(d) for d in dims.tolist()]
            if shape[0] % block:
                raise GGUFError(f"tensor {name!r}: rows of {shape[0]} elements are not a whole "
                                f"number of {qt.name} blocks ({block})")
            if int(offset[0]) % self.alignment:
                raise GGUFError(f"tensor {name!r}: data offset {int(offset[0])} is not a "
                                f"multiple of the alignment ({self.alignment})")
            n_elements = 1
            for d in shape:
                n_elements *= d
            end = int(start_offs) + int(offset[0]) + n_elements // block * type_size
            if end > self._size:
                raise PastEnd(f"tensor {name!r} data ends at byte {end}, past the end of the "
                              f"file ({self._size} bytes)")
            if end > int(start_offs) + int(offset[0]):
                extents.append((int(start_offs) + int(offset[0]), end, name))
        extents.sort()
        for (_, end, a), (start, _, b) in zip(extents, extents[1:]):
            if start < end:   # llama.cpp's loader refuses this too: one tensor's writes
                raise GGUFError(f"tensors {a!r} and {b!r} overlap in the file (the data of "
                                f"{b!r} starts at byte {start}, before {a!r} ends at {end})")
        super()._build_tensors(start_offs, fields)
