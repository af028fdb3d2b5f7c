"""End-to-end tests of `reshard convert` / `reshard verify` against tiny real checkpoints.

Every rank file is read back with the independent pure-Python reader (tests/python/reference_reader.py) and
compared, bit for bit, with `torch.chunk(source, W, 0)[r]` (padded with empty shards, as
FSDP2 does) where the source tensor is read with `safetensors.safe_open`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import re
import shutil
import struct
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import reference_reader as rf
from checkpoints import load_source, weight_files

REPO = Path(__file__).resolve().parents[2]
WORLD_SIZES = [1, 2, 3, 5, 8]
DEFAULT_CHUNK = 256 * 1024  # formats/rank-file.md: the default chunk_size

# (arch, dtype, sharded, chunk_size or None for the default): every arch, both dtypes,
# sharded and single-file sources, default and 4 KiB chunks (multi-chunk tensors).
CASES = [
    ("llama", "bf16", True, None),
    ("llama", "fp32", False, 4096),
    ("qwen2", "bf16", False, 4096),
    ("qwen2", "fp32", True, None),
    ("gpt2", "bf16", True, 4096),
    ("gpt2", "fp32", False, None),
    ("bert", "fp32", True, 4096),
    ("bert", "bf16", False, None),
    ("mixed", "bf16", True, 4096),
    ("mixed", "fp32", False, None),
]

ST_DTYPE = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def case_id(c):
    arch, dtype, sharded, chunk = c
    return f"{arch}-{dtype}-{'sharded' if sharded else 'single'}" + (f"-cs{chunk}" if chunk else "")


# ---------------------------------------------------------------------------------------
# helpers


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (NaN-safe comparisons)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def expected_shard(src: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    """FSDP2's shard: torch.chunk on dim 0, padded with empty chunks; 0-dim stored whole."""
    if src.dim() == 0:
        return src
    chunks = torch.chunk(src, ws, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return src.new_empty((0, *src.shape[1:]))


def independent_source(ckpt: str) -> Dict:
    files = [rf.safetensors_file_fingerprint(os.path.join(ckpt, n)) for n in weight_files(ckpt)]
    files.sort(key=lambda f: f["name"])
    return {"files": files, "fingerprint": rf.source_fingerprint(files)}


def layout_dir(out, ws: int) -> Path:
    return Path(out) / f"fsdp2-ws{ws}"


def rank_paths(out, ws: int) -> List[Path]:
    return [layout_dir(out, ws) / rf.rank_file_name(r, ws) for r in range(ws)]


def tensor_region(path) -> tuple:
    """(absolute offset, size, name) of the largest stored tensor of a rank file."""
    f = rf.RankFile.open(path)
    t = max(f.tensors, key=lambda t: t.stored_size)
    assert t.stored_size > 0
    return f.preamble.data_offset + t.offset, t.stored_size, t.name


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x5A]))


def snapshot(out) -> Dict[str, tuple]:
    """path -> (mtime_ns, bytes) of every regular file under OUT except the lock and claim
    files."""
    snap = {}
    for root, _, files in os.walk(out):
        for n in files:
            if n in (".reshard.lock", ".reshard.convert"):
                continue
            p = os.path.join(root, n)
            with open(p, "rb") as fh:
                snap[os.path.relpath(p, out)] = (os.stat(p).st_mtime_ns, fh.read())
    return snap


def age_files(out, seconds_ago: float = 3600) -> None:
    """Sets every file's mtime into the past so that a rewrite cannot go unnoticed."""
    for root, _, files in os.walk(out):
        for n in files:
            p = os.path.join(root, n)
            st = os.stat(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds_ago * 1e9)))


