"""A pure-Python reader of reshard rank files and manifests (format version 1).

Written from ``formats/rank-file.md`` and ``formats/manifest.md`` alone, independently of
the C++ reader, so that tests can check the converter's output against the spec rather
than against itself. It has no dependency on the compiled extension; it raises the package's
own error classes (reshard.errors, pure Python): a broken file is a CorruptFileError, as the
C++ reader's is.

Hashing (XXH3-64) and zstd decoding use, in order of preference, the ``xxhash`` /
``zstandard`` Python modules when importable, else the system ``libxxhash`` / ``libzstd``
shared libraries through ctypes (the C++ build needs both, so they are normally present).
When neither is available, checksum checks raise :class:`MissingBackendError` (pass
``verify=False`` to read without them) and zstd tensors cannot be decoded.

``torch`` is imported lazily, only by :func:`read_tensor` / :meth:`RankFile.read_tensor`.

Typical use::

    import reference_reader as rf
    f = rf.RankFile.open("out/fsdp2-ws8/rank-00003-of-00008.reshard")
    f.header["layout"]["key"]              # "fsdp2-ws8"
    t = f.read_tensor("model.embed_tokens.weight")   # torch.Tensor of local_shape
    raw = f.read_bytes("model.norm.weight")          # decoded bytes, checksums verified
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

from reshard.errors import CorruptFileError

__all__ = [
    "FormatError",
    "ChecksumError",
    "MissingBackendError",
    "MAGIC",
    "FORMAT_VERSION",
    "DATA_OFFSET",
    "ALIGNMENT",
    "PREAMBLE_SIZE",
    "MAX_HEADER_SIZE",
    "DTYPE_BITS",
    "Preamble",
    "Shard",
    "TensorEntry",
    "RankFile",
    "xxh3_64",
    "hex16",
    "have_xxh3",
    "have_zstd",
    "zstd_decompress",
    "chunk_rows",
    "rank_file_name",
    "parse_rank_file_name",
    "combine_chunk_checksums",
    "safetensors_file_fingerprint",
    "torch_zip_tensors",
    "torch_zip_file_fingerprint",
    "weight_file_fingerprint",
    "source_fingerprint",
    "read_header",
    "read_tensor",
    "torch_dtype",
    "read_manifest",
    "layout_rank_files",
]

# ---------------------------------------------------------------------------------------
# Constants of formats/rank-file.md

MAGIC = b"\x89RSHD\r\n\x1a"
FORMAT_VERSION = 1
PREAMBLE_SIZE = 64
PREAMBLE_HASHED = 56
DATA_OFFSET = 4096
ALIGNMENT = 4096
MAX_HEADER_SIZE = 256 * 1024 * 1024
U64_MAX = (1 << 64) - 1
_PREAMBLE = struct.Struct("<8sIIQQQQQQ")
assert _PREAMBLE.size == PREAMBLE_SIZE

_KEY_RE = re.compile(r"[A-Za-z0-9._-]+\Z")
_HEX16_RE = re.compile(r"[0-9a-f]{16}\Z")
_RANK_FILE_RE = re.compile(r"rank-(\d{5})-of-(\d{5})\.reshard\Z")

# safetensors dtype name -> bits per element
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "U16": 16,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "U32": 32,
    "I32": 32,
    "F32": 32,
    "U64": 64,
    "I64": 64,
    "F64": 64,
    "C64": 64,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
}

# safetensors dtype name -> torch dtype attribute name (resolved lazily)
_TORCH_DTYPE_NAMES: Dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


class FormatError(CorruptFileError, ValueError):
    """The file breaks the spec. The message names the file and the field."""


class ChecksumError(FormatError):
    """Decoded data (or a header/preamble) does not hash to the recorded XXH3-64."""


class MissingBackendError(RuntimeError):
    """No XXH3 or zstd implementation is available in this interpreter."""


def _fail(path: str, field_name: str, found: Any, expected: Any) -> NoReturn:
    raise FormatError(f"{path}: {field_name}: found {found}, expected {expected}")


# ---------------------------------------------------------------------------------------
# Hash and zstd backends

_xxh3_impl = None
_zstd_impl = None


def _load_xxh3():
    global _xxh3_impl
    if _xxh3_impl is not None:
        return _xxh3_impl
    try:
        import xxhash  # type: ignore

        _xxh3_impl = lambda data: xxhash.xxh3_64_intdigest(bytes(data))  # noqa: E731
        return _xxh3_impl
    except ImportError:
        pass
    names = [ctypes.util.find_library("xxhash"), "libxxhash.so.0", "libxxhash.so"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.XXH3_64bits
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

        def impl(data, _fn=fn):
            b = bytes(data)
            return int(_fn(b, len(b)))

        _xxh3_impl = impl
        return impl
    _xxh3_impl = False
    return False


def have_xxh3() -> bool:
    """True when XXH3-64 can be computed (xxhash module or system libxxhash)."""
    return bool(_load_xxh3())


def xxh3_64(data: Union[bytes, bytearray, memoryview]) -> int:
    """XXH3-64 with seed 0."""
    impl = _load_xxh3()
    if not impl:
        raise MissingBackendError(
            "XXH3-64 is unavailable: install the 'xxhash' Python package or the system "
            "libxxhash (apt-get install libxxhash0), or read with verify=False"
        )
    return impl(data)


def hex16(value: int) -> str:
    """A u64 as exactly 16 lower-case hex digits (printf %016llx)."""
    return f"{value:016x}"


def _load_zstd():
    global _zstd_impl
    if _zstd_impl is not None:
        return _zstd_impl
    try:
        import zstandard  # type: ignore

        def impl(frame: bytes, expected: int) -> bytes:
            params = zstandard.get_frame_parameters(frame)
            if params.content_size != expected:
                raise FormatError(
                    f"zstd frame declares {params.content_size} bytes, expected {expected}"
                )
            out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
            return out

        _zstd_impl = impl
        return impl
    except ImportError:
        pass
    names = [ctypes.util.find_library("zstd"), "libzstd.so.1", "libzstd.so"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            get_size = lib.ZSTD_getFrameContentSize
            decompress = lib.ZSTD_decompress
            is_error = lib.ZSTD_isError
            err_name = lib.ZSTD_getErrorName
            frame_size = lib.ZSTD_findFrameCompressedSize
        except (OSError, AttributeError):
            continue
        get_size.restype = ctypes.c_ulonglong
        get_size.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        decompress.restype = ctypes.c_size_t
        decompress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        is_error.restype = ctypes.c_uint
        is_error.argtypes = [ctypes.c_size_t]
        err_name.restype = ctypes.c_char_p
        err_name.argtypes = [ctypes.c_size_t]
        frame_size.restype = ctypes.c_size_t
        frame_size.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

        def impl(frame: bytes, expected: int, _lib=lib) -> bytes:
            content = get_size(frame, len(frame))
            if content >= (1 << 64) - 2:  # ZSTD_CONTENTSIZE_UNKNOWN / _ERROR
                raise FormatError("zstd frame has no valid content size")
            if content != expected:
                raise FormatError(f"zstd frame declares {content} bytes, expected {expected}")
            used = frame_size(frame, len(frame))
            if is_error(used) or used != len(frame):
                raise FormatError(
                    f"zstd frame of {len(frame)} bytes is not exactly one complete frame"
                )
            buf = ctypes.create_string_buffer(max(expected, 1))
            n = decompress(buf, expected, frame, len(frame))
            if is_error(n):
                raise FormatError(f"zstd frame does not decode: {err_name(n).decode()}")
            if n != expected:
                raise FormatError(f"zstd frame decodes to {n} bytes, expected {expected}")
            return buf.raw[:expected]

        _zstd_impl = impl
        return impl
    _zstd_impl = False
    return False


def have_zstd() -> bool:
    """True when zstd frames can be decoded (zstandard module or system libzstd)."""
    return bool(_load_zstd())


def zstd_decompress(frame: bytes, expected: int) -> bytes:
    """Decodes one complete zstd frame that must decode to exactly ``expected`` bytes."""
    impl = _load_zstd()
    if not impl:
        raise MissingBackendError(
            "zstd decoding is unavailable: install the 'zstandard' Python package or the "
            "system libzstd (apt-get install libzstd1)"
        )
    return impl(bytes(frame), expected)


# ---------------------------------------------------------------------------------------
# Small helpers of the spec


def chunk_rows(n: int, world_size: int, rank: int) -> Tuple[int, int]:
    """FSDP2 shard rule: c = ceil(n / W); rank r holds [min(r*c, n), min((r+1)*c, n))."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    c = -(-n // world_size)
    return min(rank * c, n), min((rank + 1) * c, n)


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.reshard"


