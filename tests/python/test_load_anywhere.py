"""reshard.load from whatever is there (issue 23, part 1): straight from a Hugging Face
checkpoint directory, or from a layout of another world size, with nothing stored.

Two kinds of check:
* The planned views against `reshard convert`'s own rank files, in-process and without
  torch.distributed: for every rank of many world sizes, the view lists the same tensors
  (names, dtypes, shapes, rows) and its bytes equal the converted rank file's, byte for byte
  (the rank files are themselves checked against the source by `verify --source`).
* FSDP2 jobs under gloo (tests/python/fsdp_worker.py): every parameter's full_tensor(), every
  buffer and the logits equal from_pretrained's, the report names the source.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import reshard
from reshard import _C
import test_load
from checkpoints import make_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
RESHARD = os.environ.get("RESHARD_BIN", os.path.join(HERE, "..", "..", "build", "reshard"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def convert(src, out, world_size, *extra, env=None):
    p = subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", str(world_size), *extra],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("anywhere")
    made = {}
    for arch, dtype, sharded in [("llama", "bf16", True), ("qwen2", "fp32", False)]:
        made[(arch, dtype)] = make_checkpoint(str(root / f"{arch}-{dtype}"), arch, dtype, sharded)
    return made


def read_all(reader):
    """Every tensor of a rank file or view, loaded into host memory: {name: uint8 tensor}."""
    bufs = {t.name: torch.empty(t.nbytes, dtype=torch.uint8) for t in reader.tensors}
    targets = [_C.LoadTarget(t.name, bufs[t.name].data_ptr(), t.nbytes, False) for t in reader.tensors
               if t.nbytes]
    reader.load(targets, threads=3)
    return bufs


def describe(reader):
    return [(t.name, t.dtype, list(t.global_shape), list(t.local_shape), t.shard, t.nbytes)
            for t in sorted(reader.tensors, key=lambda t: t.name)]


def assert_view_equals(view, rank_file):
    assert describe(view) == describe(rank_file)
    a, b = read_all(view), read_all(rank_file)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{view.description}: tensor {name} differs from {rank_file.path}"


@pytest.mark.parametrize("arch,dtype", [("llama", "bf16"), ("qwen2", "fp32")])
def test_checkpoint_view_equals_convert(ckpts, tmp_path, arch, dtype):
    src = ckpts[(arch, dtype)]
    out = tmp_path / "out"
    for w in (1, 2, 3, 5, 8):  # 5 and 8: uneven chunks and empty shards (k_proj has 6 rows)
        convert(src, out, w)
        for r in range(w):
            view = _C.SourceRankView.of_checkpoint(src, w, r)
            assert view.layout_key == f"fsdp2-ws{w}" and view.rank == r and view.world_size == w
            rf = _C.RankFile.open(str(out / f"fsdp2-ws{w}" / f"rank-{r:05d}-of-{w:05d}.reshard"))
            assert_view_equals(view, rf)


def test_checkpoint_view_converts_dtype(ckpts, tmp_path):
    src = ckpts[("qwen2", "fp32")]
    out = tmp_path / "out"
    convert(src, out, 3, "--dtype", "bf16")
    for r in range(3):
        view = _C.SourceRankView.of_checkpoint(src, 3, r, dtype="bf16")
        assert view.layout_key == "fsdp2-ws3-bf16"
        assert_view_equals(view, _C.RankFile.open(str(out / "fsdp2-ws3-bf16" / f"rank-{r:05d}-of-00003.reshard")))


def test_layout_view_equals_convert(ckpts, tmp_path):
    """A layout of world size 4 read as world sizes 1, 2, 3, 5, 6 (and fp32 from bf16 files)."""
    src = ckpts[("llama", "bf16")]
    have = tmp_path / "have"
    convert(src, have, 4)
    for w in (1, 2, 3, 5, 6):
        want = tmp_path / f"want{w}"
        convert(src, want, w)
        for r in range(w):
            view = _C.SourceRankView.of_layout(str(have), "fsdp2-ws4", w, r)
            assert view.description == f"layout fsdp2-ws4 of {have}"
            # The rank files holding this rank's rows: all four for one rank, fewer for more.
            assert 1 <= len(view.files) <= 4 and (w > 1 or len(view.files) == 4), view.files
            assert all(f.startswith(str(have / "fsdp2-ws4") + "/rank-") for f in view.files), view.files
            assert_view_equals(view, _C.RankFile.open(str(want / f"fsdp2-ws{w}" / f"rank-{r:05d}-of-{w:05d}.reshard")))
    want = tmp_path / "want-fp32"
    convert(src, want, 3, "--dtype", "fp32")
    for r in range(3):
        view = _C.SourceRankView.of_layout(str(have), "fsdp2-ws4", 3, r, dtype="fp32")
        assert_view_equals(view, _C.RankFile.open(str(want / "fsdp2-ws3-fp32" / f"rank-{r:05d}-of-00003.reshard")))


def test_layout_view_zstd_and_fsdp1_source(ckpts, tmp_path):
    """Chunks of a zstd layout are decoded and checked; an FSDP1 layout (flat parameters,
    padding) is a source like any other."""
    src = ckpts[("llama", "bf16")]
    have = tmp_path / "have"
    convert(src, have, 3, "--compress", "zstd")
    convert(src, have, 2, "--layout", "fsdp1", "--model-manifest", str(manifest_of(src, tmp_path)))
    want = tmp_path / "want"
    convert(src, want, 2)
    for key in ("fsdp2-ws3", next(k for k in os.listdir(have) if k.startswith("fsdp1-"))):
        for r in range(2):
            view = _C.SourceRankView.of_layout(str(have), key, 2, r)
            assert_view_equals(view, _C.RankFile.open(str(want / "fsdp2-ws2" / f"rank-{r:05d}-of-00002.reshard")))


def manifest_of(src, tmp_path):
    path = tmp_path / "reshard-model.json"
    subprocess.run([sys.executable, "-m", "reshard.model_manifest", str(src), "-o", str(path)], check=True,
                   capture_output=True)
    return path


def test_layout_view_catches_a_flipped_byte_in_a_chunk_it_reads(ckpts, tmp_path):
    src = ckpts[("llama", "bf16")]
    have = tmp_path / "have"
    convert(src, have, 2)
    path = have / "fsdp2-ws2" / "rank-00001-of-00002.reshard"
    rf = _C.RankFile.open(str(path))
    # The last byte of the first tensor with data of rank 1: inside its (only) chunk.
    header = json.loads(rf.header_json())
    t = next(t for t in header["tensors"] if t["nbytes"] > 0)
    with open(path, "rb") as f:
        data_offset = _data_offset(f.read(64))
    at = data_offset + t["offset"] + t["nbytes"] - 1
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    # Rank 2 of 3 reads rows that rank 1 of 2 holds, in that chunk: caught, naming the file.
    caught = 0
    for r in range(3):
        view = _C.SourceRankView.of_layout(str(have), "fsdp2-ws2", 3, r)
        try:
            read_all(view)
        except reshard.CorruptFileError as e:
            assert str(path) in str(e) and "checksum mismatch" in str(e), e
            caught += 1
    assert caught >= 1


def _data_offset(preamble: bytes) -> int:
    """The data region's offset from a rank file's preamble (formats/rank-file.md)."""
    import struct

    return struct.unpack_from("<Q", preamble, 16)[0]  # data_offset: u64 at byte 16


def test_view_refusals(ckpts, tmp_path):
    src = ckpts[("llama", "bf16")]
    with pytest.raises(reshard.InvalidArgumentError):
        _C.SourceRankView.of_checkpoint(src, 2, 2)
    out = tmp_path / "out"
    convert(src, out, 3, "--ranks", "0-1")  # incomplete
    with pytest.raises(reshard.LayoutMismatchError, match="incomplete"):
        _C.SourceRankView.of_layout(str(out), "fsdp2-ws3", 2, 0)
    with pytest.raises(reshard.NotFoundError):
        _C.SourceRankView.of_layout(str(out), "fsdp2-ws9", 2, 0)


def run_ranks(src, out, nproc, tmp_path):
    """tests/python/fsdp_worker.py under torchrun (test_load.run_ranks), 3 training steps; the
    ranks' reports."""
    result, _ = test_load.run_ranks(src, out, nproc, tmp_path, "--steps", "3", "--min-drop", "0")
    return [json.load(open(result / f"rank-{r}.json")) for r in range(nproc)]