def check_layout(out, ckpt: str, ws: int, src: Dict[str, torch.Tensor], *,
                 chunk_size: int = DEFAULT_CHUNK, codec: str = "raw") -> None:
    """Checks every rank file of OUT/fsdp2-wsN against the spec and the source tensors."""
    d = layout_dir(out, ws)
    names = sorted(os.listdir(d))
    assert names == sorted(rf.rank_file_name(r, ws) for r in range(ws)), names
    source = independent_source(ckpt)
    pieces: Dict[str, List[torch.Tensor]] = {k: [] for k in src}
    for r, path in enumerate(rank_paths(out, ws)):
        f = rf.RankFile.open(path)  # invariants 1-7, preamble/header checksums
        h = f.header
        assert h["format"] == "reshard.rank" and h["format_version"] == 1
        assert h["layout"] == {"key": f"fsdp2-ws{ws}", "kind": "fsdp2", "world_size": ws,
                               "dtype": "keep"}
        assert h["rank"] == r
        assert h["chunk_size"] == chunk_size
        assert h["source"] == source
        assert f.padding_is_zero(), f"{path}: non-zero bytes between tensors"
        assert sorted(f.names()) == sorted(src), f"{path}: tensor names differ from the source"
        for t in f.tensors:
            s = src[t.name]
            assert t.dtype == ST_DTYPE[s.dtype], t.name
            assert t.global_shape == list(s.shape), t.name
            want = expected_shard(s, ws, r)
            if s.dim() == 0:
                assert t.shard is None, f"{t.name}: a 0-dim tensor must be stored whole"
            else:
                assert t.shard is not None and t.shard.dim == 0
                assert t.shard.end - t.shard.start == want.shape[0], t.name
            assert t.local_shape == list(want.shape), (t.name, t.local_shape, want.shape)
            assert t.nbytes == want.numel() * want.element_size(), t.name
            assert t.codec == (codec if t.nbytes > 0 else t.codec), t.name
            assert len(t.chunk_xxh3) == -(-t.nbytes // chunk_size), t.name
            got = f.read_tensor(t.name)  # checks every chunk checksum
            assert same_bits(got, want), f"{path}: tensor {t.name} differs from torch.chunk"
            pieces[t.name].append(got)
    # The ranks reassemble the source exactly.
    for k, s in src.items():
        if s.dim() == 0:
            assert all(same_bits(p, s) for p in pieces[k]), k
        else:
            assert same_bits(torch.cat(pieces[k], dim=0), s), k


def convert(cli, ckpt, out, ws, *extra, rc=0):
    return cli("convert", ckpt, "-o", out, "--world-size", ws, *extra, rc=rc)


# ---------------------------------------------------------------------------------------
# the fixtures are what they claim to be


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_fixture_checkpoints(checkpoint, c):
    arch, dtype, sharded, _ = c
    ckpt = checkpoint(arch, dtype, sharded)
    files = weight_files(ckpt)
    assert len(files) >= 3 if sharded else files == ["model.safetensors"]
    src = load_source(ckpt)
    dims0 = {t.shape[0] for t in src.values() if t.dim() > 0}
    # Awkward dim-0 sizes: some not divisible by 3, 5 and 8, and some smaller than 8.
    assert any(n % 3 and n % 5 and n % 8 for n in dims0), dims0
    assert any(0 < n < 8 for n in dims0), dims0
    if arch != "mixed":
        want = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert {t.dtype for t in src.values()} == {want}
        assert os.path.exists(os.path.join(ckpt, "config.json"))
    if arch == "llama":
        assert "lm_head.weight" in src  # untied
    if arch == "qwen2":
        assert "lm_head.weight" not in src  # tied to the embeddings
        assert "model.layers.0.self_attn.k_proj.bias" in src
        assert src["model.layers.0.self_attn.k_proj.bias"].shape == (6,)
    if arch == "mixed":
        assert any(t.dim() == 0 for t in src.values())
        assert any(t.numel() == 0 for t in src.values())


def test_shard_rule_matches_fsdp2():
    """The spec's rule (as implemented by reference_reader) equals FSDP2's own chunking."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    for n in [0, 1, 2, 5, 6, 7, 37, 64, 101]:
        x = torch.arange(n)
        for ws in [1, 2, 3, 4, 5, 8, 13, 67]:
            chunks = _chunk_with_empty(x, ws, dim=0)
            for r in range(ws):
                s, e = rf.chunk_rows(n, ws, r)
                assert torch.equal(chunks[r], x[s:e]), (n, ws, r)


# ---------------------------------------------------------------------------------------
# conversion is exact


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_convert_matches_torch_chunk(cli, checkpoint, tmp_path, c, ws):
    arch, dtype, sharded, chunk = c
    ckpt = checkpoint(arch, dtype, sharded)
    out = tmp_path / "out"
    extra = ["--chunk-size", chunk] if chunk else []
    r = convert(cli, ckpt, out, ws, *extra)
    assert f"wrote {ws} rank file(s) of fsdp2-ws{ws}" in r.out, r
    check_layout(out, ckpt, ws, load_source(ckpt), chunk_size=chunk or DEFAULT_CHUNK)
    v = cli("verify", out, "--source", ckpt, rc=0)
    assert v.out.startswith("OK:"), v
    assert f"OK: {ws} files" in v.out, v


@pytest.mark.parametrize("arch", ["qwen2", "mixed"])
def test_convert_many_ranks(cli, checkpoint, tmp_path, arch):
    """World size above the converter's 64-open-files group size; most ranks are empty."""
    ckpt = checkpoint(arch, "bf16", True)
    out = tmp_path / "out"
    convert(cli, ckpt, out, 67, "--compress", "zstd", "--chunk-size", 4096)
    check_layout(out, ckpt, 67, load_source(ckpt), chunk_size=4096, codec="zstd")
    cli("verify", out, "--source", ckpt, rc=0)


def test_convert_hf_cache_symlinks(cli, checkpoint, tmp_path):
    """Hugging Face hub snapshots are directories of symlinks into a blobs directory."""
    ckpt = checkpoint("qwen2", "fp32", True)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(ckpt))):
        shutil.copyfile(os.path.join(ckpt, name), blobs / f"blob{i}")
        os.symlink(os.path.relpath(blobs / f"blob{i}", snap), snap / name)
    out = tmp_path / "out"
    convert(cli, snap, out, 3)
    check_layout(out, str(snap), 3, load_source(ckpt))
    assert not (out / "config.json").is_symlink()
    assert (out / "config.json").read_bytes() == Path(ckpt, "config.json").read_bytes()
    cli("verify", out, "--source", snap, rc=0)


