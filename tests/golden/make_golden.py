#!/usr/bin/env python3
"""Writes the hostile-file corpus tests/golden/ and its table tests/golden/expectations.json.

    python tests/golden/make_golden.py [RESHARD_BIN]          # default build/reshard
    python tests/golden/make_golden.py --pin [RESHARD_BIN]    # also re-pin pinned/ (see below)

Every file is a small, deliberately broken input, made from the format descriptions
(formats/*.md, the safetensors spec) by this script, not by the library: the safetensors files
are written byte by byte here; the rank files are real ones written by RESHARD_BIN (`reshard
convert` of a tiny safetensors checkpoint written here), then broken by editing bytes, with
XXH3-64 (libxxhash, through ctypes) recomputed where a case means to get past a checksum.

expectations.json lists, per case: the file (relative to tests/golden), its kind (what reads
it), the reshard::Error code and the substrings its message must contain (file, field, what
was found, what was expected), and the CLI runs with their exit code. tests/core/golden_test.cc
replays the table through the core (also under ASan+UBSan: scripts/sanitize.sh) and
tests/python/test_golden.py through the CLI. Output is deterministic: rerunning rewrites the
same bytes (the rank files' writer string is fixed for that).

The pinned set (pinned-source.safetensors, pinned/, pinned.json) is different: rank files as
RESHARD_BIN's `reshard convert` wrote them, writer string included, kept so that a later writer
cannot change format 1 unnoticed (tests/python/test_golden.py converts the source again and
compares). A plain run leaves those files alone and only lists the rank files in
expectations.json (as valid controls); `--pin` rewrites them from the binary given, which is
only right with a format version bump (formats/rank-file.md) or when the files are new.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

GOLDEN = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(GOLDEN))

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(b: bytes) -> int:
    return _xxh.XXH3_64bits(b, len(b))


CASES = []


def case(file, kind, contains, cli, code="corrupt input", what=""):
    CASES.append({"file": file, "kind": kind, "code": code, "contains": contains,
                  "cli": cli, "what": what})


def write(rel, data: bytes):
    path = os.path.join(GOLDEN, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# ---- safetensors ----------------------------------------------------------------------

def st_bytes(header, data=b"", length=None, raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def st_cli(contains):
    return [{"args": ["inspect", "{path}"], "exit": 3, "stderr": contains},
            {"args": ["convert", "{path}", "-o", "{tmp}/out", "--world-size", "2"], "exit": 3,
             "stderr": contains}]


DEEP = b"[" * 1000 + b"]" * 1000
DEPTH_ERROR = ["nested more than 64 levels", "at most 64 levels of nesting"]


def safetensors_cases():
    def add(name, data, contains, what):
        rel = f"safetensors/{name}.safetensors"
        write(rel, data)
        case(rel, "safetensors", [name + ".safetensors"] + contains, st_cli(contains), what=what)

    ok = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    add("giant_header_length", st_bytes(ok, bytes(16), length=(1 << 64) - 1),
        ["header length", "18446744073709551615 bytes", "at most 100000000"],
        "u64 header length 2^64-1")
    add("header_length_past_eof", st_bytes(ok, bytes(16), length=5000),
        ["header length", "5000 bytes", "truncated file"],
        "header length larger than the file")
    add("shorter_than_length_field", b"\x10\x00\x00",
        ["header length", "a file of 3 bytes", "at least 8 bytes"], "3-byte file")
    add("offsets_past_end",
        st_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [1000, 1016]}}, bytes(16)),
        ['tensor "w".data_offsets', "end 1016 past the data (16 bytes)"],
        "data_offsets beyond the end of the file")
    add("truncated_data", st_bytes(ok, bytes(10)),
        ['tensor "w".data_offsets', "end 16 past the data (10 bytes)"],
        "file cut inside the last tensor")
    add("overlapping_tensors",
        st_bytes({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24)),
        ['tensor "b".data_offsets', 'overlapping "a"', "non-overlapping tensors"],
        "two tensors sharing bytes")
    add("hole_between_tensors",
        st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, bytes(24)),
        ['tensor "b".data_offsets', "leaving a hole", "packed without holes"],
        "unused bytes between tensors")
    add("shape_product_overflow",
        st_bytes({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 16],
                        "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".shape: element count: arithmetic overflow'], "dims whose product overflows u64")
    add("byte_count_overflow",
        st_bytes({"w": {"dtype": "F64", "shape": [4611686018427387904],
                        "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".shape', "4611686018427387904 elements of F64",
         "whole number of bytes without overflow"], "numel fits, numel*8 does not")
    add("negative_dim",
        st_bytes({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".shape[0]', "found number -1", "a non-negative integer"], "dim -1")
    add("fractional_dim",
        st_bytes({"w": {"dtype": "F32", "shape": [2.5, 2], "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".shape[0]', "2.5", "a non-negative integer"], "dim 2.5")
    add("string_dim",
        st_bytes({"w": {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".shape[0]', 'found string "4"', "a non-negative integer"], 'dim "4"')
    add("wrong_dtype_size",
        st_bytes({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 6]}}, bytes(6)),
        ['tensor "w".data_offsets', "6 bytes [0, 6)", "12 bytes (3 elements of F32)"],
        "F32 [3] given 6 bytes (the size of F16)")
    add("unknown_dtype",
        st_bytes({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16)),
        ['tensor "w".dtype', '"F128"', "a safetensors dtype"], "dtype F128")
    add("sub_byte_odd_count",
        st_bytes({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)),
        ['tensor "w".shape', "3 elements of F4", "whole number of bytes"],
        "three 4-bit values (1.5 bytes)")
    add("end_before_begin",
        st_bytes({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)),
        ['tensor "w".data_offsets', "[8, 0]", "begin <= end"], "data_offsets [8, 0]")
    add("duplicate_key",
        st_bytes(None, bytes(16), raw_header=b'{"w":{"dtype":"F32","shape":[2,2],"data_offsets":'
                 b'[0,16]},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'),
        ['duplicate key "w"'], "one tensor name twice")
    add("not_json", st_bytes(None, bytes(16), raw_header=b'{"w":{"dtype":"F32",\xff'),
        ["safetensors header is not valid JSON"], "broken JSON with a non-UTF-8 byte")
    add("header_is_array", st_bytes([], b""), ["header: found array", "a JSON object"],
        "header [] instead of an object")
    add("metadata_not_string",
        st_bytes({"__metadata__": {"format": 1}, **ok}, bytes(16)),
        ["__metadata__.format", "found number 1", "a string"], "metadata value 1")
    add("extra_key_in_entry",
        st_bytes({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], "x": 1}},
                 bytes(16)),
        ['tensor "w"', 'unknown key "x"'], "entry with an unknown key")
    # Issue 25: 100,000 levels crashed every reader (recursion); 1,000 show the limit.
    add("deep_nesting", st_bytes(None, b"", raw_header=b'{"w":' + DEEP + b"}"),
        DEPTH_ERROR, "arrays nested 1,000 deep (the limit is 64)")
    add("control_chars_in_name",
        st_bytes({"evil\x1b[2J\x07": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                 bytes(16)),
        ['tensor "evil\\x1b[2J\\x07".dtype', '"F128"'],
        "a terminal escape sequence in a tensor name (shown escaped)")
    add("trailing_data",
        st_bytes(ok, bytes(20)),
        ["data size", "20 bytes after the header, tensors cover 16"], "4 bytes nobody owns")


# ---- rank files -----------------------------------------------------------------------

class Rank:
    """A rank file split into preamble fields, data region and header (formats/rank-file.md)."""

    def __init__(self, raw: bytes):
        assert raw[:8] == b"\x89RSHD\r\n\x1a"
        (self.version, self.flags, self.data_offset, self.data_size, self.header_offset,
         self.header_size, self.header_xxh3) = struct.unpack_from("<IIQQQQQ", raw, 8)
        self.raw = raw
        self.data = raw[self.data_offset:self.data_offset + self.data_size]
        self.header = json.loads(raw[self.header_offset:self.header_offset + self.header_size])

    def preamble(self, **override) -> bytes:
        f = dict(version=self.version, flags=self.flags, data_offset=self.data_offset,
                 data_size=self.data_size, header_offset=self.header_offset,
                 header_size=self.header_size, header_xxh3=self.header_xxh3)
        f.update(override)
        b = b"\x89RSHD\r\n\x1a" + struct.pack(
            "<IIQQQQQ", f["version"], f["flags"], f["data_offset"], f["data_size"],
            f["header_offset"], f["header_size"], f["header_xxh3"])
        return b + struct.pack("<Q", xxh3(b))

    def with_header(self, header, text=None) -> bytes:
        """The file with `header` re-serialized (or `text` as the header) and every checksum
        made to match it."""
        text = json.dumps(header, indent=1).encode() if text is None else text
        pre = self.preamble(header_size=len(text), header_xxh3=xxh3(text))
        return pre + self.raw[64:self.data_offset] + self.data + text


def flip(b: bytes, at: int, bit: int = 0) -> bytes:
    return b[:at] + bytes([b[at] ^ (1 << bit)]) + b[at + 1:]


def convert(reshard_bin, src, out, *args):
    subprocess.run([reshard_bin, "convert", src, "-o", out, *args], check=True,
                   stdout=subprocess.DEVNULL)


def rank_cases(reshard_bin, work):
    # A tiny source, one tensor (each tensor takes 4096 bytes of a rank file's data region):
    # w F32 [6, 4], sharded by rows.
    src = os.path.join(work, "src")
    os.makedirs(src)
    w = struct.pack("<24f", *[i * 0.5 - 3 for i in range(24)])
    header = {"w": {"dtype": "F32", "shape": [6, 4], "data_offsets": [0, 96]}}
    with open(os.path.join(src, "model.safetensors"), "wb") as f:
        f.write(st_bytes(header, w))
    out = {}
    for key, args in (("raw2", ["--world-size", "2"]),
                      ("zstd2", ["--world-size", "2", "--compress", "zstd"]),
                      ("zstd4", ["--world-size", "4", "--compress", "zstd"])):
        o = os.path.join(work, key)
        convert(reshard_bin, src, o, *args)
        layout = [d for d in os.listdir(o) if d.startswith("fsdp2-")][0]
        out[key] = os.path.join(o, layout)

    def load(key, rank, ws):
        with open(os.path.join(out[key], f"rank-{rank:05d}-of-{ws:05d}.reshard"), "rb") as f:
            r = Rank(f.read())
        r.header["writer"] = "reshard golden"  # no version string in checked-in files
        r.raw = r.with_header(r.header)
        return Rank(r.raw)

    raw0 = load("raw2", 0, 2)
    z0, z1 = load("zstd2", 0, 2), load("zstd2", 1, 2)
    z4 = load("zstd4", 0, 4)
    name0 = "rank-00000-of-00002.reshard"

    def add(case_name, data, kind, contains, what, code="corrupt input", file_name=name0):
        rel = f"rank/{case_name}/{file_name}"
        write(rel, data)
        full = [file_name] + contains
        if kind == "rank_open":
            cli = [{"args": ["inspect", "{path}"], "exit": 3, "stderr": full},
                   {"args": ["verify", "{path}"], "exit": 1, "stdout": full}]
        else:
            cli = [{"args": ["verify", "{path}"], "exit": 1, "stdout": full}]
        case(rel, kind, full, cli, code=code, what=what)

    def tensor(header, name):
        return [t for t in header["tensors"] if t["name"] == name][0]

    # The untouched file, as the control: it must open and verify.
    write(f"rank/valid/{name0}", z0.raw)
    case(f"rank/valid/{name0}", "rank_valid", [], [{"args": ["verify", "{path}"], "exit": 0}],
         code="", what="unbroken zstd rank file (control)")

    # Truncation.
    cut = raw0.data_offset + 100
    add("truncated_in_data", raw0.raw[:cut], "rank_open",
        ["file size", f"{cut} bytes", "the file is truncated"], "raw file cut inside the data")
    add("truncated_in_header", z0.raw[:-10], "rank_open",
        ["file size", "the file is truncated"], "last 10 bytes of the header missing")
    add("truncated_in_preamble", z0.raw[:40], "rank_open",
        ["preamble", "a file of 40 bytes", "at least 64 bytes"], "40-byte file")
    # Bit flips.
    wt = tensor(raw0.header, "w")
    add("bitflip_raw_data", flip(raw0.raw, raw0.data_offset + wt["offset"] + 5, 3), "rank_data",
        ['tensor "w"', "chunk 0: checksum mismatch", "the file is corrupt"],
        "one bit of raw tensor data")
    zt = tensor(z0.header, "w")
    frame_at = z0.data_offset + zt["offset"] + zt["frames"][0][0]
    add("bitflip_zstd_frame", flip(z0.raw, frame_at + zt["frames"][0][1] - 6, 1), "rank_data",
        ['tensor "w"', "chunk 0: "], "one bit inside a zstd frame's compressed block")
    add("bitflip_zstd_frame_header", flip(z0.raw, frame_at + 5, 0), "rank_data",
        ['tensor "w"', "chunk 0: zstd frame declares 49 bytes, expected 48"], "one bit of a zstd frame's content size")
    add("bitflip_header", flip(z0.raw, z0.header_offset + z0.header_size // 2, 2), "rank_open",
        ["header_xxh3", "the header is corrupt"], "one bit of the header JSON")
    add("bitflip_preamble", flip(z0.raw, 25, 4), "rank_open",
        ["preamble_xxh3", "preamble corrupt"], "one bit of data_size")
    add("bad_magic", b"PK\x03\x04" + z0.raw[4:], "rank_open",
        ["magic", "50 4b 03 04", "not a reshard rank file"], "a ZIP signature")
    # Versions and sizes with consistent checksums.
    add("newer_version", z0.preamble(version=2) + z0.raw[64:], "rank_open",
        ["format_version", "found 2", "upgrade reshard"], "format_version 2 (a newer writer)")
    add("version_zero", z0.preamble(version=0) + z0.raw[64:], "rank_open",
        ["format_version", "found 0", "expected 1"], "format_version 0")
    add("header_size_huge", z0.preamble(header_size=1 << 40) + z0.raw[64:], "rank_open",
        ["header_size", "1099511627776", "1 to 268435456"], "header_size 1 TiB")
    add("data_size_overflow", z0.preamble(data_size=(1 << 64) - 4096) + z0.raw[64:], "rank_open",
        ["header_offset"], "data_offset + data_size overflows u64")
    # Header edits (checksums recomputed, so the parser's own checks must catch them).
    h = json.loads(json.dumps(z0.header))
    tensor(h, "w")["offset"] = z0.data_size + 4096
    add("tensor_past_data", z0.with_header(h), "rank_open",
        ['tensor "w".offset', "inside the data region"], "tensor offset past the data region")
    h = json.loads(json.dumps(z0.header))
    tensor(h, "w")["global_shape"] = [4294967296, 4294967296, 16]
    tensor(h, "w")["local_shape"] = [2147483648, 4294967296, 16]
    tensor(h, "w")["shard"] = {"dim": 0, "start": 0, "end": 2147483648}
    add("shape_product_overflow", z0.with_header(h), "rank_open",
        ['tensor "w" numel: arithmetic overflow'], "a shape whose product overflows u64")
    h = json.loads(json.dumps(z0.header))
    tensor(h, "w")["local_shape"] = [-3, 4]
    add("negative_dim", z0.with_header(h), "rank_open",
        ['tensor "w".local_shape[0]', "found number -3", "a non-negative integer"],
        "local_shape [-3, 4]")
    h = json.loads(json.dumps(z0.header))
    tensor(h, "w")["dtype"] = "F16"
    add("wrong_dtype_size", z0.with_header(h), "rank_open",
        ['tensor "w".nbytes', "found 48", "expected 24"], "dtype F16 with F32's byte count")
    h = json.loads(json.dumps(z0.header))
    h["chunk_size"] = 1 << 34
    rel = f"rank/chunk_size_16g/{name0}"
    write(rel, z0.with_header(h))
    case(rel, "rank_valid", [], [{"args": ["verify", "{path}"], "exit": 0}], code="",
         what="valid file with 16 GiB chunks and a 96-byte tensor: nothing may allocate by "
              "chunk_size")
    h = json.loads(json.dumps(z0.header))
    h["layout"]["world_size"] = 1 << 32
    add("world_size_2p32", z0.with_header(h), "rank_open",
        ["layout.world_size", "4294967296", "1 to 16777216"], "world size 2^32")
    add("deep_nesting", z0.with_header(None, json.dumps(z0.header).encode()[:-1] +
                                       b', "extra": ' + DEEP + b"}"), "rank_open",
        ["header", *DEPTH_ERROR], "header with a member nested 1,000 deep (checksums consistent)")
    # Padding that is not zero (formats/rank-file.md: bytes [64, data_offset) and the data
    # region outside every tensor are zero; no checksum covers them, verify reads them).
    add("nonzero_padding_preamble", flip(z0.raw, 100, 0), "rank_data",
        ["padding byte at file offset 100", "between the preamble and the data region",
         "is 0x01, expected 0"], "one bit set in the zero bytes after the preamble", code="")
    at = z0.data_offset + zt["offset"] + zt["stored_size"] + 10
    add("nonzero_padding_data", flip(z0.raw, at, 7), "rank_data",
        [f"padding byte at file offset {at}", 'after tensor "w"', "is 0x80, expected 0"],
        "one bit set in the zero padding after the last tensor", code="")
    # Files that are intact but do not belong where they are.
    add("wrong_world_size", z4.raw, "rank_data",
        ["holds rank 0, expected file name rank-00000-of-00004.reshard"],
        "rank 0 of 4 saved as rank 0 of 2", code="")
    swapped = z0.preamble(header_size=z1.header_size, header_xxh3=z1.header_xxh3)
    swapped = swapped[:64] + z0.raw[64:z0.header_offset] + z1.raw[z1.header_offset:]
    # Rank 1's header is longer or shorter than rank 0's: the preamble above already says so;
    # the data region stays rank 0's, so the header's offsets may point past it.
    add("header_from_other_rank", swapped, "rank_data",
        ["holds rank 1, expected file name rank-00001-of-00002.reshard"],
        "rank 1's header on rank 0's data (checksums consistent)", code="")


# ---- index and manifest ----------------------------------------------------------------

def index_cases():
    def add(name, text: bytes, contains, what):
        rel = f"index/{name}/model.safetensors.index.json"
        write(rel, text)
        d = f"index/{name}"
        full = ["model.safetensors.index.json"] + contains
        case(d, "checkpoint", full,
             [{"args": ["convert", "{path}", "-o", "{tmp}/out", "--world-size", "2"], "exit": 3,
               "stderr": full}], what=what)

    add("path_escape", json.dumps({"weight_map": {"w": "../model.safetensors"}}).encode(),
        ['weight_map["w"]', '"../model.safetensors"', "a file name in the checkpoint directory"],
        "weight_map points outside the directory")
    add("no_weight_map", b'{"metadata": {"total_size": 16}}',
        ["index.weight_map", "found nothing"], "index without weight_map")
    add("value_not_string", b'{"weight_map": {"w": 3}}',
        ['weight_map["w"]', "found number 3", "a string"], "weight_map value 3")
    add("empty_map", b'{"weight_map": {}}', ["weight_map", "an empty map"], "empty weight_map")
    add("not_json", b'{"weight_map": {"w": "a.safetensors"', ["index is not valid JSON"],
        "truncated JSON")
    add("duplicate_key",
        b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}',
        ['index: duplicate key "w"'], "one key twice")
    add("deep_nesting", b'{"weight_map":' + DEEP + b"}", ["index", *DEPTH_ERROR],
        "weight_map nested 1,000 deep")
    add("nul_in_file_name",
        json.dumps({"weight_map": {"w": "model.safetensors\x00.txt"}}).encode(),
        ['weight_map["w"]', '"model.safetensors\\x00.txt"', "a file name in the checkpoint directory"],
        "a NUL inside a weight_map file name (the C path would end at it)")
    add("nul_in_tensor_name", json.dumps({"weight_map": {"w\x00x": "model.safetensors"}}).encode(),
        ["weight_map", '"w\\x00x" (a NUL inside)'], "a NUL inside a weight_map tensor name")


# ---- torch.save archives -------------------------------------------------------------

def _zip_stored(records):
    """A ZIP of stored records (Python's zipfile, not the library): what torch.save writes,
    without its alignment padding."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            z.writestr(info, data)
    return buf.getvalue()


def _binunicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def tiny_state_dict_pickle() -> bytes:
    """{"w": a float32 [2, 3] tensor on storage "0"}, opcode by opcode (protocol 2, as
    torch.save writes it; Python's pickletools documentation), without STOP."""
    return (b"\x80\x02" + b"}" + _binunicode("w")
            + b"ctorch._utils\n_rebuild_tensor_v2\n"
            + b"("                                    # the arguments
            + b"(" + _binunicode("storage") + b"ctorch\nFloatStorage\n" + _binunicode("0")
            + _binunicode("cpu") + b"K\x06" + b"t"   # the persistent id
            + b"Q"                                    # BINPERSID: the storage
            + b"K\x00" + b"K\x02K\x03\x86" + b"K\x03K\x01\x86" + b"\x89"
            + b"ccollections\nOrderedDict\n" + b")" + b"R"
            + b"t" + b"R" + b"s")


def torch_cases():
    storage = struct.pack("<6f", *[i * 0.25 for i in range(6)])

    def add(name, pickle: bytes, contains, what, code):
        rel = f"torch/{name}/pytorch_model.bin"
        write(rel, _zip_stored([("archive/data.pkl", pickle), ("archive/byteorder", b"little"),
                                ("archive/data/0", storage), ("archive/version", b"3\n")]))
        full = ["pytorch_model.bin", "data.pkl"] + contains
        case(rel, "checkpoint", full,
             [{"args": ["inspect", "{path}"], "exit": 3, "stderr": full},
              {"args": ["convert", "{path}", "-o", "{tmp}/out", "--world-size", "2",
                        "--no-capture"], "exit": 3, "stderr": full}], code=code, what=what)

    body = tiny_state_dict_pickle()
    add("memo_flood", body + b"\x94" * 1000 + b".",
        ["memo entry", "objects built", "at most one memo entry per object", "memo flood"],
        "MEMOIZE 1,000 times on the state dict (50 MB of them took 2.8 GB to read)",
        "unsupported")
    puts = b"".join(b"r" + struct.pack("<I", 1000 + k) for k in range(1000))
    add("binput_flood", body + puts + b".", ["memo flood"],
        "LONG_BINPUT under 1,000 new keys", "unsupported")


def manifest_cases(reshard_bin, work):
    o = os.path.join(work, "zstd2")
    with open(os.path.join(o, "reshard.json")) as f:
        good = json.load(f)
    good["writer"] = "reshard golden"

    def add(name, m, contains, what):
        rel = f"manifest/{name}/reshard.json"
        write(rel, (json.dumps(m, indent=2) + "\n").encode() if not isinstance(m, bytes) else m)
        full = ["reshard.json"] + contains
        case(f"manifest/{name}", "manifest", full,
             [{"args": ["inspect", "{path}"], "exit": 3, "stderr": full}], what=what)

    key = next(iter(good["layouts"]))
    m = json.loads(json.dumps(good))
    m["layouts"][key]["ranks"][0]["file"] = "../../etc/passwd"
    add("rank_file_escape", m, [f'layouts["{key}"].ranks[0]', "its canonical file name"],
        "a rank entry naming a path outside the layout")
    m = json.loads(json.dumps(good))
    m["layouts"]["../x"] = m["layouts"].pop(key)
    add("layout_key_escape", m, ['layouts["../x"]', "a directory name of [A-Za-z0-9._-]"],
        "a layout key that is a path")
    m = json.loads(json.dumps(good))
    m["layouts"][key]["complete"] = True
    m["layouts"][key]["ranks"] = m["layouts"][key]["ranks"][:1]
    add("complete_but_missing_ranks", m, [f'layouts["{key}"].complete', "found true",
                                          "1 of 2 ranks listed"],
        "complete true with a rank missing")
    m = json.loads(json.dumps(good))
    m["source"]["fingerprint"] = "0123456789abcdef"
    add("fingerprint_mismatch", m, ["source.fingerprint", "0123456789abcdef",
                                    "computed from source.files"], "source fingerprint altered")
    m = json.loads(json.dumps(good))
    m["layouts"][key]["world_size"] = 4294967298
    add("world_size_2p32", m, [f'layouts["{key}"].world_size', "4294967298"],
        "world size 2^32 + 2")
    # Issue 25: reshard.save copied aux_files by name from SOURCE into OUT.
    aux_expected = "expected a plain file name in the manifest's directory"
    for name, aux, what in (("aux_file_escape", "../../escape.sh", "a name climbing out of OUT"),
                            ("aux_file_absolute", "/tmp/reshard-golden-absolute",
                             "an absolute path"),
                            ("aux_file_control", "tok\x1b[2J.json",
                             "a terminal escape sequence")):
        m = json.loads(json.dumps(good))
        m["aux_files"] = m["aux_files"] + [aux]
        i = len(m["aux_files"]) - 1
        add(name, m, [f"aux_files[{i}]", json.dumps(aux).replace("\\u001b", "\\x1b"),
                      aux_expected], f"an aux file name that is {what}")
    add("deep_nesting", json.dumps(good).encode()[:-1] + b', "extra": ' + DEEP + b"}\n",
        ["manifest", *DEPTH_ERROR], "an extra member nested 1,000 deep")


# ---- the pinned set: today's writer's rank files, kept byte for byte ------------------

PINNED_SOURCE = "pinned-source.safetensors"
PINNED_RECORD = "pinned.json"
# One source, two conversions (each a layout directory under pinned/<set>/). 4 KiB chunks so that
# a tensor spans several chunks (and zstd frames); world size 3 so that some ranks hold no rows.
PINNED_SETS = {
    "raw": ["--world-size", "3", "--chunk-size", "4096"],
    "zstd": ["--world-size", "3", "--chunk-size", "4096", "--compress", "zstd"],
}


def _bf16(values):
    # Every value is exact in bf16, so the top half of its F32 bits is the bf16 (no rounding).
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def pinned_source_tensors():
    """(name, dtype, shape, bytes) of the pinned source, in file order. Several dtypes, NaN /
    inf / -0 / subnormal bit patterns (copied, never interpreted), a 0-dim tensor (stored whole
    on every rank), tensors whose last rank holds no rows at world size 3, and a 12 KiB tensor
    (several 4 KiB chunks per rank)."""
    f32 = [0xBFC00000, 0x80000000, 0x3F000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x00000002]
    return [
        ("a.bf16", "BF16", [5, 3], _bf16([i * 0.25 - 2 for i in range(15)])),
        ("b.f32", "F32", [7], struct.pack("<7I", *f32)),
        ("c.f16", "F16", [4, 2], struct.pack("<8e", *[i / 4 for i in range(8)])),
        ("d.i64", "I64", [3, 2], struct.pack("<6q", 1, -2, 3, 1 << 40, -5, (1 << 63) - 1)),
        ("e.scalar", "F32", [], struct.pack("<f", 3.25)),
        ("f.bool", "BOOL", [4], bytes([1, 0, 1, 1])),
        ("g.f8", "F8_E4M3", [6], bytes([0x00, 0x38, 0xB8, 0x7E, 0x01, 0x7F])),
        ("h.multi_chunk", "BF16", [64, 96], _bf16([((i % 97) - 48) * 0.25 for i in range(64 * 96)])),
    ]


def pinned_source_bytes() -> bytes:
    header, data = {}, b""
    for name, dtype, shape, raw in pinned_source_tensors():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return st_bytes(None, data, raw_header=text)


def pin(reshard_bin):
    """Writes the pinned source and converts it with reshard_bin into pinned/<set>/ (only the
    rank files are kept: the manifest is not part of the rank-file format)."""
    src = os.path.join(GOLDEN, PINNED_SOURCE)
    with open(src, "wb") as f:
        f.write(pinned_source_bytes())
    shutil.rmtree(os.path.join(GOLDEN, "pinned"), ignore_errors=True)
    record = {"note": "written by tests/golden/make_golden.py --pin; see tests/golden/README.md",
              "source": PINNED_SOURCE, "sets": {}}
    version = subprocess.run([reshard_bin, "--version"], check=True, capture_output=True,
                             text=True).stdout.splitlines()
    record["reshard_version"] = version
    with tempfile.TemporaryDirectory() as work:
        for name, args in PINNED_SETS.items():
            out = os.path.join(work, name)
            convert(reshard_bin, src, out, *args)
            layout = [d for d in os.listdir(out) if d.startswith("fsdp2-")][0]
            files = sorted(os.listdir(os.path.join(out, layout)))
            os.makedirs(os.path.join(GOLDEN, "pinned", name, layout))
            for fn in files:
                shutil.copyfile(os.path.join(out, layout, fn),
                                os.path.join(GOLDEN, "pinned", name, layout, fn))
            record["sets"][name] = {"args": args, "layout": layout, "files": files}
    with open(os.path.join(GOLDEN, PINNED_RECORD), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def pinned_cases():
    """Every pinned rank file is also a valid control of the corpus (opens, verifies, reads)."""
    path = os.path.join(GOLDEN, PINNED_RECORD)
    if not os.path.exists(path):
        return
    with open(path) as f:
        record = json.load(f)
    for name, s in record["sets"].items():
        for fn in s["files"]:
            rel = f"pinned/{name}/{s['layout']}/{fn}"
            case(rel, "rank_valid", [], [{"args": ["verify", "{path}"], "exit": 0}],
                 code="", what=f"pinned rank file of today's writer ({name}: reshard convert "
                               f"{PINNED_SOURCE} {' '.join(s['args'])}); never regenerated")


def main():
    args = sys.argv[1:]
    do_pin = "--pin" in args
    args = [a for a in args if a != "--pin"]
    reshard_bin = args[0] if args else os.path.join(ROOT, "build", "reshard")
    if do_pin:
        pin(reshard_bin)
    if os.path.isdir(GOLDEN):
        for d in ("safetensors", "rank", "index", "manifest", "torch"):
            shutil.rmtree(os.path.join(GOLDEN, d), ignore_errors=True)
    with tempfile.TemporaryDirectory() as work:
        safetensors_cases()
        rank_cases(reshard_bin, work)
        index_cases()
        torch_cases()
        manifest_cases(reshard_bin, work)
    pinned_cases()
    with open(os.path.join(GOLDEN, "expectations.json"), "w") as f:
        json.dump({"note": "written by tests/golden/make_golden.py; see tests/golden/README.md",
                   "cases": CASES}, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, n))
                for dp, _, ns in os.walk(GOLDEN) for n in ns)
    print(f"{len(CASES)} cases, {total} bytes under {GOLDEN}")


if __name__ == "__main__":
    main()