@pytest.mark.parametrize("arch,dtype,world", [("llama", "bf16", 3), ("qwen2", "fp32", 2)])
def test_fsdp2_load_straight_from_hugging_face(ckpts, tmp_path, arch, dtype, world):
    """The worker's model is built from the checkpoint directory and loaded from it: every
    parameter, buffer and the logits equal from_pretrained's (fsdp_worker.py)."""
    src = ckpts[(arch, dtype)]
    reports = run_ranks(src, src, world, tmp_path)
    for r in reports:
        assert r["source"].startswith(f"Hugging Face checkpoint {src}"), r
        assert "no conversion stored" in r["source"]
        assert r["layout"].startswith(f"fsdp2-ws{world}")
    assert not any(n.startswith("fsdp2-") or n == "reshard.json" for n in os.listdir(src)), "nothing is written"


def test_fsdp2_load_from_another_world_size(ckpts, tmp_path):
    src = ckpts[("qwen2", "fp32")]
    out = tmp_path / "out"
    convert(src, out, 4)
    before = sorted(os.listdir(out))
    reports = run_ranks(src, out, 3, tmp_path)
    for r in reports:
        assert r["source"].startswith(f"layout fsdp2-ws4 of {out}"), r
    assert sorted(os.listdir(out)) == before, "nothing is written"
    # The exact layout is preferred once it exists (the choice, without a job: sources.py).
    from torch import nn

    from reshard.sources import open_job_source

    convert(src, out, 3)
    for r in range(3):
        job = open_job_source(str(out), 3, r, torch.float32, nn.Module(), [], set())
        assert job.source == "rank file" and job.path.endswith(f"fsdp2-ws3/rank-{r:05d}-of-00003.reshard"), job
    job = open_job_source(str(out), 2, 1, torch.float32, nn.Module(), [], set())
    assert job.source.startswith(f"layout fsdp2-ws3 of {out}") and job.key == "fsdp2-ws2-fp32", job
    # A layout whose own rank file is missing is not read from itself: the other one serves.
    os.remove(out / "fsdp2-ws3" / "rank-00001-of-00003.reshard")
    job = open_job_source(str(out), 3, 1, torch.float32, nn.Module(), [], set())
    assert job.source.startswith(f"layout fsdp2-ws4 of {out}"), job