def parse_rank_file_name(name: str) -> Optional[Tuple[int, int]]:
    m = _RANK_FILE_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def combine_chunk_checksums(chunk_hashes: Sequence[int]) -> int:
    """Tensor checksum: XXH3-64 of the chunk checksums as consecutive u64 LE."""
    return xxh3_64(b"".join(struct.pack("<Q", h) for h in chunk_hashes))


def nbytes_for(dtype: str, numel: int) -> Optional[int]:
    bits = numel * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def safetensors_file_fingerprint(path: str) -> Dict[str, Any]:
    """``{"name", "size", "header_xxh3", "sample_xxh3"}`` of one safetensors file, as in
    ``source.files``."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise FormatError(f"{path}: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", prefix)
        header = f.read(n)
        if len(header) != n:
            raise FormatError(f"{path}: safetensors header truncated")
        entries = json.loads(header)
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1])
                       for k, e in entries.items() if k != "__metadata__")
        sample = bytearray()
        for begin, end in spans:
            k = min(4096, end - begin)
            f.seek(8 + n + begin)
            sample += f.read(k)
            f.seek(8 + n + end - k)
            sample += f.read(k)
    return {
        "name": os.path.basename(path),
        "size": os.path.getsize(path),
        "header_xxh3": hex16(xxh3_64(prefix + header)),
        "sample_xxh3": hex16(xxh3_64(bytes(sample))),
    }


# torch.save storage classes -> safetensors dtype name (the legacy typed storages).
_TORCH_STORAGE_DTYPES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16",
    "BFloat16Storage": "BF16", "LongStorage": "I64", "IntStorage": "I32",
    "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8", "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}
# torch dtypes as _rebuild_tensor_v3 names them -> safetensors dtype name.
_TORCH_DTYPES = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int8": "I8",
    "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "bool": "BOOL", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
}


@dataclass
class _TorchZipTensor:
    name: str
    dtype: str
    shape: List[int]
    offset: int  # absolute byte offset of the tensor's first byte in the archive
    nbytes: int


def torch_zip_tensors(path: str) -> Tuple[bytes, List[_TorchZipTensor]]:
    """``(data.pkl bytes, tensors)`` of a torch.save zip archive, read with :mod:`zipfile`
    and a :class:`pickle.Unpickler` whose globals are inert stand-ins defined here (nothing
    from torch is imported or run). Tensors must be contiguous."""
    import pickle
    import zipfile

    class _Storage:
        def __init__(self, dtype, key, numel):
            self.dtype, self.key, self.numel = dtype, key, numel

    class _Tensor:
        def __init__(self, storage, offset, size, stride, dtype):
            self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
            self.dtype = dtype

    class _DType:
        def __init__(self, name):
            self.name = name

    class _StorageType:
        def __init__(self, dtype):
            self.dtype = dtype

    def rebuild_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
        return _Tensor(storage, offset, tuple(size), tuple(stride), storage.dtype)

    def rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
        return _Tensor(storage, offset, tuple(size), tuple(stride), _TORCH_DTYPES[dtype.name])

    def rebuild_parameter(data, requires_grad, hooks, state=None):
        return data

    def rebuild_from_type(func, new_type, args, state):
        return func(*args)

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("collections", "OrderedDict"):
                import collections
                return collections.OrderedDict
            if module == "torch._utils":
                table = {"_rebuild_tensor_v2": rebuild_v2, "_rebuild_tensor_v3": rebuild_v3,
                         "_rebuild_parameter": rebuild_parameter,
                         "_rebuild_parameter_with_state": rebuild_parameter}
                if name in table:
                    return table[name]
            if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
                return rebuild_from_type
            if module in ("torch", "torch._tensor") and name == "Tensor":
                return _Tensor
            if module in ("torch.nn.parameter", "torch.nn") and name == "Parameter":
                return _Tensor
            if module in ("torch", "torch.storage") and name == "UntypedStorage":
                return _StorageType(None)
            if module == "torch" and name in _TORCH_STORAGE_DTYPES:
                return _StorageType(_TORCH_STORAGE_DTYPES[name])
            if module == "torch" and name in _TORCH_DTYPES:
                return _DType(name)
            raise FormatError(f"{path}: global {module}.{name} is not allowed")

        def persistent_load(self, pid):
            tag, stype, key, location, numel = pid
            if tag != "storage" or not isinstance(stype, _StorageType):
                raise FormatError(f"{path}: persistent id {pid!r}")
            return _Storage(stype.dtype, key, numel)

    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        prefix = infos[0].filename.split("/")[0] + "/"
        pkl = z.read(prefix + "data.pkl")
        import io
        state = _Unpickler(io.BytesIO(pkl)).load()
        by_name = {i.filename: i for i in infos}
        data_start: Dict[str, int] = {}
        with open(path, "rb") as fh:
            for info in infos:
                fh.seek(info.header_offset)
                local = fh.read(30)
                n, m = struct.unpack("<HH", local[26:30])
                data_start[info.filename] = info.header_offset + 30 + n + m
        tensors = []
        for name, t in state.items():
            dtype = t.dtype or t.storage.dtype
            item = DTYPE_BITS[dtype] // 8
            numel = math.prod(t.size)
            expected, stride_ok = 1, True
            for d, st in zip(reversed(t.size), reversed(t.stride)):
                if d != 1 and st != expected:
                    stride_ok = False
                expected *= d
            if numel and not stride_ok:
                raise FormatError(f"{path}: tensor {name} is not contiguous")
            rec = prefix + "data/" + t.storage.key
            assert by_name[rec].compress_type == zipfile.ZIP_STORED
            offset = data_start[rec] + (t.offset * item if numel else 0)
            tensors.append(_TorchZipTensor(name, dtype, list(t.size), offset, numel * item))
    return pkl, tensors


def torch_zip_file_fingerprint(path: str) -> Dict[str, Any]:
    """``{"name", "size", "header_xxh3", "sample_xxh3"}`` of one torch.save zip archive:
    header_xxh3 hashes the data.pkl record; the sample runs over the tensors in (offset,
    nbytes, name) order."""
    pkl, tensors = torch_zip_tensors(path)
    sample = bytearray()
    with open(path, "rb") as f:
        for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes, t.name.encode("utf-8"))):
            k = min(4096, t.nbytes)
            f.seek(t.offset)
            sample += f.read(k)
            f.seek(t.offset + t.nbytes - k)
            sample += f.read(k)
    return {
        "name": os.path.basename(path),
        "size": os.path.getsize(path),
        "header_xxh3": hex16(xxh3_64(pkl)),
        "sample_xxh3": hex16(xxh3_64(bytes(sample))),
    }


def weight_file_fingerprint(path: str) -> Dict[str, Any]:
    """The ``source.files`` entry of a weight file, by its extension."""
    if str(path).endswith(".safetensors"):
        return safetensors_file_fingerprint(path)
    return torch_zip_file_fingerprint(path)


def source_fingerprint(files: Sequence[Dict[str, Any]], saved: Optional[Dict[str, Any]] = None) -> str:
    """Fingerprint (hex16) of ``source.files`` entries, or of ``source.saved`` (a checkpoint
    saved from training), computed as the spec says."""
    if saved is not None:
        step = "" if saved.get("step") is None else str(saved["step"])
        return hex16(xxh3_64(f"saved\0{saved['id']}\0{step}\n".encode("utf-8")))
    canonical = "".join(
        f"{f['name']}\0{f['size']}\0{f['header_xxh3']}\0{f['sample_xxh3']}\n"
        for f in sorted(files, key=lambda f: f["name"].encode("utf-8"))
    )
    return hex16(xxh3_64(canonical.encode("utf-8")))


# ---------------------------------------------------------------------------------------
# Strict JSON


def _no_duplicates(path: str, what: str):
    def hook(pairs):
        obj = {}
        for k, v in pairs:
            if k in obj:
                raise FormatError(f"{path}: {what}: duplicate key {k!r}")
            obj[k] = v
        return obj

    return hook


def _parse_strict_json(raw: bytes, path: str, what: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: {what} is not valid UTF-8 ({e})") from None

    def bad_constant(name):
        raise FormatError(f"{path}: {what}: {name} is not JSON")

    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicates(path, what), parse_constant=bad_constant
        )
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: {what} is not valid JSON ({e})") from None


class _Fields:
    """Typed access to JSON members with spec-style error messages."""

    def __init__(self, path: str):
        self.path = path

    def member(self, obj: Any, key: str, where: str) -> Any:
        if not isinstance(obj, dict):
            _fail(self.path, where, type(obj).__name__, "an object")
        if key not in obj:
            _fail(self.path, f"{where}.{key}" if where else key, "nothing", "a value")
        return obj[key]

    def u64(self, v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > U64_MAX:
            _fail(self.path, where, repr(v), "a non-negative integer")
        return v

    def string(self, v: Any, where: str) -> str:
        if not isinstance(v, str):
            _fail(self.path, where, repr(v), "a string")
        return v

    def boolean(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            _fail(self.path, where, repr(v), "true or false")
        return v

    def array(self, v: Any, where: str) -> list:
        if not isinstance(v, list):
            _fail(self.path, where, repr(v)[:60], "an array")
        return v

    def obj(self, v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            _fail(self.path, where, repr(v)[:60], "an object")
        return v

    def hex16(self, v: Any, where: str) -> int:
        if not isinstance(v, str) or not _HEX16_RE.match(v):
            _fail(self.path, where, repr(v), "16 lower-case hex digits")
        return int(v, 16)

    def shape(self, v: Any, where: str) -> List[int]:
        return [self.u64(d, f"{where}[{i}]") for i, d in enumerate(self.array(v, where))]


def _parse_source(F: _Fields, source: Any, where: str) -> Dict[str, Any]:
    F.obj(source, where)
    files = F.array(F.member(source, "files", where), f"{where}.files")
    parsed = []
    for i, f in enumerate(files):
        w = f"{where}.files[{i}]"
        parsed.append(
            {
                "name": F.string(F.member(f, "name", w), f"{w}.name"),
                "size": F.u64(F.member(f, "size", w), f"{w}.size"),
                "header_xxh3": hex16(F.hex16(F.member(f, "header_xxh3", w), f"{w}.header_xxh3")),
                "sample_xxh3": hex16(F.hex16(F.member(f, "sample_xxh3", w), f"{w}.sample_xxh3")),
            }
        )
    fp = hex16(F.hex16(F.member(source, "fingerprint", where), f"{where}.fingerprint"))
    result = {"files": parsed, "fingerprint": fp}
    if "saved" in source:  # a checkpoint saved from training: no files
        saved = F.obj(source["saved"], f"{where}.saved")
        sid = hex16(F.hex16(F.member(saved, "id", f"{where}.saved"), f"{where}.saved.id"))
        step = F.member(saved, "step", f"{where}.saved")
        if step is not None:
            step = F.u64(step, f"{where}.saved.step")
        if parsed:
            _fail(F.path, f"{where}.files", f"{len(parsed)} entries", "none for a saved source")
        result["saved"] = {"id": sid, "step": step}
    return result


# ---------------------------------------------------------------------------------------
# Rank files


@dataclass(frozen=True)
class Preamble:
    magic: bytes
    format_version: int
    flags: int
    data_offset: int
    data_size: int
    header_offset: int
    header_size: int
    header_xxh3: int
    preamble_xxh3: int


@dataclass(frozen=True)
class Shard:
    dim: int
    start: int
    end: int


@dataclass
class TensorEntry:
    name: str
    dtype: str
    global_shape: List[int]
    shard: Optional[Shard]
    local_shape: List[int]
    nbytes: int
    offset: int
    stored_size: int
    codec: str
    chunk_xxh3: List[int]
    frames: Optional[List[Tuple[int, int]]]
    xxh3: int

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def chunk_range(self, chunk_size: int, i: int) -> Tuple[int, int]:
        return i * chunk_size, min((i + 1) * chunk_size, self.nbytes)


def decode_preamble(raw: bytes, file_size: int, path: str, verify: bool = True) -> Preamble:
    """Checks invariants 1 and 2 of the spec (the hashes only when ``verify``)."""
    if file_size < PREAMBLE_SIZE or len(raw) < PREAMBLE_SIZE:
        _fail(path, "preamble", f"a file of {file_size} bytes", "at least 64 bytes (truncated?)")
    p = Preamble(*_PREAMBLE.unpack(raw[:PREAMBLE_SIZE]))
    if p.magic != MAGIC:
        _fail(path, "magic", p.magic.hex(" "), MAGIC.hex(" "))
    if p.format_version != FORMAT_VERSION:
        _fail(path, "format_version", p.format_version, FORMAT_VERSION)
    if p.flags != 0:
        _fail(path, "flags", p.flags, 0)
    if verify:
        h = xxh3_64(raw[:PREAMBLE_HASHED])
        if h != p.preamble_xxh3:
            raise ChecksumError(
                f"{path}: preamble_xxh3: found {hex16(p.preamble_xxh3)}, preamble hashes to "
                f"{hex16(h)} (preamble corrupt)"
            )
    if p.data_offset != DATA_OFFSET:
        _fail(path, "data_offset", p.data_offset, DATA_OFFSET)
    if p.data_size % ALIGNMENT != 0:
        _fail(path, "data_size", p.data_size, "a multiple of 4096")
    if p.data_offset + p.data_size > U64_MAX:
        _fail(path, "data_size", p.data_size, "data_offset + data_size within 64 bits")
    if p.header_offset != p.data_offset + p.data_size:
        _fail(path, "header_offset", p.header_offset, p.data_offset + p.data_size)
    if not 1 <= p.header_size <= MAX_HEADER_SIZE:
        _fail(path, "header_size", p.header_size, f"1 to {MAX_HEADER_SIZE}")
    if p.header_offset + p.header_size > U64_MAX:
        _fail(path, "header_size", p.header_size, "header_offset + header_size within 64 bits")
    if file_size != p.header_offset + p.header_size:
        _fail(
            path,
            "file size",
            f"{file_size} bytes",
            f"{p.header_offset + p.header_size} (header_offset + header_size)"
            + ("; the file is truncated" if file_size < p.header_offset + p.header_size else ""),
        )
    return p


def parse_header(raw: bytes, preamble: Preamble, path: str) -> Tuple[Dict[str, Any], List[TensorEntry]]:
    """Checks invariants 3 to 7. Returns the JSON object and the parsed tensor entries."""
    F = _Fields(path)
    h = _parse_strict_json(raw, path, "header")
    F.obj(h, "header")
    fmt = F.string(F.member(h, "format", ""), "format")
    if fmt != "reshard.rank":
        _fail(path, "format", repr(fmt), "'reshard.rank'")
    version = F.u64(F.member(h, "format_version", ""), "format_version")
    if version != preamble.format_version:
        _fail(path, "format_version (header)", version, preamble.format_version)
    F.string(F.member(h, "writer", ""), "writer")
    layout = F.obj(F.member(h, "layout", ""), "layout")
    key = F.string(F.member(layout, "key", "layout"), "layout.key")
    if not _KEY_RE.match(key) or key in (".", ".."):
        _fail(path, "layout.key", repr(key), "a directory name of [A-Za-z0-9._-]")
    kind = F.string(F.member(layout, "kind", "layout"), "layout.kind")
    if kind != "fsdp2":
        _fail(path, "layout.kind", repr(kind), "'fsdp2'")
    ws = F.u64(F.member(layout, "world_size", "layout"), "layout.world_size")
    if ws < 1:
        _fail(path, "layout.world_size", ws, "at least 1")
    F.string(F.member(layout, "dtype", "layout"), "layout.dtype")
    rank = F.u64(F.member(h, "rank", ""), "rank")
    if rank >= ws:
        _fail(path, "rank", rank, f"less than world_size {ws}")
    _parse_source(F, F.member(h, "source", ""), "source")
    chunk_size = F.u64(F.member(h, "chunk_size", ""), "chunk_size")
    if chunk_size == 0 or chunk_size % ALIGNMENT != 0:
        _fail(path, "chunk_size", chunk_size, "a positive multiple of 4096")

    entries: List[TensorEntry] = []
    names = set()
    previous_end = 0
    for i, e in enumerate(F.array(F.member(h, "tensors", ""), "tensors")):
        w = f"tensors[{i}]"
        name = F.string(F.member(e, "name", w), f"{w}.name")
        w = f"tensor {name!r}"
        if name in names:
            _fail(path, w, "a second entry", "unique names")
        names.add(name)
        dtype = F.string(F.member(e, "dtype", w), f"{w}.dtype")
        if dtype not in DTYPE_BITS:
            _fail(path, f"{w}.dtype", repr(dtype), "a safetensors dtype name")
        gshape = F.shape(F.member(e, "global_shape", w), f"{w}.global_shape")
        lshape = F.shape(F.member(e, "local_shape", w), f"{w}.local_shape")
        jshard = F.member(e, "shard", w)
        expected_local = list(gshape)
        shard = None
        if jshard is None:
            if "flat" in e:  # whole: 0-dim tensors, persistent buffers; never a flat parameter
                _fail(path, f"{w}.shard", "null for a flat parameter", "a shard")
        else:
            ws_ = f"{w}.shard"
            F.obj(jshard, ws_)
            dim = F.u64(F.member(jshard, "dim", ws_), f"{ws_}.dim")
            start = F.u64(F.member(jshard, "start", ws_), f"{ws_}.start")
            end = F.u64(F.member(jshard, "end", ws_), f"{ws_}.end")
            if dim != 0:
                _fail(path, f"{ws_}.dim", dim, 0)
            if not gshape or not 0 <= start <= end <= gshape[0]:
                _fail(path, ws_, f"rows [{start}, {end}) of {gshape}", "0 <= start <= end <= dim 0")
            rule = chunk_rows(gshape[0], ws, rank)
            if (start, end) != rule:
                _fail(path, ws_, f"rows [{start}, {end})", f"rows {list(rule)} by the FSDP2 rule")
            shard = Shard(dim, start, end)
            expected_local[0] = end - start
        if lshape != expected_local:
            _fail(path, f"{w}.local_shape", lshape, expected_local)
        nbytes = F.u64(F.member(e, "nbytes", w), f"{w}.nbytes")
        expected_nbytes = nbytes_for(dtype, math.prod(lshape))
        if expected_nbytes != nbytes:
            _fail(path, f"{w}.nbytes", nbytes, expected_nbytes if expected_nbytes is not None else "whole bytes")
        offset = F.u64(F.member(e, "offset", w), f"{w}.offset")
        stored = F.u64(F.member(e, "stored_size", w), f"{w}.stored_size")
        codec = F.string(F.member(e, "codec", w), f"{w}.codec")
        if codec not in ("raw", "zstd"):
            _fail(path, f"{w}.codec", repr(codec), "'raw' or 'zstd'")
        if offset < previous_end:
            _fail(path, f"{w}.offset", offset, f"at least {previous_end} (sorted, no overlap)")
        if codec == "raw" and offset % ALIGNMENT != 0:
            _fail(path, f"{w}.offset", offset, "a multiple of 4096")
        if offset + stored > preamble.data_size:
            _fail(path, f"{w}.offset", f"[{offset}, {offset + stored})",
                  f"inside the data region of {preamble.data_size} bytes")
        previous_end = offset + stored
        chunks = [
            F.hex16(c, f"{w}.chunk_xxh3[{j}]")
            for j, c in enumerate(F.array(F.member(e, "chunk_xxh3", w), f"{w}.chunk_xxh3"))
        ]
        n_chunks = -(-nbytes // chunk_size)
        if len(chunks) != n_chunks:
            _fail(path, f"{w}.chunk_xxh3", f"{len(chunks)} entries", f"{n_chunks}")
        frames = None
        if codec == "raw":
            if stored != nbytes:
                _fail(path, f"{w}.stored_size", stored, f"{nbytes} (= nbytes for raw)")
            if "frames" in e:
                _fail(path, f"{w}.frames", "frames", "none for raw")
        else:
            jframes = F.array(F.member(e, "frames", w), f"{w}.frames")
            if len(jframes) != n_chunks:
                _fail(path, f"{w}.frames", f"{len(jframes)} entries", f"{n_chunks} (one per chunk)")
            frames = []
            frame_end = 0
            for j, fr in enumerate(jframes):
                wf = f"{w}.frames[{j}]"
                F.array(fr, wf)
                if len(fr) != 2:
                    _fail(path, wf, fr, "[offset, size]")
                fo, fs = F.u64(fr[0], f"{wf}[0]"), F.u64(fr[1], f"{wf}[1]")
                if fo < frame_end or fs == 0 or fo + fs > stored:
                    _fail(path, wf, [fo, fs], f"a non-empty frame inside [0, {stored}), after the previous")
                frame_end = fo + fs
                frames.append((fo, fs))
        xxh = F.hex16(F.member(e, "xxh3", w), f"{w}.xxh3")
        entries.append(
            TensorEntry(name, dtype, gshape, shard, lshape, nbytes, offset, stored, codec,
                        chunks, frames, xxh)
        )
    return h, entries


class RankFile:
    """One rank file, opened and checked against invariants 1-7 of the spec.

    Invariant 8 (data checksums) is checked by :meth:`read_bytes` / :meth:`read_tensor` /
    :meth:`verify_data` when ``verify`` is true.
    """

    def __init__(self, path: str, preamble: Preamble, header: Dict[str, Any],
                 tensors: List[TensorEntry], file_size: int, verify: bool):
        self.path = path
        self.preamble = preamble
        self.header = header
        self.tensors = tensors
        self.file_size = file_size
        self.verify = verify
        self._by_name = {t.name: t for t in tensors}

    @classmethod
    def open(cls, path: Union[str, os.PathLike], verify: bool = True) -> "RankFile":
        path = os.fspath(path)
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            raw = f.read(DATA_OFFSET)
            p = decode_preamble(raw, file_size, path, verify=verify)
            pad = raw[PREAMBLE_SIZE:DATA_OFFSET]
            if len(pad) != DATA_OFFSET - PREAMBLE_SIZE or pad.count(0) != len(pad):
                _fail(path, "bytes [64, data_offset)", "non-zero bytes", "zeros")
            f.seek(p.header_offset)
            header_raw = f.read(p.header_size)
            if len(header_raw) != p.header_size:
                _fail(path, "header", f"{len(header_raw)} bytes", f"{p.header_size} (truncated)")
        if verify:
            hh = xxh3_64(header_raw)
            if hh != p.header_xxh3:
                raise ChecksumError(
                    f"{path}: header_xxh3: found {hex16(p.header_xxh3)}, the header hashes to "
                    f"{hex16(hh)} (the header is corrupt)"
                )
        header, tensors = parse_header(header_raw, p, path)
        if verify:
            src = header["source"]
            computed = source_fingerprint(src["files"], src.get("saved"))
            if computed != src["fingerprint"]:
                _fail(path, "source.fingerprint", src["fingerprint"],
                      f"{computed} (computed from source.{'saved' if 'saved' in src else 'files'})")
            for t in tensors:
                combined = combine_chunk_checksums(t.chunk_xxh3)
                if combined != t.xxh3:
                    raise ChecksumError(
                        f"{path}: tensor {t.name!r}: xxh3 {hex16(t.xxh3)} is not the checksum "
                        f"of chunk_xxh3 ({hex16(combined)})"
                    )
        return cls(path, p, header, tensors, file_size, verify)

    # -- header accessors -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.header["rank"]

    @property
    def world_size(self) -> int:
        return self.header["layout"]["world_size"]

    @property
    def layout_key(self) -> str:
        return self.header["layout"]["key"]

    @property
    def chunk_size(self) -> int:
        return self.header["chunk_size"]

    @property
    def source(self) -> Dict[str, Any]:
        return self.header["source"]

    def names(self) -> List[str]:
        return [t.name for t in self.tensors]

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    # -- data -------------------------------------------------------------------------
    def read_stored(self, entry: Union[str, TensorEntry]) -> bytes:
        """The stored (possibly compressed) bytes of a tensor, unchecked."""
        t = self.entry(entry) if isinstance(entry, str) else entry
        with open(self.path, "rb") as f:
            f.seek(self.preamble.data_offset + t.offset)
            data = f.read(t.stored_size)
        if len(data) != t.stored_size:
            _fail(self.path, f"tensor {t.name!r}", "a short read", f"{t.stored_size} bytes")
        return data

    def read_bytes(self, entry: Union[str, TensorEntry], verify: Optional[bool] = None) -> bytes:
        """The decoded bytes of a tensor; with ``verify`` (default: as opened) every chunk
        is checked against ``chunk_xxh3``."""
        t = self.entry(entry) if isinstance(entry, str) else entry
        verify = self.verify if verify is None else verify
        stored = self.read_stored(t)
        cs = self.chunk_size
        n_chunks = len(t.chunk_xxh3)
        parts = []
        for i in range(n_chunks):
            b, e = t.chunk_range(cs, i)
            if t.codec == "raw":
                chunk = stored[b:e]
            else:
                fo, fs = t.frames[i]
                try:
                    chunk = zstd_decompress(stored[fo:fo + fs], e - b)
                except FormatError as err:
                    raise FormatError(f"{self.path}: tensor {t.name!r} chunk {i}: {err}") from None
            if verify:
                h = xxh3_64(chunk)
                if h != t.chunk_xxh3[i]:
                    raise ChecksumError(
                        f"{self.path}: tensor {t.name!r} chunk {i}: checksum mismatch: data "
                        f"hashes to {hex16(h)}, header says {hex16(t.chunk_xxh3[i])}"
                    )
            parts.append(chunk)
        data = b"".join(parts)
        if len(data) != t.nbytes:
            _fail(self.path, f"tensor {t.name!r}", f"{len(data)} decoded bytes", t.nbytes)
        return data

    def read_tensor(self, name: str, verify: Optional[bool] = None):
        """The tensor as a ``torch.Tensor`` of ``local_shape`` and the file's dtype."""
        import torch

        t = self.entry(name)
        dt = torch_dtype(t.dtype)
        data = self.read_bytes(t, verify=verify)
        if t.nbytes == 0:
            return torch.empty(t.local_shape, dtype=dt)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(dt).reshape(t.local_shape)

    def verify_data(self) -> None:
        """Reads every tensor and checks every checksum (invariant 8)."""
        for t in self.tensors:
            self.read_bytes(t, verify=True)

    def unused_data_ranges(self) -> List[Tuple[int, int]]:
        """Ranges of the data region (relative to data_offset) that no tensor stores."""
        out, pos = [], 0
        for t in self.tensors:
            if t.offset > pos:
                out.append((pos, t.offset))
            pos = max(pos, t.offset + t.stored_size)
        if pos < self.preamble.data_size:
            out.append((pos, self.preamble.data_size))
        return out

    def padding_is_zero(self) -> bool:
        """True when every byte of the data region outside tensors is zero."""
        with open(self.path, "rb") as f:
            for b, e in self.unused_data_ranges():
                f.seek(self.preamble.data_offset + b)
                chunk = f.read(e - b)
                if chunk.count(0) != len(chunk):
                    return False
        return True


