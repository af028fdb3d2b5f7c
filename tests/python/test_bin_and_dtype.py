"""pytorch_model.bin sources and the --dtype policy, end to end through the CLI.

* Checkpoints written by torch.save (transformers 5 no longer writes .bin files, so the state
  dict is saved by hand with a hand-made index, checkpoints.make_bin_checkpoint) convert to
  rank files whose tensors equal ``torch.load(...)[k].to(dtype)`` chunked per rank, bit for bit
  (read back with the independent reader tests/python/reference_reader.py).
* fp32 -> bf16 / fp16 rounding is compared with torch on every pattern of the top 16 bits x
  17 low-bit patterns, plus 10^7 random patterns; every 16-bit pattern for the 16-bit
  sources; specials and random patterns for float64.
* Malformed archives and pickles are refused with exit code 3 and no side effect (the
  os.system pickle must not create its marker file).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import reference_reader as rf
from checkpoints import load_bin_source, make_bin_checkpoint

# torch.load warns about pickle protocol 4 fixtures (they are ours, loaded on purpose).
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

POLICY_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONVERTIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
ST_DTYPE = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# Pairs where torch's own CPU kernels give different NaN bit patterns depending on the
# element's position (vectorized body vs. scalar remainder); there only NaN-ness is compared.
NAN_PATTERN_VARIES = {(torch.float16, torch.float32), (torch.float64, torch.bfloat16)}

# (arch, checkpoint dtype, sharded, pickle protocol)
BIN_CASES = [
    ("qwen2", "bf16", False, 2),   # tied embeddings: two keys on one storage
    ("qwen2", "fp32", True, 2),
    ("llama", "fp16", True, 2),
    ("gpt2", "fp32", False, 4),    # protocol 4: FRAME, SHORT_BINUNICODE, STACK_GLOBAL, MEMOIZE
    ("mixed", "fp32", True, 2),    # views, shared storages, fp8, ints, NaN/inf bit patterns
    ("mixed", "bf16", False, 4),
    ("mixed", "fp16", True, 2),
]


def bin_case_id(c):
    arch, dtype, sharded, proto = c
    return f"{arch}-{dtype}-{'sharded' if sharded else 'single'}-p{proto}"


@pytest.fixture(scope="session")
def bin_checkpoint(tmp_path_factory):
    cache: Dict[tuple, str] = {}
    root = tmp_path_factory.mktemp("bin-checkpoints")

    def get(arch, dtype, sharded, proto=2, seed=0):
        key = (arch, dtype, sharded, proto, seed)
        if key not in cache:
            path = root / f"{arch}-{dtype}-{'sharded' if sharded else 'single'}-p{proto}-s{seed}"
            cache[key] = make_bin_checkpoint(str(path), arch, dtype, sharded, seed, proto)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def int_view(t: torch.Tensor) -> torch.Tensor:
    w = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().reshape(-1).view(w)


def converted(src: torch.Tensor, policy: str) -> torch.Tensor:
    if policy == "keep" or src.dtype not in CONVERTIBLE:
        return src
    return src.to(POLICY_DTYPES[policy])


def assert_same(got: torch.Tensor, want: torch.Tensor, src_dtype, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (what, got.shape, want.shape)
    if torch.equal(bits(got), bits(want)):
        return
    if (src_dtype, want.dtype) in NAN_PATTERN_VARIES:
        g, w = got.reshape(-1).float(), want.reshape(-1).float()
        both_nan = torch.isnan(g) & torch.isnan(w)
        same = (int_view(got) == int_view(want)) | both_nan
        if bool(same.all()):
            return
    gi, wi = int_view(got), int_view(want)
    bad = (gi != wi).nonzero().reshape(-1)[:5].tolist()
    raise AssertionError(f"{what}: {len(bad)}+ elements differ, first at {bad}: "
                         f"got {[hex(int(gi[i]) & ((1 << 8 * got.element_size()) - 1)) for i in bad]} "
                         f"want {[hex(int(wi[i]) & ((1 << 8 * got.element_size()) - 1)) for i in bad]}")


def expected_shard(src: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    if src.dim() == 0:
        return src
    s, e = rf.chunk_rows(src.shape[0], ws, rank)
    return src[s:e]


def layout_key(ws: int, policy: str) -> str:
    return f"fsdp2-ws{ws}" + ("" if policy == "keep" else f"-{policy}")


def check_layout(out, ckpt, ws: int, policy: str, src: Dict[str, torch.Tensor]) -> None:
    key = layout_key(ws, policy)
    d = Path(out) / key
    assert sorted(os.listdir(d)) == sorted(rf.rank_file_name(r, ws) for r in range(ws))
    files = []
    if os.path.isfile(ckpt):
        files = [rf.weight_file_fingerprint(ckpt)]
    else:
        files = [rf.weight_file_fingerprint(os.path.join(ckpt, n))
                 for n in sorted(os.listdir(ckpt)) if n.endswith(".bin")]
    source = {"files": sorted(files, key=lambda f: f["name"]),
              "fingerprint": rf.source_fingerprint(files)}
    pieces: Dict[str, List[torch.Tensor]] = {k: [] for k in src}
    for r in range(ws):
        f = rf.RankFile.open(d / rf.rank_file_name(r, ws))
        h = f.header
        assert h["layout"] == {"key": key, "kind": "fsdp2", "world_size": ws, "dtype": policy}
        assert h["source"] == source
        assert sorted(f.names()) == sorted(src)
        for t in f.tensors:
            s = src[t.name]
            want = expected_shard(converted(s, policy), ws, r)
            assert t.dtype == ST_DTYPE[want.dtype], (t.name, t.dtype)
            assert t.global_shape == list(s.shape), t.name
            got = f.read_tensor(t.name)
            assert_same(got, want, s.dtype, f"{d.name}/rank {r}/{t.name}")
            pieces[t.name].append(got)
    for k, s in src.items():
        want = converted(s, policy)
        whole = pieces[k][0] if s.dim() == 0 else torch.cat(pieces[k], dim=0)
        assert_same(whole, want, s.dtype, f"{key}/{k} reassembled")
    m = rf.read_manifest(out)
    assert m["layouts"][key]["dtype"] == policy
    assert m["layouts"][key]["complete"] is True


def convert(cli, src, out, ws, *extra, rc=0):
    return cli("convert", src, "-o", out, "--world-size", ws, *extra, rc=rc)


# ---------------------------------------------------------------------------------------
# the fixtures are what they claim to be


def test_fixture_bin_checkpoints_are_torch_zip_with_tied_storage(bin_checkpoint):
    ckpt = bin_checkpoint("qwen2", "bf16", False)
    path = os.path.join(ckpt, "pytorch_model.bin")
    assert zipfile.is_zipfile(path)
    with zipfile.ZipFile(path) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        prefix = z.infolist()[0].filename.split("/")[0]
        assert prefix == "pytorch_model"  # not "archive": the prefix comes from the file name
    sd = torch.load(path, weights_only=True)
    assert "lm_head.weight" in sd and "model.embed_tokens.weight" in sd
    assert sd["lm_head.weight"].untyped_storage().data_ptr() == \
        sd["model.embed_tokens.weight"].untyped_storage().data_ptr()
    _, tensors = rf.torch_zip_tensors(path)
    offs = {t.name: t.offset for t in tensors}
    assert offs["lm_head.weight"] == offs["model.embed_tokens.weight"]
    mixed = load_bin_source(bin_checkpoint("mixed", "fp32", True))
    assert mixed["views.a"].dtype == torch.float32 and mixed["fp8"].dtype == torch.float8_e4m3fn
    # The mixed fixture exercises every rebuild function torch 2.11 writes for tensors.
    globals_seen = set()
    for name in os.listdir(bin_checkpoint("mixed", "fp32", False)):
        if name.endswith(".bin"):
            pkl, _ = rf.torch_zip_tensors(os.path.join(bin_checkpoint("mixed", "fp32", False), name))
            import pickletools
            for op, arg, _ in pickletools.genops(pkl):
                if op.name == "GLOBAL":
                    globals_seen.add(arg)
    assert {"torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor_v3",
            "torch._utils _rebuild_parameter", "torch._utils _rebuild_parameter_with_state",
            "torch._tensor _rebuild_from_type_v2", "torch Tensor",
            "torch.storage UntypedStorage", "torch float8_e4m3fn"} <= globals_seen, globals_seen


# ---------------------------------------------------------------------------------------
# conversion is exact


@pytest.mark.parametrize("policy", ["keep", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("c", BIN_CASES, ids=bin_case_id)
def test_bin_convert_matches_torch(cli, bin_checkpoint, tmp_path, c, policy):
    arch, dtype, sharded, proto = c
    ckpt = bin_checkpoint(arch, dtype, sharded, proto)
    src = load_bin_source(ckpt)
    out = tmp_path / "out"
    for ws in (1, 3):
        r = convert(cli, ckpt, out, ws, "--dtype", policy, "--chunk-size", 4096)
        assert f"of {layout_key(ws, policy)} into" in r.out, r
        check_layout(out, ckpt, ws, policy, src)
    v = cli("verify", out, "--source", ckpt, rc=0)
    assert "OK: 4 files" in v.out, v


def test_bin_single_file_source_and_inspect(cli, bin_checkpoint, tmp_path):
    ckpt = bin_checkpoint("mixed", "bf16", False, 4)
    path = os.path.join(ckpt, "pytorch_model.bin")
    out = tmp_path / "out"
    convert(cli, path, out, 5, "--dtype", "fp32")
    check_layout(out, path, 5, "fp32", load_bin_source(path))
    cli("verify", out, "--source", path, rc=0)
    cli("verify", out, "--source", ckpt, rc=0)
    j = json.loads(cli("inspect", ckpt, "--json", rc=0).out)
    assert j["kind"] == "source" and j["format"] == "torch-zip"
    sd = load_bin_source(ckpt)
    assert j["tensor_count"] == len(sd)
    for e in j["tensors"]:
        assert e["shape"] == list(sd[e["name"]].shape)
        assert e["dtype"] == ST_DTYPE[sd[e["name"]].dtype]
    txt = cli("inspect", path, rc=0).out
    assert "torch zip" in txt and f"{len(sd)} tensors" in txt


def test_layouts_of_several_policies_side_by_side(cli, bin_checkpoint, tmp_path):
    ckpt = bin_checkpoint("qwen2", "fp32", True)
    out = tmp_path / "out"
    for policy in ("keep", "bf16", "fp16"):
        convert(cli, ckpt, out, 2, "--dtype", policy)
    m = rf.read_manifest(out)
    assert sorted(m["layouts"]) == ["fsdp2-ws2", "fsdp2-ws2-bf16", "fsdp2-ws2-fp16"]
    assert {k: v["dtype"] for k, v in m["layouts"].items()} == {
        "fsdp2-ws2": "keep", "fsdp2-ws2-bf16": "bf16", "fsdp2-ws2-fp16": "fp16"}
    r = convert(cli, ckpt, out, 2, "--dtype", "bf16", "--json")
    j = json.loads(r.out)
    assert j["ranks_written"] == [] and j["ranks_up_to_date"] == [0, 1]
    assert j["layout"] == "fsdp2-ws2-bf16" and j["dtype"] == "bf16"
    cli("verify", out, "--source", ckpt, rc=0)


def test_dtype_policy_on_safetensors_sources(cli, checkpoint, tmp_path):
    """The policy works the same on safetensors (the mixed fixture has NaN payloads, fp8,
    ints and bool, which must pass through or convert exactly)."""
    from checkpoints import load_source

    ckpt = checkpoint("mixed", "bf16", True)
    src = load_source(ckpt)
    out = tmp_path / "out"
    for policy in ("fp32", "fp16", "bf16"):
        convert(cli, ckpt, out, 3, "--dtype", policy, "--chunk-size", 4096)
        d = out / layout_key(3, policy)
        for r in range(3):
            f = rf.RankFile.open(d / rf.rank_file_name(r, 3))
            assert f.header["layout"]["dtype"] == policy
            for t in f.tensors:
                s = src[t.name]
                assert_same(f.read_tensor(t.name), expected_shard(converted(s, policy), 3, r),
                            s.dtype, f"{policy}/{t.name}")
    cli("verify", out, "--source", ckpt, rc=0)


def test_cli_dtype_option(cli, checkpoint, tmp_path):
    r = cli("convert", "--help", rc=0)
    for word in ("--dtype", "bf16", "fp16", "fp32", "keep", "pytorch_model.bin"):
        assert word in r.out, r
    ckpt = checkpoint("gpt2", "bf16", False)
    r = cli("convert", ckpt, "-o", tmp_path / "out", "--world-size", 2, "--dtype", "fp8", rc=2)
    assert "--dtype" in r.err, r
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------
# rounding against torch, exhaustively where it is cheap


LOW_PATTERNS = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x5555,
                0x7FFF, 0x8000, 0x8001, 0xAAAA, 0xC000, 0xE000, 0xF000, 0xFFFF]


def fp32_patterns() -> torch.Tensor:
    """All 2^16 top halves x LOW_PATTERNS, then 10^7 random patterns (as int32 bits)."""
    top = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    low = torch.tensor(LOW_PATTERNS, dtype=torch.int64)
    grid = (top[:, None] | low[None, :]).reshape(-1)
    gen = torch.Generator().manual_seed(1234)
    rnd = torch.randint(0, 1 << 32, (10_000_000,), dtype=torch.int64, generator=gen)
    allbits = torch.cat([grid, rnd])
    return (allbits - ((allbits >> 31) << 32)).to(torch.int32)  # wrap to signed


def write_safetensors(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_fp32_rounding_matches_torch(cli, tmp_path, policy):
    x = fp32_patterns().view(torch.float32)
    want = x.to(POLICY_DTYPES[policy])
    # Odd row count so that ranks split mid-way; 3 ranks of one big tensor.
    n = x.numel() - x.numel() % 7
    src = tmp_path / "src"
    write_safetensors(src, {"x": x[:n].reshape(-1, 7).clone()})
    out = tmp_path / "out"
    convert(cli, src, out, 3, "--dtype", policy)
    pieces = []
    for r in range(3):
        f = rf.RankFile.open(out / layout_key(3, policy) / rf.rank_file_name(r, 3), verify=False)
        pieces.append(f.read_tensor("x", verify=False))
    got = torch.cat(pieces).reshape(-1)
    assert_same(got, want[:n], torch.float32, f"fp32 -> {policy}")
    # NaNs: fp32 -> bf16 gives the one pattern 0xFFFF (torch's vector kernels); fp32 -> fp16
    # keeps sign and top payload bits, so many patterns.
    nan_out = int_view(got[torch.isnan(x[:n])]).unique().tolist()
    if policy == "bf16":
        assert nan_out == [-1], [hex(v & 0xFFFF) for v in nan_out]
    else:
        assert len(nan_out) > 100
    cli("verify", out, "--source", src, rc=0)


def test_16_bit_sources_every_pattern_and_float64(cli, tmp_path):
    all16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gen = torch.Generator().manual_seed(7)
    f64 = torch.randint(-(2**63), 2**63 - 1, (400_000,), dtype=torch.int64, generator=gen)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-310,
                             -1e-320, 3.4028235e38, 3.4028236e38, 1e39, 65504.0, 65520.0,
                             65519.999, 1.0 + 2**-8 + 2**-30, 1.0 + 2**-11 + 2**-40,
                             2**-149, 2**-150, 2**-24, 2**-25, 1.5 * 2**-25],
                            dtype=torch.float64)
    tensors = {
        "bf16": all16.view(torch.bfloat16).clone(),
        "f16": all16.view(torch.float16).clone(),
        "f64": torch.cat([f64.view(torch.float64), specials]),
    }
    src = tmp_path / "src"
    write_safetensors(src, tensors)
    out = tmp_path / "out"
    for policy in ("bf16", "fp16", "fp32"):
        convert(cli, src, out, 1, "--dtype", policy, "--chunk-size", 4096)
        f = rf.RankFile.open(out / layout_key(1, policy) / rf.rank_file_name(0, 1))
        for name, t in tensors.items():
            assert_same(f.read_tensor(name), converted(t, policy), t.dtype, f"{policy}/{name}")
    cli("verify", out, "--source", src, rc=0)


# ---------------------------------------------------------------------------------------
# malformed archives and pickles: refused, nothing executed, nothing written


class _Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def write_zip(path: Path, records: Dict[str, bytes], compression=zipfile.ZIP_STORED) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        for name, data in records.items():
            z.writestr(name, data)


def test_os_system_pickle_is_refused_without_running(cli, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Evil(f"touch {marker}")}, protocol=2)
    assert b"system" in payload
    src = tmp_path / "src"
    write_zip(src / "pytorch_model.bin", {"archive/data.pkl": payload,
                                          "archive/version": b"3\n"})
    for args in (("convert", src, "-o", tmp_path / "out", "--world-size", 2),
                 ("inspect", src), ("inspect", src / "pytorch_model.bin")):
        r = cli(*args, rc=3)
        assert "system" in r.err and "whitelist" in r.err, r
        assert str(src / "pytorch_model.bin") in r.err, r
    # Protocol 4 (STACK_GLOBAL) and a bare os.system global in an otherwise real state dict.
    payload4 = pickle.dumps({"w": _Evil(f"touch {marker}")}, protocol=4)
    write_zip(src / "pytorch_model.bin", {"archive/data.pkl": payload4})
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", 2, rc=3)
    assert "system" in r.err, r
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def _tiny_state():
    return {"w": torch.randn(6, 4), "b": torch.randn(6)}


def _bad_sources(tmp_path: Path):
    """(name, source directory, expected words in the error) for each malformation."""
    cases = []

    def new(name):
        d = tmp_path / name
        d.mkdir(parents=True)
        return d

    d = new("legacy")
    torch.save(_tiny_state(), d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    cases.append(("legacy", d, ["legacy torch.save pickle"]))

    d = new("noncontiguous")
    torch.save({"w": torch.randn(4, 3).t()}, d / "pytorch_model.bin")
    cases.append(("noncontiguous", d, ["not contiguous", "stride (1, 3)"]))

    good = new("good")
    torch.save(_tiny_state(), good / "pytorch_model.bin")
    raw = (good / "pytorch_model.bin").read_bytes()

    d = new("truncated")
    (d / "pytorch_model.bin").write_bytes(raw[: len(raw) // 2])
    cases.append(("truncated", d, ["end of central directory"]))

    d = new("deflated")
    with zipfile.ZipFile(good / "pytorch_model.bin") as z:
        recs = {i.filename: z.read(i) for i in z.infolist()}
    write_zip(d / "pytorch_model.bin", recs, zipfile.ZIP_DEFLATED)
    cases.append(("deflated", d, ["compression method 8"]))

    d = new("crc")
    with zipfile.ZipFile(good / "pytorch_model.bin") as z:
        info = z.getinfo(z.namelist()[0])
    assert info.filename.endswith("data.pkl")
    b = bytearray(raw)
    fh = io.BytesIO(raw)
    fh.seek(info.header_offset + 26)
    n, m = struct.unpack("<HH", fh.read(4))
    b[info.header_offset + 30 + n + m + 5] ^= 0x01
    (d / "pytorch_model.bin").write_bytes(bytes(b))
    cases.append(("crc", d, ["data.pkl", "CRC-32"]))

    d = new("missing-storage")
    write_zip(d / "pytorch_model.bin", {k: v for k, v in recs.items() if not k.endswith("data/0")},
              zipfile.ZIP_STORED)
    cases.append(("missing-storage", d, ["storage \"0\"", "no record"]))

    d = new("index-missing-key")
    torch.save(_tiny_state(), d / "pytorch_model-00001-of-00001.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"w": "pytorch_model-00001-of-00001.bin",
                        "nope": "pytorch_model-00001-of-00001.bin"}}))
    cases.append(("index-missing-key", d, ["nope", "has no tensor"]))

    d = new("not-a-dict")
    torch.save([torch.randn(3)], d / "pytorch_model.bin")
    cases.append(("not-a-dict", d, ["holds a list"]))

    d = new("nested")
    torch.save({"model": {"w": torch.randn(3)}}, d / "pytorch_model.bin")
    cases.append(("nested", d, ["entry \"model\" is a dict"]))
    return cases


def test_malformed_bin_sources_are_refused(cli, tmp_path):
    for name, src, words in _bad_sources(tmp_path / "cases"):
        out = tmp_path / f"out-{name}"
        r = cli("convert", src, "-o", out, "--world-size", 2, rc=3)
        for w in words:
            assert w in r.err, (name, r)
        assert str(src) in r.err, (name, r)
        assert not out.exists(), name


def test_random_corruption_never_crashes(cli, tmp_path):
    """Byte flips anywhere in a real archive: the CLI answers 0 (the flip hit tensor data or
    padding) or 3 (refused), never a crash."""
    src = tmp_path / "good"
    src.mkdir()
    torch.save({"a": torch.randn(5, 3), "b": torch.arange(7), "c": torch.randn(2, 2)[0]},
               src / "pytorch_model.bin")
    raw = (src / "pytorch_model.bin").read_bytes()
    gen = torch.Generator().manual_seed(5)
    bad = tmp_path / "bad"
    bad.mkdir()
    codes = {}
    for i in range(150):
        b = bytearray(raw)
        for _ in range(1 + i % 4):
            pos = int(torch.randint(0, len(b), (1,), generator=gen))
            b[pos] = int(torch.randint(0, 256, (1,), generator=gen))
        if i % 10 == 9:
            b = b[: int(torch.randint(0, len(b), (1,), generator=gen))]
        (bad / "pytorch_model.bin").write_bytes(bytes(b))
        r = cli("inspect", bad, "--json")
        assert r.rc in (0, 3), r
        if r.rc == 3:
            assert str(bad / "pytorch_model.bin") in r.err, r
        codes[r.rc] = codes.get(r.rc, 0) + 1
    assert codes.get(3, 0) > 30, codes