def run_fsdp1(src, out, nproc, tmp_path, *extra):
    """tests/python/fsdp1_worker.py: every unit's local flat shard loaded by reshard.load equals
    FSDP1's own sharding of from_pretrained's model, bit for bit; buffers and losses too."""
    result = tmp_path / "result1"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [os.path.join(HERE, "..", "..", "python"), HERE,
                                                      os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
                           os.path.join(HERE, "fsdp1_worker.py"), "--src", str(src), "--out", str(out),
                           "--result", str(result), "--steps", "2", *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.load(open(result.parent / n)) for n in sorted(os.listdir(result.parent))
               if n.startswith(result.name + ".")]
    assert len(results) == nproc
    for r in results:
        assert r["ok"], r
    return results


def test_fsdp1_load_from_hugging_face_and_from_an_fsdp2_layout(ckpts, tmp_path):
    src = ckpts[("qwen2", "fp32")]  # tied embeddings
    for r in run_fsdp1(src, src, 2, tmp_path, "--live-dtype", "fp32", "--orig"):
        assert r["source"].startswith(f"Hugging Face checkpoint {src}"), r
    out = tmp_path / "out"
    shutil.copy(manifest_of(src, tmp_path), tmp_path / "m.json")
    os.makedirs(out)
    shutil.copy(tmp_path / "m.json", out / "reshard-model.json")
    convert(src, out, 3)
    for r in run_fsdp1(src, out, 2, tmp_path, "--live-dtype", "fp32"):
        assert r["source"].startswith(f"layout fsdp2-ws3 of {out}"), r
        assert r["layout"].startswith("fsdp1-ws2-"), r


