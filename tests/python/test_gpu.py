"""GPU tests (marker `gpu`): run on the GPU machine by scripts/gpu_check.sh. CPU CI
deselects them by marker; if selected on a machine without CUDA they fail, never skip."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import reshard
from checkpoints import make_checkpoint
from test_load import RESHARD, convert, run_ranks

pytestmark = pytest.mark.gpu


def _require_cuda():
    assert torch.cuda.is_available(), "GPU test selected on a machine without CUDA"
    assert reshard.build_info()["cuda"], "reshard was built without CUDA"


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "llama-bf16"
    make_checkpoint(str(path), "llama", "bf16", True)
    return path


def _source_tensors(src):
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for name, file in index.items():
        with safe_open(os.path.join(src, file), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_fsdp2_one_process_nccl_cuda(llama_bf16, tmp_path):
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 1)
    run_ranks(llama_bf16, out, 1, tmp_path, "--device", "cuda")


@pytest.mark.parametrize("io", ["auto", "direct", "buffered", "readahead"])
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_each_rank_of_ws8_into_cuda(llama_bf16, tmp_path, io, compress):
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 8, *(["--compress", compress, "--chunk-size", "8192"] if compress else []))
    src = _source_tensors(str(llama_bf16))
    for r in range(8):
        path = str(out / "fsdp2-ws8" / f"rank-{r:05d}-of-00008.reshard")
        header = json.loads(reshard._C._testing.read_header(path))
        dests = {}
        targets = []
        for e in header["tensors"]:
            t = torch.full(e["local_shape"], float("nan"), dtype=src[e["name"]].dtype, device="cuda")
            dests[e["name"]] = t
            targets.append((e["name"], t.data_ptr(), e["nbytes"], True))
        report = reshard._C._testing.load_raw(path, targets, device=torch.cuda.current_device(), threads=4, io=io)
        assert report["bytes"] == sum(e["nbytes"] for e in header["tensors"])
        for name, t in dests.items():
            chunks = torch.chunk(src[name], 8, 0) if src[name].dim() else [src[name]] * 8
            want = chunks[r] if r < len(chunks) else src[name][0:0]
            assert torch.equal(t.cpu().view(torch.uint8), want.contiguous().view(torch.uint8)), (r, name)


def test_gpu_load_refuses_corrupted_file(llama_bf16, tmp_path):
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 1)
    path = out / "fsdp2-ws1" / "rank-00000-of-00001.reshard"
    header = json.loads(reshard._C._testing.read_header(str(path)))
    e = max(header["tensors"], key=lambda t: t["nbytes"])
    with open(path, "r+b") as f:
        f.seek(4096 + e["offset"] + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    model = reshard.empty_model(str(out))
    model.to_empty(device="cuda")
    for io in ("direct", "buffered", "readahead"):
        with pytest.raises(reshard.CorruptFileError, match="checksum mismatch"):
            reshard.load(model, str(out), io=io)


def test_plain_module_on_cuda_matches_from_pretrained(llama_bf16, tmp_path):
    _require_cuda()
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    convert(llama_bf16, out, 1)
    model = reshard.empty_model(str(out))
    model.to_empty(device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = reshard.load(model, str(out))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "load allocated GPU memory beyond the weights"
    # Nor for a while: torch's high-water mark during the load is where it started.
    assert torch.cuda.max_memory_allocated() == before, (
        f"load held {torch.cuda.max_memory_allocated() - before} bytes of GPU memory for a while")
    ref = AutoModelForCausalLM.from_pretrained(str(llama_bf16), dtype=torch.bfloat16).cuda()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), n
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, c), n
    assert report.bytes > 0


def test_converting_load_on_cuda_holds_no_gpu_temporaries(llama_bf16, tmp_path):
    """A live dtype other than the file's (fp32 parameters, bf16 file) goes through host
    batches and Tensor.copy_: the values equal from_pretrained's .float(), and torch's device
    allocation neither grows nor peaks during the load."""
    _require_cuda()
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    convert(llama_bf16, out, 1)
    model = reshard.empty_model(str(out))
    model.to_empty(device="cuda")
    model.float()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    reshard.load(model, str(out))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.max_memory_allocated() == before, (
        f"load held {torch.cuda.max_memory_allocated() - before} bytes of GPU memory for a while")
    ref = AutoModelForCausalLM.from_pretrained(str(llama_bf16), dtype=torch.bfloat16).float()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.cpu(), q), n


def test_trainer_on_cuda_one_process(llama_bf16, tmp_path):
    """reshard.train on CUDA with NCCL, 1 process: weights equal from_pretrained, greedy
    generation equals the unsharded model's, loss falls; load time and memory recorded."""
    _require_cuda()
    import sys

    out = tmp_path / "out"
    convert(llama_bf16, out, 1)
    result = tmp_path / "result"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "1", "-m", "reshard.train",
                           str(out), "--steps", "20", "--device", "cuda", "--check-weights", str(llama_bf16),
                           "--check-generate", str(llama_bf16), "--json-out", str(result)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.load(open(result / "rank-0.json"))
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    assert r.get("cuda_peak_bytes", 0) > 0
    print("\n" + "\n".join(l for l in proc.stdout.splitlines() if l.startswith(("load:", "rank 0", "check"))))


