"""A GGUF file's metadata and tensor table, read in one pass (gpu/formats/gguf.py's reader).

gguf-py's GGUFReader makes a numpy view per part of every field: for a vocabulary's
strings and merges (about 250k parts for SmolLM2's 49k tokens) that was 1.4 s of every
process's start (a server, each frontend, each tensor-parallel rank). Here the header is
walked over a bytes-like view with struct, string arrays are kept as (offset, length)
pairs and decoded when a field is asked for, and numeric arrays are one np.frombuffer.

The result has the parts of GGUFReader that tailrace reads, with the same values
(tests/gpu/test_gguf_reader.py holds them equal on the bundled model and on files gguf-py
writes): `fields[key].contents()` and `tensors` of (name, tensor_type, shape, n_elements,
n_bytes, data_offset, data), `data` a view of the mapped file shaped as gguf-py shapes it.
Little-endian files only (what llama.cpp writes); a big-endian one is a clear error.

The type ids and block sizes are ggml's (gguf-py's constants, held equal to them by the
test): importing any part of the gguf package runs its __init__, which imports its
vocabulary module and mistral-common, 0.24 s of every process's start.
"""
from __future__ import annotations

import enum
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# ggml's tensor types: name -> (id, elements per block, bytes per block)
_GGML_TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q8_1": (9, 32, 40),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_K": (15, 256, 292),
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98),
    "IQ1_S": (19, 256, 50), "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110),
    "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136), "I8": (24, 1, 1), "I16": (25, 1, 2),
    "I32": (26, 1, 4), "I64": (27, 1, 8), "F64": (28, 1, 8), "IQ1_M": (29, 256, 56),
    "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66), "MXFP4": (39, 32, 17),
    "NVFP4": (40, 64, 36), "Q1_0": (41, 128, 18),
}
GGMLQuantizationType = enum.IntEnum("GGMLQuantizationType", {k: v[0] for k, v in _GGML_TYPES.items()})
GGML_QUANT_SIZES = {GGMLQuantizationType(v[0]): v[1:] for v in _GGML_TYPES.values()}

_MAGIC = 0x46554747            # b"GGUF" read as a little-endian uint32
_VERSIONS = (2, 3)
# scalar value types: (struct format, numpy dtype)
_SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# tensor types numpy holds as their own dtype; every other type is its blocks' bytes
_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class Field:
    """One metadata value: a scalar, a string, or an array of either."""

    __slots__ = ("name", "_value", "_strings", "_buf")

    def __init__(self, name: str, value: Any = None, strings: list[tuple[int, int]] | None = None,
                 buf: memoryview | None = None) -> None:
        self.name = name
        self._value = value            # decoded value (scalars, strings, numeric arrays)
        self._strings = strings        # (offset, length) of a string array's items in buf
        self._buf = buf

    def contents(self) -> Any:
        """The value as gguf-py's ReaderField.contents() gives it: a Python scalar, a str,
        or a list of them."""
        if self._strings is not None:
            buf = self._buf
            self._value = [str(buf[o:o + n], "utf-8") for o, n in self._strings]
            self._strings = self._buf = None
        if isinstance(self._value, np.ndarray):
            self._value = self._value.tolist()
        return self._value


class Tensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray          # ggml's dims, fastest first (uint64), as gguf-py's
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray           # row-major view of the mapped file


class GGUFHeader:
    """`fields` (an insertion-ordered dict of Field) and `tensors` (a list of Tensor) of
    the GGUF file at path, its tensor data mapped read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mapped = np.memmap(self.path, mode="r")
        self.data = mapped.view(np.ndarray)     # a plain view: np.memmap's slicing is slow
        self._buf = memoryview(self.data).cast("B")
        self._off = 0
        try:
            self._read()
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path.name}: the GGUF header is cut short or damaged "
                             f"at byte {self._off} ({e})") from None
        finally:
            del self._buf

    def _read(self) -> None:
        buf = self._buf
        magic, version = self._unpack("<II")
        if magic != _MAGIC:
            raise ValueError(f"{self.path.name}: not a GGUF file (magic {magic:#x})")
        if version not in _VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            if swapped in _VERSIONS:
                raise ValueError(f"{self.path.name}: a big-endian GGUF file, which is not supported")
            raise ValueError(f"{self.path.name}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(key, self._value_type(key, vtype))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=self._off).copy()
            self._off += 8 * n_dims
            ttype, offset = self._unpack("<IQ")
            if ttype not in GGML_QUANT_SIZES:
                raise ValueError(f"{self.path.name}: tensor {name!r} has ggml type {ttype}, "
                                 "which this version does not know")
            infos.append((name, dims, GGMLQuantizationType(ttype), offset))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.contents()) if align_field is not None else 32
        start = -(-self._off // align) * align
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise ValueError(f"{self.path.name}: tensor {name!r} is listed twice")
            seen.add(name)
            n_elems = int(np.prod(dims))
            block, type_bytes = GGML_QUANT_SIZES[ttype]
            n_bytes = n_elems * type_bytes // block
            np_dims = tuple(reversed(dims.tolist()))
            at = start + offset
            if at + n_bytes > len(self.data):
                raise ValueError(f"{self.path.name}: tensor {name!r} runs past the end of the file "
                                 "(a truncated download?)")
            dtype = _TENSOR_DTYPES.get(ttype)
            if dtype is None:
                byte_dims = (*np_dims[:-1], np_dims[-1] // block * type_bytes)
                data = self.data[at:at + n_bytes].reshape(byte_dims)
            else:
                data = self.data[at:at + n_bytes].view(dtype).reshape(np_dims)
            self.tensors.append(Tensor(name, ttype, dims, n_elems, n_bytes, at, data))

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._off)
        start = self._off + 8
        self._off = start + n
        return str(self._buf[start:start + n], "utf-8")

    def _value_type(self, key: str, vtype: int) -> GGUFValueType:
        if vtype not in GGUFValueType.__members__.values():
            raise ValueError(f"{self.path.name}: field {key!r} has unknown value type {vtype}")
        return GGUFValueType(vtype)

    def _value(self, key: str, vtype: GGUFValueType) -> Field:
        if vtype == GGUFValueType.STRING:
            return Field(key, self._string())
        if vtype in _SCALARS:
            fmt, _ = _SCALARS[vtype]
            (v,) = self._unpack(fmt)
            return Field(key, v)
        # the one type left (_value_type took only known ones): an array
        etype, count = self._unpack("<IQ")
        etype = self._value_type(key, etype)
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._off)
            self._off += arr.nbytes
            return Field(key, arr)
        if etype == GGUFValueType.STRING:
            # (offset, length) per item; each item's length is 8 little-endian bytes before it
            spans, buf, off, unpack = [], self._buf, self._off, struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, off)
                spans.append((off + 8, n))
                off += 8 + n
            self._off = off
            return Field(key, strings=spans, buf=buf)
        # arrays of arrays: gguf-py reads them but no tailrace field has one; decoded whole
        return Field(key, [self._value(key, etype).contents() for _ in range(count)])
