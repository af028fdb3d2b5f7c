"""The hostile-file corpus tests/golden/ through the CLI: for every case of
tests/golden/expectations.json (tests/golden/make_golden.py), each listed command (`inspect`,
`verify`, `convert`) exits with the listed code and prints the listed message (file, field,
found, expected), within a 4 GiB address-space limit and a time limit: a broken file may not
make reshard crash, hang or allocate without bound. tests/core/golden_test.cc replays the same
table through the core library (also under ASan+UBSan).

Below it, the pinned set (tests/golden/pinned/, described in tests/golden/README.md): rank files
of today's writer that the current `reshard convert` must write again byte for byte."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
AS_LIMIT = 4 << 30


def _cases():
    table = json.loads((GOLDEN / "expectations.json").read_text())
    for c in table["cases"]:
        for run in c["cli"]:
            yield pytest.param(c, run, id=f"{c['file']}-{run['args'][0]}")


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def test_table_is_substantial():
    table = json.loads((GOLDEN / "expectations.json").read_text())
    assert len(table["cases"]) >= 50
    assert sum(len(c["cli"]) for c in table["cases"]) >= 80


@pytest.mark.parametrize("case,run", list(_cases()))
def test_cli_refuses_golden_file(reshard_bin, tmp_path, case, run):
    path = GOLDEN / case["file"]
    assert path.exists(), path
    args = [a.replace("{path}", str(path)).replace("{tmp}", str(tmp_path)) for a in run["args"]]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([reshard_bin, *args], capture_output=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL, preexec_fn=_limit)
    out = p.stdout.decode("utf-8", "replace")
    err = p.stderr.decode("utf-8", "replace")
    what = f"{case['what']}\n$ reshard {' '.join(args)}\nexit {p.returncode}\n{out}\n{err}"
    assert p.returncode == run["exit"], what
    for stream, text in (("stdout", out), ("stderr", err)):
        for needle in run.get(stream, []):
            assert needle in text, f"{stream} lacks {needle!r}\n{what}"
    if run["exit"] == 3:
        assert err.startswith("reshard: error: "), what
    if args[0] == "convert":
        # Nothing half-written is left that could be mistaken for output.
        assert not list(tmp_path.glob("out/*/rank-*.reshard")), what


# ---- the pinned set: format 1 as today's writer writes it ------------------------------------
# tests/golden/pinned/<set>/<layout>/rank-*.reshard were written by `reshard convert` of
# tests/golden/pinned-source.safetensors (tests/golden/make_golden.py --pin; the arguments per
# set are in tests/golden/pinned.json). A writer that changes what it writes for format 1 must
# fail here: converting the same source again has to give the same bytes. Nothing varies
# between two conversions by one binary (other threads, working directory or source path give
# identical files); between builds the `writer` string of the header may ("reshard " + version),
# and with it the preamble's header_size, header_xxh3 and preamble_xxh3, which the format
# derives from the header. The comparison masks exactly that and nothing else.

PINNED = json.loads((GOLDEN / "pinned.json").read_text())
SETS = sorted(PINNED["sets"])


def _reference_reader():
    """The pure-Python reader written from formats/rank-file.md alone (independent of the C++
    reader), loaded from this checkout: python/reshard/format.py (`reshard.format`), or
    tests/python/reference_reader.py should it live beside the tests."""
    for path in (Path(__file__).with_name("reference_reader.py"),
                 REPO / "python" / "reshard" / "format.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("_pinned_reference_reader", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            assert mod.have_xxh3() and mod.have_zstd(), "the reader needs XXH3 and zstd here"
            return mod
    pytest.fail("no pure-Python rank-file reader found")


rf = _reference_reader()


def _safetensors(path: Path) -> dict:
    """name -> (dtype, shape, bytes) of a safetensors file, read here byte by byte."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], v["shape"], raw[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items()}


def _layout_dir(name: str) -> Path:
    return GOLDEN / "pinned" / name / PINNED["sets"][name]["layout"]