@pytest.mark.parametrize("orig", [False, True])
def test_fsdp1_on_cuda_equals_fsdp1_own_sharding(llama_bf16, tmp_path, orig):
    """FSDP1 on CUDA with NCCL, one process per visible GPU: reshard.load's local flat shards
    equal FSDP1's own from from_pretrained (padding included), full parameters equal, logits
    equal, loss falls (tests/python/fsdp1_worker.py)."""
    _require_cuda()
    import glob
    import sys

    n = torch.cuda.device_count()
    out = tmp_path / "out"
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "..", "python"), here]))
    subprocess.run([sys.executable, "-m", "reshard.manifest", str(llama_bf16), "-o",
                    str(out / "reshard-model.json")], check=True, env=env, capture_output=True)
    flags = ["--use-orig-params", "--param-dtype", "bf16"] if orig else []
    convert(llama_bf16, out, n, "--layout", "fsdp1", "--dtype", "fp32", *flags)
    worker = ["--live-dtype", "fp32", "--device", "cuda"] + (["--orig", "--param-dtype", "bf16"] if orig else [])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(n),
                           os.path.join(here, "fsdp1_worker.py"), "--src", str(llama_bf16), "--out", str(out),
                           "--result", str(tmp_path / "r"), *worker],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "r.*")))]
    assert len(results) == n
    for r in results:
        assert r["ok"], r


@pytest.mark.parametrize("span,piece,lead", [(0, 0, None), (0, 4096, None), (4 << 20, 0, 0),
                                             (1 << 30, 1000, 4096), (1 << 30, 0, 2048)])
def test_spans_and_hash_pieces_land_every_byte(llama_bf16, tmp_path, span, piece, lead):
    """Warm spans (adjacent chunks in one read and one copy per tensor run), chunks hashed in
    pieces, a thread's first span copied in parts as it is read (lead-in; None: the default),
    and cold O_DIRECT spans from fewer threads: every tensor equals the source."""
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 1, "--chunk-size", "8192")
    src = _source_tensors(str(llama_bf16))
    path = str(out / "fsdp2-ws1" / "rank-00000-of-00001.reshard")
    header = json.loads(reshard._C._testing.read_header(path))
    for io in ("buffered", "direct"):
        dests, targets = {}, []
        for e in header["tensors"]:
            t = torch.full(e["local_shape"], float("nan"), dtype=src[e["name"]].dtype, device="cuda")
            dests[e["name"]] = t
            targets.append((e["name"], t.data_ptr(), e["nbytes"], True))
        report = reshard._C._testing.load_raw(path, targets, device=torch.cuda.current_device(), threads=3, io=io,
                                 span_bytes=span, hash_piece_bytes=piece, cold_threads=2,
                                 cold_span_bytes=span or (3 << 20), lead_in_bytes=lead)
        assert report["bytes"] == sum(e["nbytes"] for e in header["tensors"])
        assert report["span_bytes"] <= max(8192, span or (3 << 20) if io == "direct" else span or 8192)
        if io == "direct":  # O_DIRECT was used wherever the file system allows it
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
                possible = True
            except OSError:
                possible = False
            assert report["direct_io"] == possible, report
        for name, t in dests.items():
            assert torch.equal(t.cpu().view(torch.uint8), src[name].contiguous().view(torch.uint8)), (io, name)


