"""reshard.load on CPU: FSDP2 in several processes (gloo), plain modules in-process, and
refusals. Checkpoints are written by transformers itself (tests/python/checkpoints.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import make_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
RESHARD = os.environ.get("RESHARD_BIN", os.path.join(HERE, "..", "..", "build", "reshard"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def convert(src, out, world_size, *extra):
    subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", str(world_size),
                    *extra], check=True, capture_output=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_ckpts")
    made = {}
    for arch, dtype, sharded in [("llama", "bf16", True), ("qwen2", "fp32", False),
                                 ("qwen2", "bf16", True), ("llama", "fp32", False)]:
        path = root / f"{arch}-{dtype}-{'sharded' if sharded else 'single'}"
        make_checkpoint(str(path), arch, dtype, sharded)
        made[(arch, dtype)] = path
    return made


def run_ranks(src, out, nproc, tmp_path, *extra):
    result = tmp_path / "result"
    result.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.path.join(HERE, "..", "..", "python"),
                                                                  os.environ.get("PYTHONPATH", "")] if p),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([TORCHRUN, "--nproc-per-node", str(nproc), "--standalone",
                           os.path.join(HERE, "fsdp_worker.py"), "--src", str(src), "--out", str(out),
                           "--result", str(result), *extra],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "OK" in proc.stdout or "refused as expected" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]
    return result, proc


@pytest.mark.parametrize("arch,dtype,world", [("llama", "bf16", 2), ("qwen2", "fp32", 3),
                                              ("llama", "fp32", 4)])
def test_fsdp2_load_matches_from_pretrained(ckpts, tmp_path, arch, dtype, world):
    src = ckpts[(arch, dtype)]
    out = tmp_path / "out"
    convert(src, out, world)
    result, _ = run_ranks(src, out, world, tmp_path)
    reports = [json.load(open(result / f"rank-{r}.json")) for r in range(world)]
    files = {r["file"] for r in reports}
    assert len(files) == world, "every rank must read its own file"
    for r in reports:
        assert r["file"].endswith(f"rank-{r['rank']:05d}-of-{world:05d}.reshard")
        assert r["losses"][-1] < r["losses"][0]
    # Each rank read only its own bytes: together exactly the layout's bytes.
    layout = json.loads(subprocess.run([RESHARD, "inspect", str(out), "--json"], check=True,
                                       capture_output=True, text=True).stdout)
    assert sum(r["bytes"] for r in reports) == layout["layouts"][f"fsdp2-ws{world}"]["nbytes"]


def test_hsdp_2x2_uses_shard_coordinate(ckpts, tmp_path):
    src = ckpts[("qwen2", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 2)
    result, _ = run_ranks(src, out, 4, tmp_path, "--hsdp", "2")
    reports = [json.load(open(result / f"rank-{r}.json")) for r in range(4)]
    # Global rank g has shard coordinate g % 2 on a (2, 2) mesh: replicas share files.
    for r in reports:
        assert r["file"].endswith(f"rank-{r['rank'] % 2:05d}-of-00002.reshard"), r


def test_fsdp2_refuses_wrong_world_size(ckpts, tmp_path):
    """OUT holds no complete layout (a world-size-3 conversion of ranks 0-1 only): nothing to
    read a world-size-2 job from (with a complete one, it is read from: test_load_anywhere)."""
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 3, "--ranks", "0-1")
    run_ranks(src, out, 2, tmp_path, "--expect-error", "--world-size 2")


def _empty_cpu(out, dtype="auto"):
    model = reshard.empty_model(str(out), dtype=dtype)
    model.to_empty(device="cpu")
    return model


def _assert_same_as(model, ref):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8) if p.dtype != torch.bool else p,
                           ref_params[name].detach().view(torch.uint8)), name
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[name]), name


def test_plain_module_world_size_1(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    src = ckpts[("qwen2", "fp32")]
    out = tmp_path / "out"
    convert(src, out, 1)
    model = _empty_cpu(out)
    report = reshard.load(model, str(out))
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    _assert_same_as(model, ref)
    assert report.world_size == 1 and report.rank == 0 and report.bytes > 0
    assert set(report.buffers_restored) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    assert torch.equal(model(ids).logits, ref(ids).logits)


def test_zstd_rank_file_loads(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1, "--compress", "zstd", "--chunk-size", "8192")
    model = _empty_cpu(out)
    reshard.load(model, str(out))
    _assert_same_as(model, AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16))


@pytest.mark.parametrize("io", ["auto", "buffered", "readahead"])
def test_io_modes_on_host(ckpts, tmp_path, io):
    from transformers import AutoModelForCausalLM

    src = ckpts[("llama", "fp32")]
    out = tmp_path / "out"
    convert(src, out, 1, "--chunk-size", "8192")
    model = _empty_cpu(out)
    reshard.load(model, str(out), io=io, threads=3)
    _assert_same_as(model, AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32))


def test_live_dtype_differs_converts_like_to(ckpts, tmp_path):
    """accelerate upcasts trainable params to fp32: a bf16 file lands as .to(float32)."""
    from transformers import AutoModelForCausalLM

    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1)
    model = _empty_cpu(out, dtype=torch.float32)
    report = reshard.load(model, str(out))
    assert report.converted_tensors == len(list(model.parameters()))
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.float32
        assert torch.equal(p, q.to(torch.float32)), name


def test_empty_model_without_config_says_what_to_pass(ckpts, tmp_path):
    """reshard.empty_model of a directory with no config.json: a reshard error naming the file and
    what to pass (was transformers' ValueError about an unrecognized model); a layout directory
    passed for OUT gets the path to pass instead."""
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 2)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(reshard.NotFoundError, match=r"bare/config.json is missing: the model is built from it\. "
                                                    r"Pass a directory reshard convert or reshard.save wrote"):
        reshard.empty_model(str(bare))
    with pytest.raises(reshard.NotFoundError) as e:
        reshard.empty_model(str(out / "fsdp2-ws2"))
    assert "fsdp2-ws2/config.json is missing" in str(e.value), str(e.value)
    assert f"This is a layout directory of {out}: pass that directory" in str(e.value), str(e.value)
    with pytest.raises(reshard.NotFoundError, match=r"rank-00000-of-00002.reshard is a rank file, not an output "
                                                    r"directory: pass the directory that holds reshard.json"):
        reshard.empty_model(str(out / "fsdp2-ws2" / "rank-00000-of-00002.reshard"))
    reshard.empty_model(str(out))  # the output directory itself builds


def test_refuses_missing_layout_with_command(ckpts, tmp_path):
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 2, "--ranks", "1-1")  # incomplete: no layout to read world size 1 from
    model = _empty_cpu(out)
    with pytest.raises(reshard.NotFoundError, match=r"no layout fsdp2-ws1-bf16 or fsdp2-ws1 .*reshard convert .*--world-size 1 --dtype bf16"):
        reshard.load(model, str(out))


def test_prefers_layout_converted_to_live_dtype(ckpts, tmp_path):
    """OUT holds fsdp2-ws1 (bf16 as in the file) and fsdp2-ws1-fp32 (--dtype fp32): an fp32
    model loads the fp32 layout directly, with no conversion at load time."""
    from transformers import AutoModelForCausalLM

    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1)
    convert(src, out, 1, "--dtype", "fp32")
    model = _empty_cpu(out, dtype=torch.float32)
    report = reshard.load(model, str(out))
    assert report.layout == "fsdp2-ws1-fp32" and report.converted_tensors == 0
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q.to(torch.float32)), name
    bf16 = _empty_cpu(out)
    assert reshard.load(bf16, str(out)).layout == "fsdp2-ws1"


def test_refuses_another_model(ckpts, tmp_path):
    out_llama = tmp_path / "llama"
    convert(ckpts[("llama", "fp32")], out_llama, 1)
    out_qwen = tmp_path / "qwen"
    convert(ckpts[("qwen2", "fp32")], out_qwen, 1)
    model = _empty_cpu(out_qwen)
    with pytest.raises(reshard.LayoutMismatchError, match=r"parameter .*(not in|global shape)") as e:
        reshard.load(model, str(out_llama))
    # Said first: OUT is a conversion of a Llama (its config.json), the model a Qwen2; not only
    # "convert into OUT", which convert refuses (OUT holds another source).
    assert "is a conversion of another model: its config.json has model_type 'llama'" in str(e.value) and \
        "model_type 'qwen2'" in str(e.value), e.value


def test_refuses_a_hugging_face_checkpoint_of_another_model_type(ckpts, tmp_path):
    """A Llama model given a Qwen2 checkpoint directory whose names it cannot all find (a tie:
    no lm_head.weight there): refused naming both model types, not an AttributeError from
    transformers building a Llama from the Qwen2 config to learn the conversion."""
    out_llama = tmp_path / "llama"
    convert(ckpts[("llama", "fp32")], out_llama, 1)
    src = tmp_path / "qwen-tied"
    shutil.copytree(ckpts[("qwen2", "fp32")], src)
    import safetensors.torch

    for f in src.glob("*.safetensors"):  # as save_pretrained writes a tie: one name of it
        sd = safetensors.torch.load_file(f)
        if sd.pop("lm_head.weight", None) is not None:
            safetensors.torch.save_file(sd, f, metadata={"format": "pt"})
            index = src / "model.safetensors.index.json"
            if index.exists():
                idx = json.loads(index.read_text())
                idx["weight_map"].pop("lm_head.weight", None)
                index.write_text(json.dumps(idx))
    model = _empty_cpu(out_llama)
    with pytest.raises(reshard.LayoutMismatchError, match=r"model_type 'qwen2'.*model_type 'llama'"):
        reshard.load(model, str(src))


def test_refuses_shape_mismatch(ckpts, tmp_path):
    src = ckpts[("llama", "fp32")]
    out = tmp_path / "out"
    convert(src, out, 1)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] += 8
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "config.json").write_text(json.dumps(cfg))
    model = _empty_cpu(other)
    with pytest.raises(reshard.LayoutMismatchError, match=r"parameter model\.layers\.0\.mlp\.\w+_proj\.weight: the model has global shape"):
        reshard.load(model, str(out))


def test_refuses_missing_rank_file(ckpts, tmp_path):
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1)
    os.remove(out / "fsdp2-ws1" / "rank-00000-of-00001.reshard")
    model = _empty_cpu(out)
    with pytest.raises(reshard.NotFoundError, match=r"missing rank file.*--ranks 0-0"):
        reshard.load(model, str(out))


def test_refuses_corrupted_bytes(ckpts, tmp_path):
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1)
    path = out / "fsdp2-ws1" / "rank-00000-of-00001.reshard"
    header = json.loads(reshard._C._testing.read_header(str(path)))
    t = max(header["tensors"], key=lambda e: e["nbytes"])
    with open(path, "r+b") as f:
        f.seek(4096 + t["offset"] + t["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    model = _empty_cpu(out)
    with pytest.raises(reshard.CorruptFileError, match=rf"tensor \"{t['name']}\" chunk \d+: checksum mismatch"):
        reshard.load(model, str(out))
    # The raw path without checksums would load it: the check is what refuses.
    model2 = _empty_cpu(out)
    reshard.load(model2, str(out), verify=False)


def test_native_load_rejects_bad_targets(ckpts, tmp_path):
    """The binding's typed API (RankFile, LoadTarget): unknown names, wrong sizes and CUDA
    targets without CUDA are refused, each with its error class."""
    src = ckpts[("llama", "bf16")]
    out = tmp_path / "out"
    convert(src, out, 1)
    path = str(out / "fsdp2-ws1" / "rank-00000-of-00001.reshard")
    f = reshard._C.RankFile.open(path)
    assert f.rank == 0 and f.world_size == 1 and f.layout_key == "fsdp2-ws1" and f.kind == "fsdp2"
    buf = torch.empty(10, dtype=torch.uint8)
    with pytest.raises(reshard.LayoutMismatchError, match="has no tensor \"nope\""):
        f.load([reshard._C.LoadTarget("nope", buf.data_ptr(), 10)])
    e = f.tensors[0]
    with pytest.raises(reshard.LayoutMismatchError, match="the destination has 10"):
        f.load([reshard._C.LoadTarget(e.name, buf.data_ptr(), 10)])
    if not reshard.build_info()["cuda"]:
        with pytest.raises(reshard.UnsupportedError, match="no CUDA support"):
            f.load([reshard._C.LoadTarget(e.name, buf.data_ptr(), e.nbytes, True)])
    whole = torch.empty(e.nbytes, dtype=torch.uint8)
    stats = f.load([reshard._C.LoadTarget(e.name, whole.data_ptr(), e.nbytes)])
    assert stats.bytes == e.nbytes and stats.tensors == 1
    with pytest.raises(reshard.NotFoundError):
        reshard._C.RankFile.open(str(tmp_path / "absent.reshard"))


def test_prepare_is_a_no_op_without_cuda(monkeypatch):
    """reshard.prepare never creates a CUDA context on its own: without CUDA (or with
    RESHARD_PREPARE=0) it does nothing and says so."""
    import reshard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reshard.prepare() is False
    monkeypatch.setenv("RESHARD_PREPARE", "0")
    assert reshard.prepare("cuda:0") is False


@pytest.mark.parametrize("source", ["rank-file", "zstd", "hf-dir"])
def test_progress_line_counts_every_byte(ckpts, tmp_path, monkeypatch, capsys, source):
    """reshard.load(progress=True): the native loader's counter reaches exactly the bytes the
    report says were loaded (rank files raw and zstd, and a view of the HF files), and the
    line on stderr ends with that figure and the total."""
    from reshard.engine import ProgressLine

    monkeypatch.setattr(ProgressLine, "DELAY", 0.0)
    monkeypatch.setattr(ProgressLine, "INTERVAL", 0.001)
    seen = []
    real_exit = ProgressLine.__exit__

    def spy_exit(self, *exc):
        seen.append((self.counter.bytes, self.total))
        return real_exit(self, *exc)

    monkeypatch.setattr(ProgressLine, "__exit__", spy_exit)
    src = ckpts[("llama", "fp32")]
    out = tmp_path / "out"
    if source == "hf-dir":
        out = src
    else:
        convert(src, out, 1, "--chunk-size", "8192", *(["--compress", "zstd"] if source == "zstd" else []))
    model = _empty_cpu(out)
    capsys.readouterr()
    report = reshard.load(model, str(out), progress=True)
    err = capsys.readouterr().err
    (done, total), = seen
    assert done == report.bytes > 0
    assert total == report.bytes  # every tensor of the file is loaded here
    last = err.rstrip("\n").split("\r")[-1]
    assert last.startswith("\033[Krank 0: reshard.load: ")
    assert f"{reshard.format_bytes(done)} / {reshard.format_bytes(total)}" in last
    assert err.endswith("\n")
    # Off (the default): nothing on stderr.
    reshard.load(_empty_cpu(out), str(out))
    assert capsys.readouterr().err == ""


def test_an_unsharded_model_in_a_group_of_several_is_noted(monkeypatch):
    """Forgetting fully_shard in a job of several processes: every rank would load the whole
    model silently; a warning says so (and that it is right for DDP). Not said for one process,
    nor for a sharded model."""
    import warnings

    import torch.distributed as dist

    from reshard.load import _note_unsharded_in_a_group

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _note_unsharded_in_a_group(model, 1, "OUT")
        _note_unsharded_in_a_group(model, 2, "OUT")  # sharded over 2: nothing to say
    assert len(w) == 1 and "not sharded" in str(w[0].message) and "one of 2" in str(w[0].message), \
        [str(x.message) for x in w]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _note_unsharded_in_a_group(model, 1, "OUT")
    assert not w