def _split(raw: bytes):
    """(preamble fields as rf.decode_preamble reads them, header bytes) of a rank file."""
    p = rf.decode_preamble(raw[:rf.DATA_OFFSET], len(raw), "rank file", verify=True)
    return p, raw[p.header_offset:p.header_offset + p.header_size]


@functools.lru_cache(maxsize=64)
def _with_writer(pinned: bytes, writer: str) -> bytes:
    """The pinned file with only its header's `writer` value replaced, and the preamble fields
    the format derives from the header (header_size, header_xxh3, preamble_xxh3) recomputed."""
    p, header = _split(pinned)
    old = json.loads(header)["writer"]
    member = b'"writer": ' + json.dumps(old).encode()
    assert header.count(member) == 1, "the pinned header must hold its writer member once"
    new_header = header.replace(member, b'"writer": ' + json.dumps(writer).encode())
    head = pinned[:40] + struct.pack("<QQ", len(new_header), rf.xxh3_64(new_header))
    head += struct.pack("<Q", rf.xxh3_64(head))
    assert p.header_offset == len(pinned) - len(header)
    return head + pinned[64:p.header_offset] + new_header


def _first_difference(a: bytes, b: bytes) -> int:
    n, lo = min(len(a), len(b)), 0
    while lo < n and a[lo:lo + 4096] == b[lo:lo + 4096]:
        lo += 4096
    hi = min(lo + 4096, n)
    if a[lo:hi] == b[lo:hi]:
        return hi  # equal up to the shorter one's end
    while hi - lo > 1:  # the first difference is in [lo, hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


def _compare(pinned: bytes, new: bytes) -> str | None:
    """None when `new` equals `pinned` but for the writer string; else where it differs."""
    try:
        writer = json.loads(_split(new)[1])["writer"]
    except Exception as e:  # noqa: BLE001  (a file that does not even parse differs)
        return f"the new file does not parse as a rank file: {e}"
    if not isinstance(writer, str):
        return f"writer is {writer!r}, not a string"
    expected = _with_writer(pinned, writer)
    if new == expected:
        return None
    at = _first_difference(expected, new)
    p, _ = _split(expected)
    where = ("the preamble" if at < 64 else "the zero padding" if at < p.data_offset
             else "the data region" if at < p.header_offset else "the header")
    return (f"new file {len(new)} bytes, pinned file (writer masked) {len(expected)} bytes; first "
            f"difference at byte {at}, in {where}: pinned {expected[at:at + 16]!r}, new "
            f"{new[at:at + 16]!r}")


def _zstd_version(text: str) -> str:
    return next((x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("zstd:")), "")