def test_convert_single_safetensors_file(cli, checkpoint, tmp_path):
    ckpt = checkpoint("gpt2", "bf16", False)
    out = tmp_path / "out"
    convert(cli, os.path.join(ckpt, "model.safetensors"), out, 3)
    check_layout(out, ckpt, 3, load_source(ckpt))
    cli("verify", out, "--source", os.path.join(ckpt, "model.safetensors"), rc=0)
    cli("verify", out, "--source", ckpt, rc=0)


@pytest.mark.parametrize("level", ["zstd", "zstd:1", "zstd:19"])
@pytest.mark.parametrize("arch", ["llama", "mixed"])
def test_zstd_round_trip_equals_raw(cli, checkpoint, tmp_path, arch, level):
    ckpt = checkpoint(arch, "fp32", True)
    raw_out, z_out = tmp_path / "raw", tmp_path / "zstd"
    convert(cli, ckpt, raw_out, 5, "--chunk-size", 4096)
    r = convert(cli, ckpt, z_out, 5, "--chunk-size", 4096, "--compress", level)
    assert "zstd stored" in r.out, r
    check_layout(z_out, ckpt, 5, load_source(ckpt), chunk_size=4096, codec="zstd")
    n_frames = 0
    for rp, zp in zip(rank_paths(raw_out, 5), rank_paths(z_out, 5)):
        a, b = rf.RankFile.open(rp), rf.RankFile.open(zp)
        assert a.names() == b.names()
        for ta in a.tensors:
            tb = b.entry(ta.name)
            assert ta.codec == "raw"
            if tb.nbytes:
                assert tb.codec == "zstd" and len(tb.frames) == len(tb.chunk_xxh3)
                n_frames += len(tb.frames)
            assert tb.chunk_xxh3 == ta.chunk_xxh3 and tb.xxh3 == ta.xxh3
            assert a.read_bytes(ta) == b.read_bytes(tb), ta.name
    assert n_frames > 0
    cli("verify", z_out, "--source", ckpt, rc=0)


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_output_is_deterministic(cli, checkpoint, tmp_path, compress):
    """The same conversion with 1 and 3 threads gives byte-identical files."""
    ckpt = checkpoint("mixed", "bf16", True)
    extra = ["--chunk-size", 4096] + (["--compress", compress] if compress else [])
    convert(cli, ckpt, tmp_path / "a", 5, "--threads", 1, *extra)
    convert(cli, ckpt, tmp_path / "b", 5, "--threads", 3, *extra)
    for pa, pb in zip(rank_paths(tmp_path / "a", 5), rank_paths(tmp_path / "b", 5)):
        assert pa.read_bytes() == pb.read_bytes(), pa.name


def test_convert_json_summary(cli, checkpoint, tmp_path):
    ckpt = checkpoint("llama", "bf16", True)
    src = load_source(ckpt)
    total = sum(t.numel() * t.element_size() for t in src.values())
    out = tmp_path / "out"
    r = convert(cli, ckpt, out, 5, "--json")
    j = json.loads(r.out)
    assert j["layout"] == "fsdp2-ws5" and j["world_size"] == 5
    assert Path(j["layout_dir"]) == out / "fsdp2-ws5"
    assert j["ranks_written"] == [0, 1, 2, 3, 4] and j["ranks_up_to_date"] == []
    assert j["bytes_read"] == total and j["bytes_decoded"] == total
    assert j["bytes_stored"] == total
    assert j["layout_complete"] is True
    r = convert(cli, ckpt, out, 5, "--json")
    j = json.loads(r.out)
    assert j["ranks_written"] == [] and j["ranks_up_to_date"] == [0, 1, 2, 3, 4]
    assert j["bytes_read"] == 0 and j["layout_complete"] is True


# ---------------------------------------------------------------------------------------
# verify finds damage