@pytest.mark.parametrize("threads,cold", [(None, False), (4, True), (8, True)])
def test_prepare_makes_the_first_load_pay_no_staging(llama_bf16, tmp_path, threads, cold):
    """reshard.prepare sets the copy engine up in the background: a first load in a fresh
    process that called it allocates no staging, warm or cold (O_DIRECT spans), whatever the
    thread count; one that did not, does. Both run on the copy engine's own reader threads."""
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 1, "--chunk-size", "65536")
    script = (
        "import os, sys, torch, reshard\n"
        "torch.cuda.set_device(0)\n"
        "torch.empty(1, device='cuda')\n"
        "prepared = sys.argv[2] == '1'\n"
        "threads = int(sys.argv[3]) or None\n"
        "if prepared:\n"
        "    assert reshard.prepare(threads=threads, wait=True) is True\n"
        "model = reshard.empty_model(sys.argv[1])\n"
        "model.to_empty(device='cuda')\n"
        "if sys.argv[4] == '1':  # out of the page cache: a cold load\n"
        "    path = reshard.find_rank_file(sys.argv[1], 1, 0)[0]\n"
        "    fd = os.open(path, os.O_RDONLY)\n"
        "    os.fdatasync(fd)\n"
        "    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
        "    os.close(fd)\n"
        "r = reshard.load(model, sys.argv[1], threads=threads)\n"
        "print('ALLOC', r.staging_alloc_seconds, r.bytes, r.pooled)\n")
    env = dict(os.environ, RESHARD_PREPARE="0")  # no automatic prepare in empty_model
    got = {}
    for prepared in ("1", "0"):
        p = subprocess.run([sys.executable, "-c", script, str(out), prepared, str(threads or 0),
                            "1" if cold else "0"],
                           env=env if prepared == "0" else {k: v for k, v in os.environ.items()
                                                            if k != "RESHARD_PREPARE"},
                           capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        line = [x for x in p.stdout.splitlines() if x.startswith("ALLOC")][-1].split()
        got[prepared] = (float(line[1]), int(line[2]), line[3])
    assert got["1"][0] == 0.0 and got["1"][1] > 0, got
    assert got["0"][0] > 0.0, got
    # Either way the reader threads are the copy engine's own, started once per process.
    assert got["1"][2] == "True" and got["0"][2] == "True", got


@pytest.mark.parametrize("orig", [False, True])
def test_fsdp1_save_from_cuda_round_trips(llama_bf16, tmp_path, orig):
    """reshard.save of an FSDP1 model on CUDA (NCCL, one process per visible GPU; one GPU:
    NO_SHARD, world size 1) after two AdamW steps: the flat shards go device → pinned staging →
    file; a fresh FSDP1 model and optimizer loaded from the save equal the trained ones and take
    the same next step (tests/python/fsdp1_save_worker.py); the checkpoint verifies, and
    `reshard export` of it equals FSDP1's own gathered parameters byte for byte."""
    _require_cuda()
    import glob
    import sys

    n = torch.cuda.device_count()
    out, saved, result = tmp_path / "out", tmp_path / "saved", tmp_path / "result"
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "..", "python"), here]))
    subprocess.run([sys.executable, "-m", "reshard.manifest", str(llama_bf16), "-o",
                    str(out / "reshard-model.json")], check=True, env=env, capture_output=True)
    flags = ["--use-orig-params", "--param-dtype", "bf16"] if orig else []
    convert(llama_bf16, out, n, "--layout", "fsdp1", "--dtype", "fp32", *flags)
    worker = ["--live-dtype", "fp32", "--device", "cuda", "--steps", "2"] + \
        (["--orig", "--param-dtype", "bf16"] if orig else [])
    os.makedirs(result)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(n),
                           os.path.join(here, "fsdp1_save_worker.py"), "--out", str(out), "--save",
                           str(saved), "--result", str(result), *worker],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = [json.load(open(os.path.join(result, f"rank-{r}.json"))) for r in range(n)]
    key = "fsdp1-ws%d-LlamaDecoderLayer%s" % (n, "-orig-pbf16" if orig else "")
    for r in reports:
        assert r["layout"] == key and r["wrote"] and r["state_tensors"] > 0, r
    subprocess.run([RESHARD, "verify", str(saved)], check=True, capture_output=True)
    hf = tmp_path / "hf"
    subprocess.run([RESHARD, "export", str(saved), "-o", str(hf)], check=True, capture_output=True)
    got, want = {}, {}
    for d, dst in ((hf, got), (result, want)):
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    dst[k] = h.get_tensor(k)
    assert sorted(got) == sorted(want) and want
    for k in want:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.parametrize("source", ["checkpoint", "layout"])
