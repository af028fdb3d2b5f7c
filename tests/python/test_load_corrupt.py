"""reshard.load never reports success on a corrupted or mismatched rank file, on CPU and (marker
gpu, run on the GPU machine by scripts/gpu_check.sh) on CUDA: a flipped bit in a zstd frame, in
raw data, in the header or the preamble; a file truncated or extended; a header spliced from
another rank with checksums made consistent; another rank's / world size's file in this rank's
place. Every case must raise reshard.ReshardError naming the file and what is wrong. Complements
test_load.py (raw-data bit flip on CPU) and test_gpu.py (raw-data bit flip on CUDA)."""

from __future__ import annotations

import ctypes
import json
import shutil
import struct

import pytest
import torch

import reshard
from checkpoints import make_checkpoint
from test_load import convert

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(b: bytes) -> int:
    return _xxh.XXH3_64bits(b, len(b))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "llama-bf16"
    make_checkpoint(str(path), "llama", "bf16", True)
    return path


def _device(device):
    if device == "cuda":
        assert torch.cuda.is_available(), "GPU test selected on a machine without CUDA"
        assert reshard.build_info()["cuda"], "reshard was built without CUDA"


def _model(out, device):
    model = reshard.empty_model(str(out))
    model.to_empty(device=device)
    return model


def _rank_path(out, ws=1, rank=0):
    return out / f"fsdp2-ws{ws}" / f"rank-{rank:05d}-of-{ws:05d}.reshard"


def _header(path):
    return json.loads(reshard._C._testing.read_header(str(path)))


def _flip(path, at, bit=0):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _refuses(model, out, pattern, error=reshard.CorruptFileError, **kw):
    with pytest.raises(error, match=pattern):
        reshard.load(model, str(out), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_flipped_bit_in_zstd_frame(src, tmp_path, device):
    _device(device)
    out = tmp_path / "out"
    convert(src, out, 1, "--compress", "zstd", "--chunk-size", "8192")
    path = _rank_path(out)
    e = max(_header(path)["tensors"], key=lambda t: t["stored_size"])
    off, size = e["frames"][0]
    for bit, at in ((0, size // 2), (5, size - 3), (2, 6)):  # block body, end, frame header
        broken = tmp_path / f"b{bit}"
        shutil.copytree(out, broken)
        _flip(_rank_path(broken), 4096 + e["offset"] + off + at, bit)
        for io in ("buffered", "readahead") if device == "cpu" else ("buffered", "direct"):
            _refuses(_model(broken, device), broken,
                     rf"rank-00000-of-00001.reshard: tensor \"{e['name']}\" chunk 0: "
                     r"(checksum mismatch|zstd frame)", io=io)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_truncated_or_extended_file(src, tmp_path, device, compress):
    _device(device)
    out = tmp_path / "out"
    convert(src, out, 1, *(["--compress", compress] if compress else []))
    path = _rank_path(out)
    raw = path.read_bytes()
    header_offset = struct.unpack_from("<Q", raw, 32)[0]
    for name, data, pattern in (
            ("in-data", raw[:4096 + (header_offset - 4096) // 2], r"file size: found .*the file is truncated"),
            ("in-header", raw[:-1], r"file size: found .*the file is truncated"),
            ("in-preamble", raw[:63], r"preamble: found a file of 63 bytes"),
            ("extended", raw + b"\0" * 4096, r"file size: found \d+ bytes, expected \d+")):
        path.write_bytes(data)
        _refuses(_model(out, device), out, rf"rank-00000-of-00001.reshard: {pattern}")
    path.write_bytes(raw)
    reshard.load(_model(out, device), str(out))  # the control: intact, it loads


@pytest.mark.parametrize("device", DEVICES)
def test_flipped_bit_in_header_or_preamble(src, tmp_path, device):
    _device(device)
    out = tmp_path / "out"
    convert(src, out, 1)
    path = _rank_path(out)
    raw = path.read_bytes()
    header_offset, header_size = struct.unpack_from("<QQ", raw, 32)
    _flip(path, header_offset + header_size // 2, 3)
    _refuses(_model(out, device), out, r"header_xxh3: .*the header is corrupt")
    path.write_bytes(raw)
    _flip(path, 20, 0)  # data_offset
    _refuses(_model(out, device), out, r"preamble_xxh3: .*preamble corrupt")


def _splice(data_file, header_file):
    """data_file's preamble and data with header_file's header, every checksum consistent."""
    a, b = data_file.read_bytes(), header_file.read_bytes()
    ver, flags, d_off, d_size, h_off = struct.unpack_from("<IIQQQ", a, 8)
    hb_off, hb_size = struct.unpack_from("<QQ", b, 32)
    header = b[hb_off:hb_off + hb_size]
    pre = a[:8] + struct.pack("<IIQQQQQ", ver, flags, d_off, d_size, h_off, len(header), xxh3(header))
    pre += struct.pack("<Q", xxh3(pre))
    return pre + a[64:h_off] + header


@pytest.mark.parametrize("device", DEVICES)
def test_header_spliced_from_another_rank(src, tmp_path, device):
    """Rank 1's header on rank 0's data, preamble and header checksums consistent: only the
    data checksums can tell, and the native loader must refuse every tensor that differs."""
    _device(device)
    out = tmp_path / "out"
    convert(src, out, 2)
    r0, r1 = _rank_path(out, 2, 0), _rank_path(out, 2, 1)
    spliced = tmp_path / "rank-00000-of-00002.reshard"
    spliced.write_bytes(_splice(r0, r1))
    header = _header(spliced)  # consistent: rank 1's tensors are no larger than rank 0's
    assert header["rank"] == 1
    dev = torch.device(device)
    refused = 0
    for e in header["tensors"]:
        if e["nbytes"] == 0:
            continue
        buf = torch.empty(e["nbytes"], dtype=torch.uint8, device=dev)
        try:
            reshard._C._testing.load_raw(str(spliced), [(e["name"], buf.data_ptr(), e["nbytes"], device == "cuda")],
                            **({"device": torch.cuda.current_device()} if device == "cuda" else {}))
        except reshard.CorruptFileError as err:
            assert "checksum mismatch" in str(err) and e["name"] in str(err), err
            refused += 1
    nonempty = [e for e in header["tensors"] if e["nbytes"]]
    assert len(nonempty) >= 10
    assert refused == len(nonempty), f"{len(nonempty) - refused} tensors of rank 1 loaded from rank 0's bytes"


@pytest.mark.parametrize("device", DEVICES)
def test_another_ranks_file_in_place(src, tmp_path, device):
    """A whole, valid rank file of another layout put where this job's file belongs."""
    _device(device)
    out = tmp_path / "out"
    convert(src, out, 1)
    convert(src, out, 2)
    shutil.copy(_rank_path(out, 2, 1), _rank_path(out, 1, 0))
    _refuses(_model(out, device), out, r"rank-00000-of-00001.reshard: holds rank 1 of 2, expected 0 of 1",
             error=reshard.LayoutMismatchError)
