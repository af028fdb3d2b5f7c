"""The reshard command line: exit codes (0 ok, 1 verify found problems, 2 bad usage,
3 operation failed), messages, --version, and `inspect` on every kind of path."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import reference_reader as rf
from checkpoints import load_source, weight_files

REPO = Path(__file__).resolve().parents[2]


def project_version() -> str:
    m = re.search(r"project\(\s*reshard\s+VERSION\s+([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    assert m, "no project(reshard VERSION x.y.z) in CMakeLists.txt"
    return m.group(1)


def source_nbytes(ckpt) -> int:
    return sum(t.numel() * t.element_size() for t in load_source(ckpt).values())


@pytest.fixture
def ckpt(checkpoint):
    return checkpoint("qwen2", "bf16", True)


@pytest.fixture
def out_ws3(cli, ckpt, tmp_path):
    out = tmp_path / "out"
    cli("convert", ckpt, "-o", out, "--world-size", 3, rc=0)
    return out


# ---------------------------------------------------------------------------------------
# top level


def test_version(cli):
    r = cli("--version", rc=0)
    lines = r.out.rstrip("\n").split("\n")
    assert lines[:2] == [f"reshard {project_version()}", "rank file format: 1"], r
    patterns = [r"CUDA: (yes \([0-9.]+\)|no \(CPU-only build\))", r"zstd: [0-9]+\.[0-9]+\.[0-9]+",
                r"xxhash: [0-9]+\.[0-9]+\.[0-9]+",
                r"compiler: (GNU|Clang|AppleClang|IntelLLVM) [0-9.]+", r"build type: \S+",
                r"Python extension: (not built|Python 3\.[0-9]+, pybind11 [0-9.]+ \(no torch headers: "
                r"works with any torch 2\.x( of CUDA [0-9]+\.x)?\))",
                r"torch at build time: (none \(not needed\)|2\.[0-9]+\.[0-9]+\S*)"]
    assert len(lines) == 2 + len(patterns), r
    for line, pattern in zip(lines[2:], patterns):
        assert re.fullmatch(pattern, line), (line, pattern)
    # The Python extension of the same build reports the same facts.
    try:
        from reshard import _C
    except ImportError:
        return  # no extension next to this CLI (a C++-only build): nothing to compare
    if os.path.dirname(os.path.abspath(_C.__file__)) != str(REPO / "python" / "reshard"):
        return  # an installed reshard, not this build's
    assert _C.build_info()["version_text"] == r.out.rstrip("\n")


def test_subcommand_help_has_examples(cli):
    for cmd in ("convert", "verify", "inspect"):
        r = cli(cmd, "--help", rc=0)
        assert "Examples:\n  reshard " + cmd in r.out, r


def test_help(cli):
    r = cli("--help", rc=0)
    for word in ("convert", "verify", "inspect", "Exit codes"):
        assert word in r.out, r
    r = cli("convert", "--help", rc=0)
    for flag in ("--world-size", "--ranks", "--compress", "--json", "--threads"):
        assert flag in r.out, r


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["--no-such-flag"]])
def test_no_or_unknown_subcommand(cli, args):
    r = cli(*args, rc=2)
    assert r.err.strip(), r


# ---------------------------------------------------------------------------------------
# convert: bad usage is exit 2 and writes nothing


BAD_USAGE = {
    "unknown-flag": ["--world-size", "2", "--bogus"],
    "missing-world-size": [],
    "world-size-0": ["--world-size", "0"],
    "world-size-negative": ["--world-size", "-1"],
    "world-size-text": ["--world-size", "two"],
    "world-size-too-big": ["--world-size", "99999999999"],
    "ranks-reversed": ["--world-size", "8", "--ranks", "5-2"],
    "ranks-past-end": ["--world-size", "8", "--ranks", "0-9"],
    "rank-past-end": ["--world-size", "8", "--ranks", "8"],
    "ranks-text": ["--world-size", "8", "--ranks", "a-b"],
    "ranks-open": ["--world-size", "8", "--ranks", "3-"],
    "ranks-negative": ["--world-size", "8", "--ranks", "-1"],
    "ranks-2^32": ["--world-size", "8", "--ranks", "4294967296"],
    "ranks-wraps-to-0-1": ["--world-size", "8", "--ranks", "0-4294967297"],
    "compress-lz4": ["--world-size", "2", "--compress", "lz4"],
    "compress-level-0": ["--world-size", "2", "--compress", "zstd:0"],
    "compress-level-20": ["--world-size", "2", "--compress", "zstd:20"],
    "compress-level-empty": ["--world-size", "2", "--compress", "zstd:"],
    "compress-level-text": ["--world-size", "2", "--compress", "zstd:fast"],
    "compress-level-trailing": ["--world-size", "2", "--compress", "zstd:3x"],
    "compress-suffix": ["--world-size", "2", "--compress", "zstdx"],
    "layout-unknown": ["--world-size", "2", "--layout", "fsdp3"],
    "chunk-size-unaligned": ["--world-size", "2", "--chunk-size", "1000"],
    "chunk-size-0": ["--world-size", "2", "--chunk-size", "0"],
    "threads-negative": ["--world-size", "2", "--threads", "-1"],
    "mesh-size-0": ["--mesh", "dp_shard=0,tp=2", "--plan", "plan.json"],
    "mesh-not-name-size": ["--mesh", "dp_shard:2", "--plan", "plan.json"],
    "mesh-dim-twice": ["--mesh", "tp=2,tp=2", "--plan", "plan.json"],
    "mesh-without-plan": ["--mesh", "dp_shard=2,tp=2"],
    "plan-without-mesh": ["--world-size", "2", "--plan", "plan.json"],
    "mesh-and-layout": ["--mesh", "dp_shard=2", "--layout", "fsdp1", "--plan", "plan.json"],
    "mesh-and-world-size": ["--mesh", "dp_shard=2,tp=2", "--world-size", "3", "--plan", "plan.json"],
}


@pytest.mark.parametrize("case", sorted(BAD_USAGE))
def test_convert_bad_usage(cli, ckpt, tmp_path, case):
    out = tmp_path / "out"
    r = cli("convert", ckpt, "-o", out, *BAD_USAGE[case], rc=2)
    assert r.err.strip(), f"no message on stderr\n{r}"
    assert not out.exists(), f"bad usage created the output directory\n{r}"


def test_convert_bad_usage_messages_name_the_flag(cli, ckpt, tmp_path):
    out = tmp_path / "out"
    for flag, args in [("--world-size", []), ("--world-size", ["--world-size", "0"]),
                       ("--ranks", ["--world-size", "8", "--ranks", "5-2"]),
                       ("--compress", ["--world-size", "2", "--compress", "lz4"])]:
        r = cli("convert", ckpt, "-o", out, *args, rc=2)
        assert flag in r.err, r


def test_convert_missing_positional_and_out(cli, ckpt, tmp_path):
    cli("convert", "-o", tmp_path / "out", "--world-size", "2", rc=2)
    cli("convert", ckpt, "--world-size", "2", rc=2)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------
# convert: failures are exit 3 with a message naming the path


def test_convert_missing_source(cli, tmp_path):
    src = tmp_path / "no-such-checkpoint"
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", "2", rc=3)
    assert str(src) in r.err and "no such file" in r.err, r
    assert not out.exists()


@pytest.mark.parametrize("contents", ["empty", "config-only", "bin-only"])
def test_convert_directory_without_checkpoint(cli, tmp_path, contents):
    src = tmp_path / "src"
    src.mkdir()
    if contents != "empty":
        (src / "config.json").write_text("{}")
    if contents == "bin-only":
        (src / "pytorch_model.bin").write_bytes(b"\0" * 16)
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", "2", rc=3)
    assert str(src) in r.err, r
    if contents == "bin-only":
        assert "safetensors" in r.err, r
    else:
        assert "not a Hugging Face checkpoint" in r.err, r
    assert not (tmp_path / "out").exists()


def test_convert_two_files_without_index(cli, checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("gpt2", "bf16", True), src)
    (src / "model.safetensors.index.json").unlink()
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", "2", rc=3)
    assert str(src) in r.err and "index" in r.err, r


def test_convert_index_names_missing_file(cli, checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("gpt2", "bf16", True), src)
    victim = weight_files(str(src))[1]
    (src / victim).unlink()
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", "2", rc=3)
    assert victim in r.err, r


def test_convert_corrupt_safetensors(cli, checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("bert", "fp32", False), src)
    st = src / "model.safetensors"
    os.truncate(st, st.stat().st_size - 10)
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", "2", rc=3)
    assert str(st) in r.err, r


def test_convert_file_that_is_not_safetensors(cli, tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(b"\0" * 64)
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", "2", rc=3)
    assert str(src) in r.err, r


def test_convert_output_under_a_regular_file(cli, ckpt, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    r = cli("convert", ckpt, "-o", out, "--world-size", "2", rc=3)
    assert str(out) in r.err and "cannot create" in r.err, r
    assert blocker.read_text() == "not a directory"


def test_convert_output_is_a_regular_file(cli, ckpt, tmp_path):
    out = tmp_path / "a-file"
    out.write_text("keep me")
    r = cli("convert", ckpt, "-o", out, "--world-size", "2", rc=3)
    assert str(out) in r.err, r
    assert out.read_text() == "keep me"


def test_convert_corrupt_manifest(cli, ckpt, out_ws3):
    (out_ws3 / "reshard.json").write_text('{"format": "reshard.manifest"')
    r = cli("convert", ckpt, "-o", out_ws3, "--world-size", "2", rc=3)
    assert "reshard.json" in r.err, r


# ---------------------------------------------------------------------------------------
# verify


def test_verify_ok(cli, ckpt, out_ws3):
    r = cli("verify", out_ws3, rc=0)
    assert r.out.startswith("OK: 3 files"), r
    r = cli("verify", out_ws3, "--source", ckpt, rc=0)
    assert "compared with the source" in r.out, r
    cli("verify", out_ws3 / "fsdp2-ws3", rc=0)
    cli("verify", out_ws3 / "fsdp2-ws3" / rf.rank_file_name(1, 3), "--source", ckpt, rc=0)


def test_verify_nonexistent_path(cli, tmp_path):
    p = tmp_path / "nothing-here"
    r = cli("verify", p, rc=3)
    assert str(p) in r.err and "no such file" in r.err, r


def test_verify_nonexistent_source(cli, out_ws3, tmp_path):
    src = tmp_path / "no-source"
    r = cli("verify", out_ws3, "--source", src)
    assert r.rc in (1, 3), r
    assert str(src) in r.text, r


def test_verify_directory_without_output(cli, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    r = cli("verify", d, rc=3)  # nothing to verify: the files refuse it, as a missing path does
    assert str(d) in r.err and "not a reshard output directory" in r.err, r
    # What a killed convert or save leaves (a layout directory, temporaries, no manifest) is an
    # output with a problem (exit 1), not "no output" (exit 3).
    (d / "fsdp2-ws2").mkdir()
    r = cli("verify", d, rc=1)
    assert "layout directory fsdp2-ws2" in r.out and "did not finish" in r.out, r
    (d / "fsdp2-ws2").rmdir()
    (d / ".rank-00000-of-00002.reshard.tmp-host-1").write_bytes(b"x")
    r = cli("verify", d, rc=1)
    assert "1 temporary file(s)" in r.out and "did not finish" in r.out, r


@pytest.mark.parametrize("contents", [b"hello", b"\0" * 8192, b"\x89RSHD\r\n\x1a" + b"\0" * 100])
def test_verify_file_that_is_not_a_rank_file(cli, tmp_path, contents):
    p = tmp_path / "rank-00000-of-00001.reshard"
    p.write_bytes(contents)
    r = cli("verify", p, rc=1)
    problem_lines = [l for l in r.out.splitlines() if not l.startswith("FAILED")]
    assert problem_lines and all(l.startswith(f"{p}:") for l in problem_lines), r
    # Each problem names the file once, not "path: path: ...".
    for line in problem_lines:
        assert line.count(str(p)) == 1, f"the path is repeated in: {line}"


def test_verify_problem_lines_name_file_and_tensor_once(cli, out_ws3):
    path = out_ws3 / "fsdp2-ws3" / rf.rank_file_name(0, 3)
    f = rf.RankFile.open(path)
    t = max(f.tensors, key=lambda t: t.nbytes)
    with open(path, "r+b") as fh:
        fh.seek(f.preamble.data_offset + t.offset)
        b = fh.read(1)
        fh.seek(f.preamble.data_offset + t.offset)
        fh.write(bytes([b[0] ^ 1]))
    r = cli("verify", out_ws3, rc=1)
    lines = [l for l in r.out.splitlines() if f'"{t.name}"' in l]
    assert len(lines) == 1, r
    assert lines[0].startswith(f'{path}: tensor "{t.name}": '), r
    assert lines[0].count(str(path)) == 1, f"the path is repeated in: {lines[0]}"


# ---------------------------------------------------------------------------------------
# inspect


def test_inspect_nonexistent(cli, tmp_path):
    p = tmp_path / "nothing"
    r = cli("inspect", p, rc=3)
    assert str(p) in r.err, r


def test_inspect_source_dir(cli, ckpt):
    src = load_source(ckpt)
    r = cli("inspect", ckpt, rc=0)
    assert f"{len(src)} tensors" in r.out and f"{len(weight_files(ckpt))} safetensors file(s)" in r.out, r
    for name in src:
        assert name in r.out, name
    j = json.loads(cli("inspect", ckpt, "--json", rc=0).out)
    assert j["kind"] == "source"
    assert j["index_file"] == "model.safetensors.index.json"
    assert j["tensor_count"] == len(src)
    assert j["nbytes"] == source_nbytes(ckpt)
    assert j["nbytes_by_dtype"] == {"BF16": source_nbytes(ckpt)}
    files = [rf.safetensors_file_fingerprint(os.path.join(ckpt, n)) for n in weight_files(ckpt)]
    assert j["fingerprint"] == rf.source_fingerprint(files)
    assert [(f["name"], f["size"]) for f in j["files"]] == [(f["name"], f["size"]) for f in files]
    assert sorted(j["aux_files"]) == ["config.json", "generation_config.json"]
    by_name = {t["name"]: t for t in j["tensors"]}
    assert set(by_name) == set(src)
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    for name, t in src.items():
        e = by_name[name]
        assert e["shape"] == list(t.shape) and e["dtype"] == "BF16"
        assert e["nbytes"] == t.numel() * t.element_size()
        assert e["file"] == index[name]


def test_inspect_single_safetensors_file(cli, checkpoint):
    ckpt = checkpoint("mixed", "fp32", False)
    j = json.loads(cli("inspect", os.path.join(ckpt, "model.safetensors"), "--json", rc=0).out)
    src = load_source(ckpt)
    assert j["kind"] == "source" and j["tensor_count"] == len(src)
    shapes = {t["name"]: t["shape"] for t in j["tensors"]}
    assert shapes == {k: list(v.shape) for k, v in src.items()}


def test_inspect_output_dir(cli, ckpt, out_ws3):
    cli("convert", ckpt, "-o", out_ws3, "--world-size", 5, "--ranks", "0-1", rc=0)
    total = source_nbytes(ckpt)
    r = cli("inspect", out_ws3, rc=0)
    assert "layout fsdp2-ws3: world size 3, 3 rank files (complete)" in r.out, r
    assert "layout fsdp2-ws5: world size 5, 2 rank files (INCOMPLETE)" in r.out, r
    j = json.loads(cli("inspect", out_ws3, "--json", rc=0).out)
    m = rf.read_manifest(out_ws3)
    assert j["kind"] == "output"
    assert j["source_fingerprint"] == m["source"]["fingerprint"]
    assert j["source_files"] == len(weight_files(ckpt))
    assert sorted(j["aux_files"]) == ["config.json", "generation_config.json"]
    assert sorted(j["layouts"]) == ["fsdp2-ws3", "fsdp2-ws5"]
    l3, l5 = j["layouts"]["fsdp2-ws3"], j["layouts"]["fsdp2-ws5"]
    assert l3["complete"] is True and l3["manifest_complete"] is True
    assert l3["world_size"] == 3 and [x["rank"] for x in l3["ranks"]] == [0, 1, 2]
    # The ranks of a complete layout hold the source's bytes exactly once.
    assert l3["nbytes"] == total
    for x in l3["ranks"]:
        f = rf.RankFile.open(out_ws3 / "fsdp2-ws3" / x["file"])
        assert x["nbytes"] == sum(t.nbytes for t in f.tensors)
        assert x["file_size"] == f.file_size and x["tensor_count"] == len(f.tensors)
    assert l5["complete"] is False and l5["manifest_complete"] is False
    assert [x["rank"] for x in l5["ranks"]] == [0, 1]


def test_inspect_layout_dir(cli, out_ws3):
    j = json.loads(cli("inspect", out_ws3 / "fsdp2-ws3", "--json", rc=0).out)
    assert j["kind"] == "layout" and j["key"] == "fsdp2-ws3" and j["world_size"] == 3
    assert j["complete"] is True and len(j["ranks"]) == 3
    r = cli("inspect", out_ws3 / "fsdp2-ws3", rc=0)
    assert "3 rank files (complete)" in r.out, r


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_inspect_rank_file(cli, ckpt, tmp_path, compress):
    out = tmp_path / "out"
    extra = ["--compress", compress] if compress else []
    cli("convert", ckpt, "-o", out, "--world-size", 3, *extra, rc=0)
    path = out / "fsdp2-ws3" / rf.rank_file_name(2, 3)
    f = rf.RankFile.open(path)
    r = cli("inspect", path, rc=0)
    assert r.out.startswith(f"{path}: rank 2 of 3, layout fsdp2-ws3"), r
    for t in f.tensors:
        assert t.name in r.out
    j = json.loads(cli("inspect", path, "--json", rc=0).out)
    assert j["kind"] == "rank_file" and j["rank"] == 2 and j["world_size"] == 3
    assert j["layout"] == "fsdp2-ws3" and j["layout_kind"] == "fsdp2"
    assert j["source_fingerprint"] == f.source["fingerprint"]
    assert j["chunk_size"] == f.chunk_size and j["file_size"] == path.stat().st_size
    assert j["tensor_count"] == len(f.tensors)
    assert j["nbytes"] == sum(t.nbytes for t in f.tensors)
    assert j["stored_size"] == sum(t.stored_size for t in f.tensors)
    assert j["writer"] == f"reshard {project_version()}"
    got = {t["name"]: t for t in j["tensors"]}
    assert set(got) == set(f.names())
    for t in f.tensors:
        e = got[t.name]
        assert e["dtype"] == t.dtype and e["global_shape"] == t.global_shape
        assert e["local_shape"] == t.local_shape and e["nbytes"] == t.nbytes
        assert e["rows"] == ([t.shard.start, t.shard.end] if t.shard else None)
        assert e["offset"] == t.offset and e["stored_size"] == t.stored_size
        assert e["codec"] == t.codec and e["xxh3"] == rf.hex16(t.xxh3)


def test_inspect_corrupt_rank_file(cli, out_ws3):
    path = out_ws3 / "fsdp2-ws3" / rf.rank_file_name(0, 3)
    with open(path, "r+b") as fh:
        fh.write(b"X")
    r = cli("inspect", path, rc=3)
    assert str(path) in r.err and "magic" in r.err, r
    # The output around it is still described, the damaged file named (inspect of OUT failed whole).
    r = cli("inspect", out_ws3, rc=0)
    assert f"DAMAGED {path.name}: {path}: " in r.out and "magic" in r.out and "(INCOMPLETE)" in r.out, r.out
    assert f"rank 1  {rf.rank_file_name(1, 3)}" in r.out and f"(reshard verify {out_ws3} names what to run)" in r.out
    j = json.loads(cli("inspect", out_ws3, "--json", rc=0).out)
    assert [b["file"] for b in j["layouts"]["fsdp2-ws3"]["damaged"]] == [path.name], j


# ---------------------------------------------------------------------------------------
# the pure-Python reader's own error paths (it is used by the loader tests too)


def test_reader_rejects_damaged_files(out_ws3, tmp_path):
    good = out_ws3 / "fsdp2-ws3" / rf.rank_file_name(1, 3)
    f = rf.RankFile.open(good)
    t = next(t for t in f.tensors if t.nbytes > 0)
    assert torch.equal(rf.read_tensor(good, t.name).view(torch.uint8).reshape(-1),
                       torch.frombuffer(bytearray(f.read_bytes(t)), dtype=torch.uint8))
    raw = good.read_bytes()
    cases = {
        "magic": (0, b"\x88"),
        "version": (8, b"\x02"),
        "flags": (12, b"\x01"),
        "padding": (100, b"\x01"),
        "header": (f.preamble.header_offset + 5, b"\x00"),
    }
    for what, (offset, patch) in cases.items():
        p = tmp_path / f"{what}.reshard"
        p.write_bytes(raw[:offset] + patch + raw[offset + len(patch):])
        with pytest.raises(rf.FormatError):
            rf.RankFile.open(p)
    p = tmp_path / "short.reshard"
    p.write_bytes(raw[:-1])
    with pytest.raises(rf.FormatError, match="truncated"):
        rf.RankFile.open(p)
    with pytest.raises(KeyError):
        f.read_tensor("no.such.tensor")


def test_inspect_names_a_missing_layout_directory(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", False)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    (out / "fsdp2-ws2").rename(tmp_path / "moved")
    cli("convert", src, "-o", out, "--world-size", 1, rc=0)
    # Described, not fatal: the other layouts are shown, the missing one marked with what to run.
    r = cli("inspect", out, rc=0)
    assert f"layout fsdp2-ws2: world size 2, MISSING: {out / 'fsdp2-ws2'} is not there (reshard remove {out} fsdp2-ws2" \
        in r.out and "layout fsdp2-ws1: world size 1, 1 rank file (complete)" in r.out, r
    assert json.loads(cli("inspect", out, "--json", rc=0).out)["layouts"]["fsdp2-ws2"]["missing"] is True
    # verify says it once, with both ways out; the second works as printed.
    v = cli("verify", out, "--source", src, rc=1)
    again = f"reshard convert {src} -o {out} --world-size 2"
    assert (f"{out / 'fsdp2-ws2'}: the directory of layout fsdp2-ws2 (listed in the manifest) is missing; take it "
            f"out of the manifest with: reshard remove {out} fsdp2-ws2, or write it again: {again}\n"
            "FAILED: 1 problem(s)") in v.out, v.out
    cli(*again.split()[1:], "--no-capture", rc=0)
    cli("verify", out, "--source", src, rc=0)


def test_verify_of_an_output_whose_manifest_is_gone_names_its_rank_files(cli, ckpt, out_ws3):
    """reshard.json deleted: the rank files are still there in fsdp2-ws3/; verify says so (it
    said 'no rank-*.reshard files') and what to run, and running it makes the output verify."""
    (out_ws3 / "reshard.json").unlink()
    r = cli("verify", out_ws3, rc=1)
    assert "layout directory fsdp2-ws3 holding 3 rank file(s)" in r.out and "Run that convert again" in r.out, r
    cli("convert", ckpt, "-o", out_ws3, "--world-size", 3, rc=0)
    cli("verify", out_ws3, rc=0)


def test_an_unknown_command_is_named_with_the_commands(cli):
    r = cli("verfy", "x", rc=2)
    assert "unknown command 'verfy'" in r.err and "convert, relayout, verify, inspect, remove, export" in r.err, r