def test_hub_layout_checkpoint_loads_through_transformers_conversion(tmp_path):
    """DeepSeek-V3's hub checkpoint (per-expert keys, fused by transformers at load; a persistent
    fp32 buffer, e_score_correction_bias, stored whole): the view of each rank equals convert's
    rank file (both through the captured conversion), and a plain model loaded straight from the
    directory equals from_pretrained, buffers included."""
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(str(tmp_path / "deepseek_v3"), "deepseek_v3", "bf16", True)
    m = manifest_of(src, tmp_path)
    out = tmp_path / "out"
    convert(src, out, 3, "--model-manifest", str(m))
    text = open(m).read()
    for r in range(3):
        view = _C.SourceRankView.of_checkpoint(src, 3, r, model_manifest=text)
        assert_view_equals(view, _C.RankFile.open(str(out / "fsdp2-ws3" / f"rank-{r:05d}-of-00003.reshard")))
    model = reshard.empty_model(src)
    model.to_empty(device="cpu")
    report = reshard.load(model, src)
    assert "through transformers' conversion" in report.source, report.source
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == want[name].dtype and torch.equal(p.view(torch.uint8), want[name].view(torch.uint8)), name
    want_b = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert b.dtype == want_b[name].dtype and torch.equal(b, want_b[name]), name


def test_view_reads_a_cold_source_as_a_file_on_disk(ckpts, tmp_path):
    """The bytes this rank reads out of the page cache (evicted with POSIX_FADV_DONTNEED): the
    load takes the cold path (fewer readers, read-ahead in source order) and still lands every
    byte; once they are cached again, the warm path."""
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 3)

    def evict(paths):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    for make in (lambda: _C.SourceRankView.of_checkpoint(src, 2, 1),
                 lambda: _C.SourceRankView.of_layout(str(out), "fsdp2-ws3", 2, 1)):
        view = make()
        want = _C.RankFile.open(str(_converted(src, tmp_path, 2) / "fsdp2-ws2" / "rank-00001-of-00002.reshard"))
        evict(view.files)
        bufs = {t.name: torch.empty(t.nbytes, dtype=torch.uint8) for t in view.tensors}
        stats = view.load([_C.LoadTarget(n, b.data_ptr(), b.numel(), False) for n, b in bufs.items() if b.numel()],
                          threads=4)
        assert stats.cold, view.description
        ref = read_all(want)
        assert all(torch.equal(bufs[n], ref[n]) for n in bufs)
        stats = view.load([_C.LoadTarget(n, b.data_ptr(), b.numel(), False) for n, b in bufs.items() if b.numel()],
                          threads=4)
        assert not stats.cold, view.description


def _converted(src, tmp_path, w):
    out = tmp_path / f"ws{w}"
    if not out.exists():
        convert(src, out, w)
    return out


def test_a_layout_converted_to_another_dtype_is_not_read_at_another_world_size(ckpts, tmp_path):
    """A --dtype fp16 layout of a bf16 checkpoint holds values that went through fp16: a bf16
    job would get bf16(fp16(x)), not what from_pretrained gives. At the job's own world size it
    is no match (refused, naming the convert); at another one it was read, silently lossy. Now
    alike: refused with the layouts OUT has and the command; a keep layout is read."""
    import transformers

    from reshard.sources import other_layout

    src = ckpts[("llama", "bf16")]
    out = tmp_path / "h16"
    convert(src, out, 2, "--dtype", "fp16")
    manifest = json.load(open(out / "reshard.json"))
    assert other_layout(manifest, 1, "bf16") is None
    assert other_layout(manifest, 1, "fp16") == "fsdp2-ws2-fp16"  # an fp16 job: the same values
    model = reshard.empty_model(str(out), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with pytest.raises(reshard.NotFoundError, match=r"fsdp2-ws2-fp16.*reshard convert"):
        reshard.load(model, str(out))
    convert(src, out, 2)  # keep: read at world size 1, equal to from_pretrained
    report = reshard.load(model, str(out))
    assert "fsdp2-ws2 " in report.source or report.source.endswith("fsdp2-ws2"), report.source
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    sd = model.state_dict()
    for k, v in ref.items():
        assert torch.equal(sd[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k


def test_a_view_reports_the_tensors_it_converts(ckpts, tmp_path):
    """bf16 files loaded into an fp32 model: the view converts while reading (planned at the
    live dtype), and the report counts those tensors (it said 0 converted), as a rank file's
    load counts the ones it converts after reading."""
    src = ckpts[("llama", "bf16")]
    model = reshard.empty_model(src, dtype=torch.float32)
    model.to_empty(device="cpu")
    report = reshard.load(model, src)
    floats = sum(1 for _ in model.parameters())
    assert report.converted_tensors == floats, (report.converted_tensors, floats, report.source)
    view = _C.SourceRankView.of_checkpoint(src, 1, 0)  # keep: nothing converted
    assert view.converted_tensors == 0
