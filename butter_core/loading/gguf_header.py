"""Check a GGUF file's structure before MLX's reader sees it.

MLX reads GGUF with gguflib, which trusts every length and count in the file: a key
length of 2**62 or a tensor of 0xFFFFFFFF dimensions made ``butter generate`` die with a
segfault or an assertion, with nothing to tell the user why. ``check_gguf`` walks the
whole header (``https://github.com/ggml-org/ggml/blob/master/docs/gguf.md``) within the
file's bytes and raises a ``ModelLoadError`` naming the file and what is wrong, so MLX is
only ever given files whose every length, count, type and tensor extent is sound:

- magic ``GGUF``, version 2 or 3 (64-bit counts, as gguflib reads them);
- every key and string inside the file, valid UTF-8, at most ``MAX_STRING`` bytes; value
  and array element types known, arrays not nested, element counts that fit the file;
  keys unique; ``general.alignment``, if present, a uint32 power of two;
- every tensor: a unique UTF-8 name, 1 to ``MAX_DIMS`` dimensions of 1 to 2**31 - 1, a
  ggml type MLX converts (``TENSOR_TYPES``; others are named), rows a whole number of
  its blocks, an aligned offset, and its bytes inside the file's data section.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import attrs

from butter_core.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
"""ggml's GGML_MAX_DIMS."""
MAX_STRING = 2**31 - 1
"""MLX turns GGUF string and array lengths into C ints."""
MAX_DIM = 2**31 - 1
"""MLX's shapes hold 32-bit dimensions."""
DEFAULT_ALIGNMENT = 32

_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_VALUE_SIZES = {
    _UINT8: 1, _INT8: 1, _UINT16: 2, _INT16: 2, _UINT32: 4, _INT32: 4, _FLOAT32: 4, _BOOL: 1,
    _UINT64: 8, _INT64: 8, _FLOAT64: 8,
}  # fmt: skip
_VALUE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
                "uint64", "int64", "float64")  # fmt: skip

TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
}
"""ggml type -> (name, values per block, bytes per block), for the types MLX's reader
converts (F32/F16/I8/I16/I32 as they are, Q4_0/Q4_1/Q8_0 as MLX's affine triplets, Q4_K and
Q6_K dequantized to float16)."""

OTHER_TENSOR_TYPES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
"""ggml types that exist but that MLX's reader does not convert (named in the error)."""


@attrs.frozen
class GGUFTensorInfo:
    """One tensor as the header declares it (dimensions in ggml order: innermost first)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@attrs.frozen
class GGUFHeader:
    """What ``check_gguf`` read: version, metadata key names, tensors, where tensor data starts."""

    version: int
    keys: tuple[str, ...]
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int
    alignment: int


class _Malformed(Exception):
    """A structural problem at some offset; ``check_gguf`` turns it into a ModelLoadError."""


class _Reader:
    """Bounds-checked little-endian reads from the file's bytes (an ``mmap``, whose slices are
    copies: nothing keeps the mapping from closing)."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.offset = 0

    def take(self, size: int, what: str) -> bytes:
        if size > len(self.data) - self.offset:
            raise _Malformed(
                f"{what} at byte {self.offset} needs {size} bytes, but the file ends after {len(self.data)}"
            )
        self.offset += size
        return self.data[self.offset - size : self.offset]

    def skip(self, size: int, what: str) -> None:
        if size > len(self.data) - self.offset:
            raise _Malformed(
                f"{what} at byte {self.offset} needs {size} bytes, but the file ends after {len(self.data)}"
            )
        self.offset += size

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("Q", f"the length of {what}")
        if length > MAX_STRING:
            raise _Malformed(f"{what} at byte {self.offset - 8} claims {length} bytes (at most {MAX_STRING})")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Malformed(f"{what} at byte {self.offset - length} is not UTF-8 ({exc.reason})") from None