@pytest.mark.parametrize("name", SETS)
def test_pinned_rank_files_verify_against_their_source(reshard_bin, name):
    p = subprocess.run([reshard_bin, "verify", str(_layout_dir(name)), "--source",
                        str(GOLDEN / PINNED["source"])], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    n = len(PINNED["sets"][name]["files"])
    assert p.stdout.startswith(f"OK: {n} files, {n * len(_safetensors(GOLDEN / PINNED['source']))} tensors")


@pytest.mark.parametrize("name", SETS)
def test_pinned_rank_files_read_by_the_reference_reader(name):
    src = _safetensors(GOLDEN / PINNED["source"])
    fp = rf.safetensors_file_fingerprint(str(GOLDEN / PINNED["source"]))
    ws = int(PINNED["sets"][name]["args"][PINNED["sets"][name]["args"].index("--world-size") + 1])
    codec = "zstd" if "--compress" in PINNED["sets"][name]["args"] else "raw"
    files = PINNED["sets"][name]["files"]
    assert files == [rf.rank_file_name(r, ws) for r in range(ws)]
    assert {dt for dt, _, _ in src.values()} >= {"BF16", "F32", "F16", "I64", "BOOL", "F8_E4M3"}
    rows_seen = {k: b"" for k in src}
    empty_shards = 0
    for r, fn in enumerate(files):
        f = rf.RankFile.open(_layout_dir(name) / fn)  # preamble, header and fingerprint checked
        assert (f.rank, f.world_size, f.layout_key) == (r, ws, PINNED["sets"][name]["layout"])
        assert f.header["format_version"] == 1 and f.header["layout"]["kind"] == "fsdp2"
        assert f.source["files"] == [fp]
        assert sorted(f.names()) == sorted(src)
        for t in f.tensors:
            dtype, shape, data = src[t.name]
            assert (t.dtype, t.global_shape) == (dtype, shape), t.name
            got = f.read_bytes(t)  # every chunk against chunk_xxh3
            if not shape:  # 0-dim: whole on every rank
                assert t.shard is None and got == data, t.name
                continue
            s, e = rf.chunk_rows(shape[0], ws, r)
            row = len(data) // shape[0]
            assert (t.shard.start, t.shard.end, t.local_shape) == (s, e, [e - s] + shape[1:]), t.name
            assert got == data[s * row:e * row], t.name
            assert t.codec == (codec if t.nbytes else t.codec), t.name
            empty_shards += t.nbytes == 0
            rows_seen[t.name] += got
        assert f.padding_is_zero()
    assert all(rows_seen[k] == d for k, (_, shape, d) in src.items() if shape), "ranks reassemble the source"
    assert empty_shards >= 2, "some ranks hold no rows of some tensors"
    assert any(len(t.chunk_xxh3) > 1 for t in rf.RankFile.open(_layout_dir(name) / files[0]).tensors)


@pytest.mark.parametrize("name", SETS)
def test_convert_writes_the_pinned_bytes_again(reshard_bin, tmp_path, name):
    """Today's binary, converting the pinned source again, writes the pinned rank files byte for
    byte, the writer string alone excepted. If this fails, the writer changed what it writes for
    format 1: tests/golden/README.md says when that needs a format version bump, and how to
    re-pin."""
    s = PINNED["sets"][name]
    if "--compress" in s["args"]:
        # zstd's compressed bytes belong to the zstd library, not to format 1: compare them only
        # with the library version the files were pinned with.
        ver = subprocess.run([reshard_bin, "--version"], capture_output=True, text=True).stdout
        if _zstd_version(ver) != _zstd_version("\n".join(PINNED["reshard_version"])):
            pytest.skip(f"zstd {_zstd_version(ver)} here, pinned with "
                        f"{_zstd_version(chr(10).join(PINNED['reshard_version']))}")
    out = tmp_path / "out"
    subprocess.run([reshard_bin, "convert", str(GOLDEN / PINNED["source"]), "-o", str(out),
                    *s["args"]], check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in (out / s["layout"]).iterdir()) == s["files"]
    for fn in s["files"]:
        pinned = (_layout_dir(name) / fn).read_bytes()
        new = (out / s["layout"] / fn).read_bytes()
        why = _compare(pinned, new)
        assert why is None, f"{name}/{fn}: {why}"


def test_pinned_comparison_masks_the_writer_and_nothing_else():
    """The comparison above: a file differing only by its writer string (checksums recomputed,
    also of another length) passes; one flipped bit anywhere else, or in the writer without the
    checksums following, fails."""
    for name in SETS:
        for fn in PINNED["sets"][name]["files"]:
            pinned = (_layout_dir(name) / fn).read_bytes()
            assert _compare(pinned, pinned) is None
            for writer in ("reshard 0.1.1", "reshard 10.20.30-dev+g1234567", ""):
                assert _compare(pinned, _with_writer(pinned, writer)) is None, writer
            p, header = _split(pinned)
            w = header.index(b'"writer": ') + p.header_offset
            offsets = (list(range(64)) + list(range(64, p.data_offset, 509))
                       + list(range(p.data_offset, p.header_offset, 13))
                       + list(range(p.header_offset, len(pinned))))
            for at in offsets:
                bad = bytearray(pinned)
                bad[at] ^= 0x01
                assert _compare(pinned, bytes(bad)) is not None, f"{name}/{fn}: flip at {at} (writer at {w})"
            assert _compare(pinned, pinned + b"\0") is not None
            assert _compare(pinned, pinned[:-1]) is not None