def torch_dtype(name: str):
    """torch dtype for a safetensors dtype name; ValueError for ones torch cannot hold
    element-wise (F6_*, F4)."""
    import torch

    attr = _TORCH_DTYPE_NAMES.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise ValueError(f"safetensors dtype {name} has no element-wise torch dtype")
    return dt


def read_header(path: Union[str, os.PathLike], verify: bool = True) -> Dict[str, Any]:
    """The checked JSON header of a rank file."""
    return RankFile.open(path, verify=verify).header


def read_tensor(path: Union[str, os.PathLike], name: str, verify: bool = True):
    """One tensor of a rank file as a torch.Tensor of its local shape."""
    return RankFile.open(path, verify=verify).read_tensor(name)


# ---------------------------------------------------------------------------------------
# Manifest (formats/manifest.md)


def read_manifest(out: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Reads and checks OUT/reshard.json; returns the JSON object."""
    path = os.path.join(os.fspath(out), "reshard.json")
    with open(path, "rb") as f:
        raw = f.read()
    F = _Fields(path)
    m = F.obj(_parse_strict_json(raw, path, "manifest"), "manifest")
    if F.string(F.member(m, "format", ""), "format") != "reshard.manifest":
        _fail(path, "format", repr(m["format"]), "'reshard.manifest'")
    if F.u64(F.member(m, "format_version", ""), "format_version") != 1:
        _fail(path, "format_version", m["format_version"], 1)
    F.string(F.member(m, "writer", ""), "writer")
    source = _parse_source(F, F.member(m, "source", ""), "source")
    for i, a in enumerate(F.array(F.member(m, "aux_files", ""), "aux_files")):
        F.string(a, f"aux_files[{i}]")
    layouts = F.obj(F.member(m, "layouts", ""), "layouts")
    for key, l in layouts.items():
        w = f"layouts[{key!r}]"
        if not _KEY_RE.match(key):
            _fail(path, w, repr(key), "a directory name of [A-Za-z0-9._-]")
        F.string(F.member(l, "kind", w), f"{w}.kind")
        ws = F.u64(F.member(l, "world_size", w), f"{w}.world_size")
        if ws < 1:
            _fail(path, f"{w}.world_size", ws, "at least 1")
        F.string(F.member(l, "dtype", w), f"{w}.dtype")
        d = F.string(F.member(l, "dir", w), f"{w}.dir")
        if d != key:
            _fail(path, f"{w}.dir", repr(d), repr(key))
        ranks = F.array(F.member(l, "ranks", w), f"{w}.ranks")
        prev = -1
        for i, r in enumerate(ranks):
            wr = f"{w}.ranks[{i}]"
            rr = F.u64(F.member(r, "rank", wr), f"{wr}.rank")
            fname = F.string(F.member(r, "file", wr), f"{wr}.file")
            F.u64(F.member(r, "size", wr), f"{wr}.size")
            F.hex16(F.member(r, "header_xxh3", wr), f"{wr}.header_xxh3")
            if rr <= prev or rr >= ws:
                _fail(path, f"{wr}.rank", rr, f"ascending ranks below {ws}")
            if fname != rank_file_name(rr, ws):
                _fail(path, f"{wr}.file", repr(fname), repr(rank_file_name(rr, ws)))
            prev = rr
        complete = F.boolean(F.member(l, "complete", w), f"{w}.complete")
        if complete != (len(ranks) == ws):
            _fail(path, f"{w}.complete", complete, f"{len(ranks) == ws} ({len(ranks)} of {ws} ranks)")
    if source_fingerprint(source["files"], source.get("saved")) != source["fingerprint"]:
        _fail(path, "source.fingerprint", source["fingerprint"],
              f"{source_fingerprint(source['files'], source.get('saved'))} (computed from "
              f"source.{'saved' if 'saved' in source else 'files'})")
    return m


def layout_rank_files(layout_dir: Union[str, os.PathLike]) -> Dict[int, str]:
    """rank -> path of the ``rank-*.reshard`` files in a layout directory."""
    layout_dir = os.fspath(layout_dir)
    out = {}
    for name in sorted(os.listdir(layout_dir)):
        parsed = parse_rank_file_name(name)
        if parsed:
            out[parsed[0]] = os.path.join(layout_dir, name)
    return out