def check_gguf(path: str | Path) -> GGUFHeader:
    """Check the structure of the GGUF file at ``path`` (see the module docstring); raise
    ``ModelLoadError`` naming the file and the problem, else return what the header says."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes; a GGUF header alone takes 24)")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                try:
                    return _check(_Reader(mapped), size)
                except _Malformed as exc:
                    raise ModelLoadError(f"{path}: not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc.strerror or exc})") from exc


def _check(reader: _Reader, size: int) -> GGUFHeader:
    magic = bytes(reader.take(4, "the magic"))
    if magic != MAGIC:
        raise _Malformed(f"it starts with {magic!r}, not {MAGIC!r}")
    version = reader.unpack("I", "the version")
    if version not in VERSIONS:
        raise _Malformed(f"GGUF version {version} is not supported (butter reads versions {VERSIONS[0]} and {VERSIONS[1]})")
    n_tensors = reader.unpack("Q", "the tensor count")
    n_keys = reader.unpack("Q", "the metadata count")
    # Lower bounds of an entry's bytes, so that a lying count fails before any loop runs long.
    if n_keys > (size - reader.offset) // 13 or n_tensors > (size - reader.offset) // 32:
        raise _Malformed(f"{n_keys} metadata entries and {n_tensors} tensors cannot fit in {size} bytes")
    keys: dict[str, None] = {}
    alignment = DEFAULT_ALIGNMENT
    for index in range(n_keys):
        key = reader.string(f"metadata key {index}")
        if key in keys:
            raise _Malformed(f"metadata key {key!r} appears twice")
        keys[key] = None
        value_type = reader.unpack("I", f"the type of {key!r}")
        if key == "general.alignment":
            if value_type != _UINT32:
                raise _Malformed(f"general.alignment must be a uint32, not a {_type_name(value_type)}")
            alignment = reader.unpack("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise _Malformed(f"general.alignment {alignment} is not a power of two")
        else:
            _skip_value(reader, value_type, key)
    tensors: dict[str, GGUFTensorInfo] = {}
    for index in range(n_tensors):
        name = reader.string(f"the name of tensor {index}")
        if name in tensors:
            raise _Malformed(f"tensor {name!r} appears twice")
        n_dims = reader.unpack("I", f"the dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Malformed(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
        dims = tuple(reader.unpack("Q", f"a dimension of {name!r}") for _ in range(n_dims))
        if not all(1 <= dim <= MAX_DIM for dim in dims):
            raise _Malformed(f"tensor {name!r} has dimensions {list(dims)} (each must be 1 to {MAX_DIM})")
        ggml_type = reader.unpack("I", f"the type of {name!r}")
        offset = reader.unpack("Q", f"the offset of {name!r}")
        tensors[name] = GGUFTensorInfo(name, dims, ggml_type, offset)
    data_start = -(-reader.offset // alignment) * alignment
    for tensor in tensors.values():
        _check_extent(tensor, data_start, alignment, size)
    return GGUFHeader(version, tuple(keys), tuple(tensors.values()), data_start, alignment)


def _skip_value(reader: _Reader, value_type: int, key: str) -> None:
    if value_type == _STRING:
        reader.string(f"the value of {key!r}")
    elif value_type == _ARRAY:
        element_type = reader.unpack("I", f"the element type of {key!r}")
        count = reader.unpack("Q", f"the length of {key!r}")
        if element_type == _ARRAY:
            raise _Malformed(f"{key!r} is an array of arrays (not supported)")
        if count > MAX_STRING:
            raise _Malformed(f"{key!r} claims {count} elements (at most {MAX_STRING})")
        if element_type == _STRING:
            for index in range(count):
                reader.string(f"element {index} of {key!r}")
        elif element_type in _VALUE_SIZES:
            reader.skip(count * _VALUE_SIZES[element_type], f"the {count} {_type_name(element_type)} values of {key!r}")
        else:
            raise _Malformed(f"{key!r} is an array of unknown type {element_type}")
    elif value_type in _VALUE_SIZES:
        reader.skip(_VALUE_SIZES[value_type], f"the value of {key!r}")
    else:
        raise _Malformed(f"{key!r} has unknown value type {value_type}")


def _check_extent(tensor: GGUFTensorInfo, data_start: int, alignment: int, size: int) -> None:
    known = TENSOR_TYPES.get(tensor.ggml_type)
    if known is None:
        name = OTHER_TENSOR_TYPES.get(tensor.ggml_type)
        readable = ", ".join(type_name for type_name, _, _ in TENSOR_TYPES.values())
        what = f"ggml type {name}, which MLX's GGUF reader does not convert" if name else f"unknown ggml type {tensor.ggml_type}"
        raise _Malformed(f"tensor {tensor.name!r} has {what} (it reads {readable})")
    type_name, per_block, block_bytes = known
    if tensor.dims[0] % per_block:
        raise _Malformed(f"tensor {tensor.name!r}: rows of {tensor.dims[0]} are not whole {type_name} blocks of {per_block}")
    if tensor.offset % alignment:
        raise _Malformed(f"tensor {tensor.name!r}: offset {tensor.offset} is not a multiple of the alignment {alignment}")
    values = 1
    for dim in tensor.dims:
        values *= dim
    end = data_start + tensor.offset + values // per_block * block_bytes
    if end > size:
        raise _Malformed(f"tensor {tensor.name!r} ends at byte {end}, past the end of the file ({size} bytes): truncated?")


def _type_name(value_type: int) -> str:
    return _VALUE_NAMES[value_type] if 0 <= value_type < len(_VALUE_NAMES) else f"unknown type {value_type}"