def test_views_of_ws8_into_cuda(llama_bf16, tmp_path, source):
    """Every rank of world size 8 loaded onto the GPU straight from the Hugging Face files, and
    from a world-size-3 layout (issue 23): the bytes equal the source's rows, through the
    copier's staging (small pieces, so that tensors span several pieces and slots cycle)."""
    _require_cuda()
    out = tmp_path / "out"
    convert(llama_bf16, out, 3)
    src = _source_tensors(str(llama_bf16))
    os.environ["RESHARD_SPAN_BYTES"] = "8192"
    try:
        for r in range(8):
            view = (reshard._C.SourceRankView.of_checkpoint(str(llama_bf16), 8, r) if source == "checkpoint"
                    else reshard._C.SourceRankView.of_layout(str(out), "fsdp2-ws3", 8, r))
            dests = {t.name: torch.empty(t.local_shape, dtype=src[t.name].dtype, device="cuda")
                     for t in view.tensors}
            targets = [reshard._C.LoadTarget(n, d.data_ptr(), d.numel() * d.element_size(), True)
                       for n, d in dests.items() if d.numel()]
            view.load(targets, device=torch.cuda.current_device(), threads=4)
            torch.cuda.synchronize()
            for t in view.tensors:
                want = src[t.name][t.shard[0]:t.shard[1]] if t.shard else src[t.name]
                assert torch.equal(dests[t.name].cpu().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                    f"{source}: rank {r}: {t.name} differs"
    finally:
        del os.environ["RESHARD_SPAN_BYTES"]


def test_fsdp2_one_process_cuda_straight_from_hugging_face(llama_bf16, tmp_path):
    _require_cuda()
    run_ranks(llama_bf16, llama_bf16, 1, tmp_path, "--device", "cuda")


@pytest.mark.parametrize("mesh,source", [("dp_shard=2,tp=2", "layout"), ("tp=4", "layout"),
                                         ("dp_shard=2,tp=2", "hf")])
def test_dtensor_layout_each_coordinate_into_cuda(tmp_path, cli, mesh, source):
    """A DTensor layout (issue 22) loads onto CUDA: each mesh coordinate of the job in turn, one
    process each (a fake process group: torch's own placements and local shapes, no collective,
    as reshard.load needs none), every parameter's CUDA to_local() and every buffer equal to
    from_pretrained's tensors split by torch's own functions (dtensor_gpu_worker.py). "hf": the
    job loads straight from the Hugging Face files (planned for its placements, nothing stored)."""
    _require_cuda()
    from dist_util import dist_env
    from dtensor_common import llama_plan, tiny_llama

    PLAN = llama_plan("llama_tp")
    src = tmp_path / "src"
    tiny_llama(src)
    fsdp = mesh.startswith("dp_shard")
    (tmp_path / "llama_tp.json").write_text(json.dumps(dict(PLAN, fsdp={"mesh_dim": "dp_shard"}) if fsdp else PLAN))
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--mesh", mesh, "--plan", tmp_path / "llama_tp.json", rc=0)
    for rank in range(4):
        p = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "dtensor_gpu_worker.py"),
                            str(src), str(out if source == "layout" else src), mesh, str(rank), "cuda"],
                           capture_output=True, text=True,
                           timeout=300, env=dist_env())
        assert p.returncode == 0, p.stderr[-4000:]
        rec = json.loads(p.stdout.strip().splitlines()[-1])
        assert rec["differ"] == [], rec
        assert rec["devices"] == ["cuda"], rec
        assert rec["params"] > 0 and rec["bytes"] == rec["local_bytes"] > 0, rec
        assert rec["layout"].startswith("dtensor-") and ("llama_tp" if source == "layout" else "-live.") in \
            rec["layout"], rec
        q = rec["placements"]["model.layers.0.self_attn.q_proj.weight"]
        assert q == (["_S(0, 2)", "S(0)"] if fsdp else ["S(0)"]), q