@pytest.fixture
def converted(cli, checkpoint, tmp_path):
    """A complete fsdp2-ws5 output of the sharded llama checkpoint, verified."""
    ckpt = checkpoint("llama", "bf16", True)
    out = tmp_path / "out"
    convert(cli, ckpt, out, 5, "--chunk-size", 4096)
    cli("verify", out, "--source", ckpt, rc=0)
    return ckpt, out


@pytest.mark.parametrize("with_source", [False, True])
def test_verify_detects_flipped_data_byte(cli, converted, with_source):
    ckpt, out = converted
    path = rank_paths(out, 5)[2]
    offset, size, name = tensor_region(path)
    flip_byte(path, offset + size // 2)
    args = ["--source", ckpt] if with_source else []
    r = cli("verify", out, *args, rc=1)
    lines = [l for l in r.out.splitlines() if str(path) in l and f'tensor "{name}"' in l]
    assert lines, f"no line names {path} and tensor {name}\n{r}"
    assert "FAILED" in r.out
    # Other ranks are not blamed.
    others = [l for l in r.out.splitlines() if "rank-" in l and str(path) not in l]
    assert not others, r
    # The rank file alone, and the independent reader, see it too.
    r = cli("verify", path, rc=1)
    assert f'tensor "{name}"' in r.out, r
    f = rf.RankFile.open(path)
    with pytest.raises(rf.ChecksumError, match=re.escape(name)):
        f.read_bytes(name)


def test_verify_detects_flipped_zstd_byte(cli, checkpoint, tmp_path):
    ckpt = checkpoint("mixed", "fp32", True)
    out = tmp_path / "out"
    convert(cli, ckpt, out, 2, "--chunk-size", 4096, "--compress", "zstd")
    path = rank_paths(out, 2)[0]
    offset, size, name = tensor_region(path)
    flip_byte(path, offset + size // 2)
    r = cli("verify", out, rc=1)
    assert any(str(path) in l and f'tensor "{name}"' in l for l in r.out.splitlines()), r
    with pytest.raises(rf.FormatError):
        rf.RankFile.open(path).read_bytes(name)


@pytest.mark.parametrize("where", ["preamble", "header"])
def test_verify_detects_flipped_metadata_byte(cli, converted, where):
    _, out = converted
    path = rank_paths(out, 5)[1]
    f = rf.RankFile.open(path)
    offset = 20 if where == "preamble" else f.preamble.header_offset + f.preamble.header_size // 2
    flip_byte(path, offset)
    r = cli("verify", out, rc=1)
    assert any(str(path) in l for l in r.out.splitlines() if not l.startswith("FAILED")), r
    with pytest.raises(rf.FormatError):
        rf.RankFile.open(path)


@pytest.mark.parametrize("cut", [1, 4096, "half", "all"])
def test_verify_detects_truncation(cli, converted, cut):
    ckpt, out = converted
    path = rank_paths(out, 5)[3]
    size = path.stat().st_size
    new = {"half": size // 2, "all": 0}.get(cut, size - cut if isinstance(cut, int) else 0)
    os.truncate(path, new)
    r = cli("verify", out, "--source", ckpt, rc=1)
    assert any(str(path) in l for l in r.out.splitlines()), r
    r = cli("verify", path, rc=1)
    assert str(path) in r.out, r
    with pytest.raises(rf.FormatError):
        rf.RankFile.open(path)


def test_verify_detects_deleted_rank_file(cli, converted):
    ckpt, out = converted
    path = rank_paths(out, 5)[4]
    path.unlink()
    r = cli("verify", out, rc=1)
    assert any(str(path) in l for l in r.out.splitlines()), r
    r = cli("verify", out, "--source", ckpt, rc=1)
    assert any(str(path) in l for l in r.out.splitlines()), r


@pytest.mark.parametrize("rank", [0, 2, 4])
def test_verify_layout_dir_names_missing_rank_file(cli, converted, rank):
    """`verify OUT/fsdp2-ws5` (a layout directory, no manifest there) with one rank file
    deleted must name the missing file by its real path."""
    _, out = converted
    path = rank_paths(out, 5)[rank]
    path.unlink()
    r = cli("verify", layout_dir(out, 5), rc=1)
    assert f"rank {rank} of 5 is missing" in r.out, r
    assert any(l.startswith(f"{path}:") for l in r.out.splitlines()), (
        f"expected a line starting with {path}:\n{r}")


def test_verify_detects_other_source(cli, checkpoint, converted):
    _, out = converted
    other = checkpoint("llama", "bf16", True, seed=1)  # same names and shapes, other values
    r = cli("verify", out, "--source", other, rc=1)
    assert "differs from the source" in r.out, r


def test_verify_detects_damaged_manifest_and_missing_aux_file(cli, converted):
    ckpt, out = converted
    (out / "config.json").unlink()
    r = cli("verify", out, rc=1)
    assert any(l.startswith(f"{out / 'config.json'}:") for l in r.out.splitlines()), r
    (out / "reshard.json").write_text("{}")
    r = cli("verify", out, rc=1)
    assert "reshard.json" in r.out, r


def test_verify_json_report(cli, converted):
    ckpt, out = converted
    src = load_source(ckpt)
    total = sum(t.numel() * t.element_size() for t in src.values())
    j = json.loads(cli("verify", out, "--source", ckpt, "--json", rc=0).out)
    assert j["ok"] is True and j["problems"] == []
    assert j["layouts"] == ["fsdp2-ws5"] and j["files"] == 5
    assert j["tensors"] == 5 * len(src)
    assert j["bytes"] == total and j["source_bytes_compared"] == total
    path = rank_paths(out, 5)[0]
    offset, size, name = tensor_region(path)
    flip_byte(path, offset)
    j = json.loads(cli("verify", out, "--json", rc=1).out)
    assert j["ok"] is False
    assert any(p["file"] == str(path) and p["tensor"] == name for p in j["problems"]), j


# ---------------------------------------------------------------------------------------
# incremental conversion, re-runs, layouts side by side


def test_ranks_split_across_runs(cli, checkpoint, tmp_path):
    ckpt = checkpoint("qwen2", "bf16", True)
    out = tmp_path / "out"
    r = convert(cli, ckpt, out, 5, "--ranks", "0-1")
    assert "wrote 2 rank file(s)" in r.out and "not complete yet" in r.out, r
    assert sorted(os.listdir(layout_dir(out, 5))) == [rf.rank_file_name(i, 5) for i in (0, 1)]
    m = rf.read_manifest(out)
    entry = m["layouts"]["fsdp2-ws5"]
    assert entry["complete"] is False
    assert [x["rank"] for x in entry["ranks"]] == [0, 1]
    r = cli("verify", out, rc=1)
    assert "incomplete" in r.out, r
    age_files(out)
    before = snapshot(out)

    r = convert(cli, ckpt, out, 5, "--ranks", "2-4")
    assert "wrote 3 rank file(s)" in r.out and "not complete" not in r.out, r
    after = snapshot(out)
    for name in (rf.rank_file_name(i, 5) for i in (0, 1)):
        key = os.path.join("fsdp2-ws5", name)
        assert after[key] == before[key], f"{name} was rewritten"
    m = rf.read_manifest(out)
    entry = m["layouts"]["fsdp2-ws5"]
    assert entry["complete"] is True
    assert [x["rank"] for x in entry["ranks"]] == [0, 1, 2, 3, 4]
    check_layout(out, ckpt, 5, load_source(ckpt))
    cli("verify", out, "--source", ckpt, rc=0)
    # Identical to a conversion in one go.
    convert(cli, ckpt, tmp_path / "whole", 5)
    for a, b in zip(rank_paths(out, 5), rank_paths(tmp_path / "whole", 5)):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_single_rank_flag(cli, checkpoint, tmp_path):
    ckpt = checkpoint("gpt2", "fp32", True)
    out = tmp_path / "out"
    convert(cli, ckpt, out, 8, "--ranks", "7")
    assert os.listdir(layout_dir(out, 8)) == [rf.rank_file_name(7, 8)]
    entry = rf.read_manifest(out)["layouts"]["fsdp2-ws8"]
    assert [x["rank"] for x in entry["ranks"]] == [7] and entry["complete"] is False


def test_rerun_on_complete_output_changes_nothing(cli, converted):
    ckpt, out = converted
    age_files(out)
    before = snapshot(out)
    manifest_before = rf.read_manifest(out)
    r = convert(cli, ckpt, out, 5, "--chunk-size", 4096)
    assert "already up to date" in r.out, r
    after = snapshot(out)
    assert set(after) == set(before)
    for k in before:
        if k == "reshard.json":  # rebuilt at the end of every run, same contents
            assert rf.read_manifest(out) == manifest_before
            continue
        assert after[k] == before[k], f"{k} changed (mtime or contents)"


def test_rerun_rewrites_only_missing_or_damaged_ranks(cli, converted):
    ckpt, out = converted
    paths = rank_paths(out, 5)
    original = {p: p.read_bytes() for p in paths}
    paths[1].unlink()
    os.truncate(paths[3], 100)
    age_files(out)
    before = snapshot(out)
    j = json.loads(convert(cli, ckpt, out, 5, "--chunk-size", 4096, "--json").out)
    assert j["ranks_written"] == [1, 3] and j["ranks_up_to_date"] == [0, 2, 4], j
    after = snapshot(out)
    for i in (0, 2, 4):
        k = os.path.join("fsdp2-ws5", paths[i].name)
        assert after[k] == before[k]
    for p in paths:
        assert p.read_bytes() == original[p], p.name
    cli("verify", out, "--source", ckpt, rc=0)


def test_stale_temporary_files_are_removed(cli, converted):
    ckpt, out = converted
    d = layout_dir(out, 5)
    stale = d / ".rank-00002-of-00005.reshard.tmp-999999"
    stale.write_bytes(b"partial")
    convert(cli, ckpt, out, 5, "--chunk-size", 4096)
    assert not stale.exists()
    assert sorted(os.listdir(d)) == [rf.rank_file_name(i, 5) for i in range(5)]


def test_two_layouts_side_by_side(cli, checkpoint, tmp_path):
    ckpt = checkpoint("bert", "fp32", True)
    out = tmp_path / "out"
    src = load_source(ckpt)
    convert(cli, ckpt, out, 2)
    age_files(out)
    before = snapshot(out)
    convert(cli, ckpt, out, 3, "--compress", "zstd")
    after = snapshot(out)
    for k, v in before.items():
        if k.startswith("fsdp2-ws2"):
            assert after[k] == v, f"{k} was touched by the second layout's conversion"
    m = rf.read_manifest(out)
    assert sorted(m["layouts"]) == ["fsdp2-ws2", "fsdp2-ws3"]
    for key, ws in (("fsdp2-ws2", 2), ("fsdp2-ws3", 3)):
        assert m["layouts"][key]["complete"] is True
        assert len(m["layouts"][key]["ranks"]) == ws
    check_layout(out, ckpt, 2, src)
    check_layout(out, ckpt, 3, src, codec="zstd")
    v = cli("verify", out, "--source", ckpt, rc=0)
    assert "OK: 5 files" in v.out, v


def test_other_checkpoint_into_same_out_is_refused(cli, checkpoint, tmp_path):
    ckpt = checkpoint("llama", "bf16", True)
    other = checkpoint("qwen2", "bf16", True)
    out = tmp_path / "out"
    convert(cli, ckpt, out, 2)
    age_files(out)
    before = snapshot(out)
    r = convert(cli, other, out, 3, rc=3)
    assert str(out) in r.err and "another source" in r.err, r
    assert snapshot(out) == before
    assert not layout_dir(out, 3).exists()
    convert(cli, other, out, 2, rc=3)  # the same layout key: refused as well
    assert snapshot(out) == before
    cli("verify", out, "--source", ckpt, rc=0)


def test_same_shaped_checkpoint_with_other_weights(cli, checkpoint, tmp_path):
    """A checkpoint with the same tensor names, shapes and file sizes but other values (the
    next training step, a fine-tune) converted into an OUT that holds the first one must be
    refused or converted, never reported "already up to date" with the old weights kept."""
    ckpt = checkpoint("llama", "bf16", True)
    other = checkpoint("llama", "bf16", True, seed=1)
    assert load_source(ckpt).keys() == load_source(other).keys()
    out = tmp_path / "out"
    convert(cli, ckpt, out, 2)
    r = convert(cli, other, out, 2, rc=None)  # any exit code
    if r.rc == 0:
        v = cli("verify", out, "--source", other)
        assert v.rc == 0, f"convert exited 0 but OUT still holds the other weights\n{r}\n{v}"
    else:
        assert r.rc == 3 and "another source" in r.err, r
        cli("verify", out, "--source", ckpt, rc=0)


def test_concurrent_conversion_is_refused(cli, checkpoint, tmp_path):
    ckpt = checkpoint("qwen2", "fp32", False)
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / ".reshard.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        t0 = time.monotonic()
        r = convert(cli, ckpt, out, 2, "--lock-wait", "1", rc=3)
        assert time.monotonic() - t0 >= 1.0, "gave up before --lock-wait ran out"
        assert "another reshard process" in r.err, r
        assert not layout_dir(out, 2).exists()
    finally:
        os.close(fd)
    convert(cli, ckpt, out, 2)
    cli("verify", out, "--source", ckpt, rc=0)


# ---------------------------------------------------------------------------------------
# the output directory: aux files, manifest, headers


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_aux_files_copied(cli, checkpoint, tmp_path, arch):
    ckpt = checkpoint(arch, "bf16", True)
    out = tmp_path / "out"
    # Tokenizer-like files are copied too when present.
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (src / "not_an_aux_file.txt").write_text("ignored")
    convert(cli, src, out, 3)
    expected = ["config.json", "tokenizer_config.json"]
    if arch == "llama":
        expected.append("generation_config.json")
    assert (src / "generation_config.json").exists() == (arch == "llama")
    for name in expected:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert not (out / "not_an_aux_file.txt").exists()
    assert not (out / "model.safetensors.index.json").exists()
    assert not any(n.endswith(".safetensors") for n in os.listdir(out))
    m = rf.read_manifest(out)
    assert sorted(m["aux_files"]) == sorted(expected)


def test_manifest_contents(cli, checkpoint, tmp_path):
    ckpt = checkpoint("gpt2", "bf16", True)
    out = tmp_path / "out"
    for ws in (8, 1, 3):
        convert(cli, ckpt, out, ws)
    m = rf.read_manifest(out)  # strict: types, duplicate keys, fingerprint, file names
    assert m["format"] == "reshard.manifest" and m["format_version"] == 1
    assert m["writer"] == f"reshard {project_version()}"
    assert m["source"] == independent_source(ckpt)
    assert sorted(m["aux_files"]) == ["config.json", "generation_config.json"]
    assert sorted(m["layouts"]) == ["fsdp2-ws1", "fsdp2-ws3", "fsdp2-ws8"]
    for ws in (1, 3, 8):
        key = f"fsdp2-ws{ws}"
        e = m["layouts"][key]
        assert e["kind"] == "fsdp2" and e["world_size"] == ws and e["dtype"] == "keep"
        assert e["dir"] == key and e["complete"] is True
        assert [x["rank"] for x in e["ranks"]] == list(range(ws))
        for x, path in zip(e["ranks"], rank_paths(out, ws)):
            assert x["file"] == path.name
            assert x["size"] == path.stat().st_size
            f = rf.RankFile.open(path)
            with open(path, "rb") as fh:
                fh.seek(f.preamble.header_offset)
                header_bytes = fh.read()
            assert x["header_xxh3"] == rf.hex16(rf.xxh3_64(header_bytes))
    assert sorted(os.listdir(out)) == sorted(
        [".reshard.lock", ".reshard.convert", "reshard.json", "config.json", "generation_config.json",
         "fsdp2-ws1", "fsdp2-ws3", "fsdp2-ws8"])


def project_version() -> str:
    text = (REPO / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*reshard\s+VERSION\s+([0-9.]+)", text)
    assert m, "no project(reshard VERSION x.y.z) in CMakeLists.txt"
    return m.group(1)


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_rank_file_headers_match_spec(cli, checkpoint, tmp_path, compress):
    ckpt = checkpoint("qwen2", "bf16", True)
    out = tmp_path / "out"
    extra = ["--compress", compress] if compress else []
    convert(cli, ckpt, out, 3, *extra)
    m = rf.read_manifest(out)
    expected_source = independent_source(ckpt)
    seen_files = set()
    for r, path in enumerate(rank_paths(out, 3)):
        raw = path.read_bytes()
        # Preamble, decoded by hand from the spec's table.
        magic, ver, flags, d_off, d_size, h_off, h_size, h_xxh, p_xxh = struct.unpack_from(
            "<8sIIQQQQQQ", raw, 0)
        assert magic == b"\x89RSHD\r\n\x1a" and ver == 1 and flags == 0
        assert d_off == 4096 and d_size % 4096 == 0 and h_off == d_off + d_size
        assert len(raw) == h_off + h_size
        assert p_xxh == rf.xxh3_64(raw[:56])
        assert h_xxh == rf.xxh3_64(raw[h_off:])
        assert raw[64:4096] == bytes(4096 - 64)
        h = json.loads(raw[h_off:].decode("utf-8"))
        assert set(h) == {"format", "format_version", "writer", "layout", "rank", "source",
                          "chunk_size", "tensors"}
        assert h["writer"] == f"reshard {project_version()}"
        assert h["layout"]["key"] == "fsdp2-ws3" and h["layout"]["world_size"] == 3
        assert h["rank"] == r
        assert h["source"] == m["source"] == expected_source
        assert h["chunk_size"] == DEFAULT_CHUNK
        offsets = [t["offset"] for t in h["tensors"]]
        assert offsets == sorted(offsets)
        for t in h["tensors"]:
            keys = {"name", "dtype", "global_shape", "shard", "local_shape", "nbytes", "offset",
                    "stored_size", "codec", "chunk_xxh3", "xxh3"}
            if t["codec"] == "zstd":
                keys.add("frames")
            assert set(t) == keys, t["name"]
            assert t["codec"] == (compress or "raw") or t["nbytes"] == 0
            s, e = rf.chunk_rows(t["global_shape"][0], 3, r)
            assert t["shard"] == {"dim": 0, "start": s, "end": e}
            if t["codec"] == "raw":
                assert t["offset"] % 4096 == 0 and t["stored_size"] == t["nbytes"]
            chunks = [int(c, 16) for c in t["chunk_xxh3"]]
            assert t["xxh3"] == rf.hex16(rf.xxh3_64(b"".join(struct.pack("<Q", c) for c in chunks)))
            if t["nbytes"] == 0:
                assert t["chunk_xxh3"] == [] and t["xxh3"] == rf.hex16(rf.xxh3_64(b""))
            seen_files.add(t["name"])
    assert seen_files == set(load_source(ckpt))


def test_disjoint_rank_conversions_run_at_the_same_time(reshard_bin, cli, checkpoint, tmp_path):
    """Two `--ranks` conversions into one OUT at once (as on two machines sharing a
    directory): both succeed, and the manifest ends complete and verified."""
    import subprocess

    ckpt = checkpoint("llama", "bf16", True)
    out = tmp_path / "out"
    procs = [subprocess.Popen([reshard_bin, "convert", str(ckpt), "-o", str(out), "--world-size", "6",
                               "--ranks", r, "--threads", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ("0-2", "3-5")]
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["layouts"]["fsdp2-ws6"]["complete"] is True
    assert [r["rank"] for r in manifest["layouts"]["fsdp2-ws6"]["ranks"]] == list(range(6))
    assert not [p.name for p in layout_dir(out, 6).iterdir() if ".tmp-" in p.name]
    cli("verify", out, "--source", ckpt, rc=0)


def test_sigkill_at_many_points_never_leaves_a_valid_looking_partial_output(reshard_bin, cli, tmp_path):
    """`reshard convert` killed with SIGKILL at many points: every rank file under its final
    name verifies on its own, the layout verifies only when complete, and a re-run completes
    it. The source is large enough (tiny chunks) that kills land mid-write."""
    import signal
    import subprocess

    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(7)
    save_file({f"w{i}": torch.randn(509, 1031, generator=g) for i in range(12)},
              str(src / "model.safetensors"))
    out = tmp_path / "out"
    cmd = [reshard_bin, "convert", str(src), "-o", str(out), "--world-size", "5",
           "--chunk-size", "4096", "--threads", "2"]
    # Time full runs to spread the kill points over one: the faster of two (the first reads a
    # cold source), and the kills over its first 70 % (a loaded machine makes later runs faster
    # or slower than the timed one; kills past a run's end kill nothing).
    full = float("inf")
    for _ in range(2):
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, capture_output=True)
        full = min(full, time.monotonic() - t0)
    kills = 0
    for k in range(12):
        shutil.rmtree(out)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.7 * full * (k + 0.5) / 12)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        layout = layout_dir(out, 5)
        finals = sorted(layout.glob("rank-*.reshard")) if layout.exists() else []
        for f in finals:  # a file under its final name is complete and intact
            cli("verify", f, rc=0)
        complete = len(finals) == 5
        cli("verify", out, "--source", src, rc=0 if complete and (out / "reshard.json").exists() else None)
        if not complete and (out / "reshard.json").exists():
            cli("verify", out, "--source", src, rc=1)
        subprocess.run(cmd, check=True, capture_output=True)  # re-run completes it
        cli("verify", out, "--source", src, rc=0)
        assert not [q.name for q in layout.iterdir() if ".tmp-" in q.name]
    assert kills >= 6, f"only {kills} of 12 runs were still running when killed"


def test_output_inside_a_layout_directory_is_refused_even_with_force(cli, checkpoint, tmp_path):
    """-o OUT/fsdp2-ws2 (a layout directory of OUT): refused, --force or not, naming -o OUT; nothing
    is written there (it once wrote a second output, reshard.json and all, inside the first)."""
    src = checkpoint("llama", "bf16", False)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    inner = out / "fsdp2-ws2"
    before = sorted(os.listdir(inner))
    for extra in ((), ("--force",)):
        r = cli("convert", src, "-o", inner, "--world-size", 2, *extra, rc=3)
        assert f"{inner}: a layout directory of {out}" in r.err and f"(-o {out}; a conversion adds its layout" in r.err, r.err
        assert sorted(os.listdir(inner)) == before
    cli("verify", out, "--source", src, rc=0)


def test_a_reshard_output_as_the_source_names_relayout_and_export(cli, checkpoint, tmp_path):
    """convert of a reshard output (or a save) as its source: refused before anything runs or is
    created, naming relayout and export (it said "not a Hugging Face checkpoint" and left -o behind)."""
    src = checkpoint("llama", "bf16", False)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    r = cli("convert", out, "-o", tmp_path / "x", "--world-size", 3, rc=3, env={"RESHARD_MODEL_CAPTURE": "1"})
    assert (f"{out}: the output of reshard convert, not a Hugging Face checkpoint: reshard relayout {out} "
            f"--world-size N makes another world size (or layout) inside it; reshard export {out} -o DIR") in r.err, r.err
    assert "capturing" not in r.err and not (tmp_path / "x").exists()
