"""reshard.save / reshard.load_optimizer of FSDP1 (FullyShardedDataParallel) models on CPU:
several processes (torchrun --standalone, gloo), checkpoints written by transformers, layouts
made by `python -m reshard.manifest` + `reshard convert --layout fsdp1`.

* convert → load → save, no training (world sizes 2 and 3, use_orig_params off and on, a tied
  and an untied model): the saved rank files hold exactly the converted entries (names, dtypes,
  shapes, shards, flat objects, chunk checksums, bytes), under the key and layout fields that
  convert wrote; `reshard verify` passes, and fails once a byte is flipped;
* after training steps (FULL_SHARD, SHARD_GRAD_OP with bf16 mixed precision): `reshard export`
  of the saved checkpoint equals FSDP1's own gathered parameters (summon_full_params) byte for
  byte and from_pretrained loads it with no missing or unexpected keys; save → load into a
  fresh FSDP1 model (and optimizer) gives the same shards and state, and the next step the same
  loss (fsdp1_save_worker.py checks);
* HYBRID_SHARD 2x2: only one replica of each shard coordinate writes;
* a save killed mid-write leaves no checkpoint that loads or verifies; a re-run completes it;
* refusals: NO_SHARD on two ranks; optimizer state of another layout.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

import reshard
import reference_reader as rf

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
WORKER = os.path.join(HERE, "fsdp1_save_worker.py")


def _env(**extra):
    paths = [os.path.join(REPO, "python"), HERE, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **extra)


def _worker(nproc, out, save, result, *extra, timeout=300):
    os.makedirs(result, exist_ok=True)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), WORKER, "--out", str(out),
           "--save", str(save), "--result", str(result), *map(str, extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=REPO)
    assert proc.returncode == 0, f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return [json.load(open(os.path.join(result, f"rank-{r}.json"))) for r in range(nproc)]


def _fsdp1_layout(src, out, world, *flags):
    """Captures the model manifest into OUT and converts SRC there; returns the layout key."""
    proc = subprocess.run([sys.executable, "-m", "reshard.manifest", str(src), "-o",
                           str(out / "reshard-model.json")], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([os.environ.get("RESHARD_BIN", os.path.join(REPO, "build", "reshard")),
                           "convert", str(src), "-o", str(out), "--world-size", str(world),
                           "--layout", "fsdp1", "--json", *map(str, flags)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["layout"]


def _rank_file(path):
    """(header, {name: stored bytes}) of a raw-codec rank file, read with the C++ reader's
    header checks."""
    h = json.loads(reshard._C._testing.read_header(str(path)))
    data = open(path, "rb").read()
    assert all(t["codec"] == "raw" for t in h["tensors"])
    return h, {t["name"]: data[4096 + t["offset"]:4096 + t["offset"] + t["nbytes"]] for t in h["tensors"]}


def _rewrite_header(path, edit):
    """The rank file at `path` with its header JSON changed by edit(header), every checksum
    (header_xxh3, preamble_xxh3) recomputed so that only the edited field is wrong."""
    raw = open(path, "rb").read()
    ver, flags, d_off, d_size, h_off, h_size = struct.unpack_from("<IIQQQQ", raw, 8)
    header = json.loads(raw[h_off:h_off + h_size])
    edit(header)
    text = json.dumps(header).encode()
    pre = raw[:8] + struct.pack("<IIQQQQQ", ver, flags, d_off, d_size, h_off, len(text), rf.xxh3_64(text))
    pre += struct.pack("<Q", rf.xxh3_64(pre))
    with open(path, "wb") as f:
        f.write(pre + raw[64:h_off] + text)


def _manifest(out):
    with open(os.path.join(out, "reshard.json")) as f:
        return json.load(f)


def _safetensors(directory):
    from safetensors import safe_open

    got = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                got[k] = h.get_tensor(k)
    return got


CASES = [
    # id, arch, dtype, sharded checkpoint, world size, use_orig_params
    ("llama-untied-ws2", "llama", "bf16", True, 2, False),
    ("llama-untied-ws3-orig", "llama", "bf16", True, 3, True),
    ("qwen2-tied-ws2-orig", "qwen2", "fp32", False, 2, True),
    ("qwen2-tied-ws3", "qwen2", "fp32", False, 3, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fsdp1_save_after_load_is_the_converted_layout(checkpoint, cli, tmp_path, case):
    name, arch, dtype, sharded, world, orig = case
    src = checkpoint(arch, dtype, sharded)
    out, saved = tmp_path / "out", tmp_path / "saved"
    key = _fsdp1_layout(src, out, world, *(["--use-orig-params"] if orig else []))
    results = _worker(world, out, saved, tmp_path / "result", "--live-dtype", dtype,
                      *(["--orig"] if orig else []))
    assert [r["layout"] for r in results] == [key] * world
    assert [r["coord"] for r in results] == list(range(world)) and all(r["wrote"] for r in results)

    conv, mine = _manifest(out)["layouts"][key], _manifest(saved)["layouts"]
    assert list(mine) == [key], mine
    for field in ("kind", "world_size", "dtype", "wrap", "use_orig_params", "param_dtype", "dir", "complete"):
        assert mine[key][field] == conv[field], (field, mine[key][field], conv[field])
    assert mine[key]["kind"] == "fsdp1" and mine[key]["use_orig_params"] == orig
    for r in range(world):
        a, da = _rank_file(out / key / f"rank-{r:05d}-of-{world:05d}.reshard")
        b, db = _rank_file(saved / key / f"rank-{r:05d}-of-{world:05d}.reshard")
        assert b["layout"] == a["layout"], (b["layout"], a["layout"])
        assert b["rank"] == r and b["chunk_size"] == a["chunk_size"]
        assert b["source"]["files"] == [] and "saved" in b["source"]
        assert [t["name"] for t in b["tensors"]] == [t["name"] for t in a["tensors"]]
        flats = 0
        for t, u in zip(a["tensors"], b["tensors"]):
            for field in ("dtype", "global_shape", "shard", "local_shape", "nbytes", "chunk_xxh3",
                          "xxh3", "flat"):
                assert t.get(field) == u.get(field), (r, t["name"], field, t.get(field), u.get(field))
            assert da[t["name"]] == db[t["name"]], (r, t["name"])
            flats += "flat" in t
        assert flats == 3  # two decoder layers and the root
    if arch == "qwen2":  # tied: lm_head is an alias of embed_tokens inside the root's flat parameter
        h, _ = _rank_file(saved / key / f"rank-00000-of-{world:05d}.reshard")
        root = next(t for t in h["tensors"] if t["name"] == "_flat_param")
        assert root["flat"]["shared"] == ["lm_head.weight"]
        assert root["flat"]["params"][0]["key"] == "model.embed_tokens.weight"
    # The model manifest and the config came along; the saved directory describes itself.
    manifest = _manifest(saved)
    assert "reshard-model.json" in manifest["aux_files"]
    for a in manifest["aux_files"]:
        assert (saved / a).read_bytes() == (out / a).read_bytes(), a
    assert manifest["source"]["saved"]["step"] == 0
    cli("verify", saved, rc=0)
    r = cli("verify", saved, "--source", src, rc=1)
    assert "converted from source" in r.text
    text = cli("inspect", saved, rc=0).text
    assert f"layout {key}" in text and "FSDP1: wrap" in text
    if name == "llama-untied-ws2":
        # verify finds a flipped bit in a saved flat shard and names the unit.
        f = saved / key / "rank-00001-of-00002.reshard"
        h, _ = _rank_file(f)
        unit = next(t for t in h["tensors"] if t["name"] == "model.layers.1._flat_param")
        raw = bytearray(f.read_bytes())
        raw[4096 + unit["offset"] + 100] ^= 0x40
        f.write_bytes(bytes(raw))
        r = cli("verify", saved, rc=1)
        assert "model.layers.1._flat_param" in r.text and "checksum" in r.text, r.text


TRAINED = [
    # id, arch, dtype, sharded, world, convert flags, worker flags
    ("llama-ws2-full-shard", "llama", "bf16", True, 2, ["--dtype", "fp32"], ["--live-dtype", "fp32"]),
    ("qwen2-tied-ws3-orig-mp-bf16-shard-grad-op", "qwen2", "fp32", False, 3,
     ["--use-orig-params", "--param-dtype", "bf16"],
     ["--live-dtype", "fp32", "--orig", "--param-dtype", "bf16", "--strategy", "SHARD_GRAD_OP"]),
]


@pytest.mark.parametrize("case", TRAINED, ids=[c[0] for c in TRAINED])
def test_fsdp1_trained_save_exports_and_round_trips(checkpoint, cli, tmp_path, case):
    import transformers

    name, arch, dtype, sharded, world, flags, worker = case
    src = checkpoint(arch, dtype, sharded)
    out, saved, result = tmp_path / "out", tmp_path / "saved", tmp_path / "result"
    _fsdp1_layout(src, out, world, *flags)
    reports = _worker(world, out, saved, result, "--steps", 3, *worker)
    key = reports[0]["layout"]
    orig = "--orig" in worker
    assert key == f"fsdp1-ws{world}-{'LlamaDecoderLayer' if arch == 'llama' else 'Qwen2DecoderLayer'}" + \
        ("-orig-pbf16" if orig else "")
    for r in reports:
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["params_checked"] > 0 and r["state_tensors"] > 0 and r["optimizer_file"]
    cli("verify", saved, rc=0)

    # reshard export gives FSDP1's own gathered parameters, byte for byte.
    hf = tmp_path / "hf"
    cli("export", saved, "-o", hf, rc=0)
    got, want = _safetensors(str(hf)), _safetensors(str(result))
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n
    # The export carries reshard-model.json along: converted with the job's flags (its own
    # dtype, fp32), it gives the saved rank files back, entries and bytes.
    assert (hf / "reshard-model.json").read_bytes() == (out / "reshard-model.json").read_bytes()
    again = tmp_path / "again"
    layout_flags = [f for f in flags if f not in ("--dtype", "fp32")]
    r = cli("convert", hf, "-o", again, "--world-size", world, "--layout", "fsdp1", *layout_flags,
            "--json", rc=0)
    assert json.loads(r.out)["layout"] == key
    for rank in range(world):
        a, da = _rank_file(again / key / f"rank-{rank:05d}-of-{world:05d}.reshard")
        b, db = _rank_file(saved / key / f"rank-{rank:05d}-of-{world:05d}.reshard")
        assert a["layout"] == b["layout"]
        assert [t["name"] for t in a["tensors"]] == [t["name"] for t in b["tensors"]]
        for t, u in zip(a["tensors"], b["tensors"]):
            for field in ("dtype", "global_shape", "shard", "local_shape", "flat", "xxh3"):
                assert t.get(field) == u.get(field), (rank, t["name"], field)
            assert da[t["name"]] == db[t["name"]], (rank, t["name"])

    # The optimizer files: this rank's state as it is, described per shard coordinate.
    meta = json.load(open(saved / key / "optim" / "optimizer.json"))
    assert meta["class"] == "AdamW" and meta["step"] == 3 and meta["layout"] == key
    assert "state" not in meta and len(meta["rank_state"]) == world
    for r in range(world):
        h, data = _rank_file(saved / key / "optim" / f"rank-{r:05d}-of-{world:05d}.reshard")
        assert h["layout"]["key"] == key and h["rank"] == r
        entries = {t["name"]: t for t in h["tensors"]}
        kinds = {k for d in meta["rank_state"][r].values() for k in d["tensors"].values()}
        assert kinds == {"local", "whole"}, kinds
        for pname, d in meta["rank_state"][r].items():
            for k, kind in d["tensors"].items():
                e = entries[f"{pname}#{k}"]
                assert e["shard"] is None and e["dtype"] == "F32"
                assert (e["local_shape"] == []) == (kind == "whole")
        if not orig:  # the local flat shards' state: ceil(numel / W) elements, as the model's
            model_h, _ = _rank_file(saved / key / f"rank-{r:05d}-of-{world:05d}.reshard")
            flat = {t["name"]: t["local_shape"] for t in model_h["tensors"] if "flat" in t}
            assert {n for n in meta["rank_state"][r]} == set(flat)
            for n, shape in flat.items():
                assert entries[f"{n}#exp_avg"]["local_shape"] == shape
        cli("verify", saved / key / "optim" / f"rank-{r:05d}-of-{world:05d}.reshard", rc=0)
    if orig:
        # Which original parameters have elements (so state) on a rank differs between ranks.
        assert len({frozenset(s) for s in meta["rank_state"]}) > 1
    # verify checks each rank file of the directory against its own list in optimizer.json.
    cli("verify", saved / key / "optim", rc=0)
    meta_path = saved / key / "optim" / "optimizer.json"
    text = meta_path.read_text()
    last = world - 1
    dropped = sorted(meta["rank_state"][last])[0]
    tampered = json.loads(text)
    del tampered["rank_state"][last][dropped]
    meta_path.write_text(json.dumps(tampered))
    r = cli("verify", saved / key / "optim", rc=1)
    assert f"{dropped}#exp_avg" in r.out + r.err and "not listed for rank" in r.out + r.err, r.out + r.err
    tampered = json.loads(text)
    tampered["rank_state"] = tampered["rank_state"][:last]
    meta_path.write_text(json.dumps(tampered))
    r = cli("verify", saved / key / "optim", rc=1)
    assert f"lists state for {last} shard coordinates" in r.out + r.err, r.out + r.err
    # Malformed: the error names the file and the field.
    tampered = json.loads(text)
    tampered["rank_state"][0] = ["not", "an object"]
    meta_path.write_text(json.dumps(tampered))
    r = cli("verify", saved / key / "optim", rc=1)
    assert str(meta_path) in r.out + r.err and "rank_state[0]" in r.out + r.err, r.out + r.err
    meta_path.write_text(text)
    # A state tensor that several ranks hold has one dtype on all of them (and, without
    # use_orig_params, one shape): rank `last`'s header edited, its checksums consistent.
    opt_file = saved / key / "optim" / f"rank-{last:05d}-of-{world:05d}.reshard"
    pristine = opt_file.read_bytes()
    h_last, _ = _rank_file(opt_file)
    even = {t["name"] for t in h_last["tensors"] if t["local_shape"] and t["local_shape"][0] % 2 == 0}
    both = sorted(n + "#exp_avg" for n in set(meta["rank_state"][0]) & set(meta["rank_state"][last]))
    shared = [n for n in both if n in even][0]  # held by rank 0 too, of even length

    def retype(h):
        for t in h["tensors"]:
            if t["name"] == shared:
                t["dtype"] = "I32"  # F32 -> I32: same size, so nbytes stays consistent

    def reshape(h):
        for t in h["tensors"]:
            if t["name"] == shared:
                t["global_shape"] = t["local_shape"] = [t["global_shape"][0] // 2, 2]
    for edit, what in ((retype, "dtype"), (reshape, "shape")):
        _rewrite_header(opt_file, edit)
        cli("verify", opt_file, rc=0)  # alone, the file is intact
        r = cli("verify", saved / key / "optim", rc=0 if (what == "shape" and orig) else 1)
        if r.rc:
            assert shared in r.out + r.err and f"{what} differs from" in r.out + r.err, r.out + r.err
        opt_file.write_bytes(pristine)
    cli("verify", saved / key / "optim", rc=0)


@pytest.mark.parametrize("orig", [False, True])
def test_fsdp1_world_size_1_no_shard_round_trip(checkpoint, cli, tmp_path, orig):
    """One process: FSDP1 turns into NO_SHARD (the whole FlatParameter, original-shaped views
    and optimizer state under use_orig_params); saved as the world-size-1 fsdp1 layout."""
    src = checkpoint("qwen2", "fp32", False)
    out, saved = tmp_path / "out", tmp_path / "saved"
    key = _fsdp1_layout(src, out, 1, *(["--use-orig-params"] if orig else []))
    (r,) = _worker(1, out, saved, tmp_path / "result", "--steps", 2, "--no-source",
                   *(["--orig"] if orig else []))
    assert r["layout"] == key and r["wrote"] and r["state_tensors"] > 0
    cli("verify", saved, rc=0)
    cli("verify", saved / key / "optim", rc=0)
    # source=None: config.json from the model; no model manifest to copy.
    assert set(_manifest(saved)["aux_files"]) == {"config.json", "generation_config.json"}


def test_fsdp1_hybrid_shard_only_one_replica_writes(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", True)
    out, saved = tmp_path / "out", tmp_path / "saved"
    assert _fsdp1_layout(src, out, 2, "--dtype", "fp32") == "fsdp1-ws2-LlamaDecoderLayer-fp32"
    reports = _worker(4, out, saved, tmp_path / "result", "--live-dtype", "fp32", "--strategy",
                      "HYBRID_SHARD", "--replicas", 2, "--steps", 2)
    # Saved bytes are the live ones (fp32), under dtype policy keep.
    key = "fsdp1-ws2-LlamaDecoderLayer"
    assert {r["layout"] for r in reports} == {key}
    # Global rank g is replica g // 2, shard coordinate g % 2 on a (2, 2) mesh.
    assert [r["coord"] for r in reports] == [0, 1, 0, 1]
    assert [r["wrote"] for r in reports] == [True, True, False, False]
    assert sorted(os.listdir(saved / key)) == ["optim", "rank-00000-of-00002.reshard",
                                               "rank-00001-of-00002.reshard"]
    assert sorted(os.listdir(saved / key / "optim")) == ["optimizer.json", "rank-00000-of-00002.reshard",
                                                         "rank-00001-of-00002.reshard"]
    assert reports[0]["next_loss"] == reports[2]["next_loss"]
    cli("verify", saved, rc=0)


def test_fsdp1_killed_save_leaves_no_checkpoint(checkpoint, cli, tmp_path):
    src = checkpoint("qwen2", "fp32", False)
    out, good, bad = tmp_path / "out", tmp_path / "good", tmp_path / "bad"
    key = _fsdp1_layout(src, out, 2)
    _worker(2, out, good, tmp_path / "r1")
    good_files = {p: open(p, "rb").read() for p in glob.glob(str(good / "**" / "*"), recursive=True)
                  if os.path.isfile(p)}

    result = tmp_path / "r2"
    result.mkdir()
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKER, "--out", str(out), "--save",
           str(bad), "--result", str(result), "--mode", "interrupted"]
    # Three flat shards per rank file: one second before each keeps both files open for ~3 s.
    proc = subprocess.Popen(cmd, env=_env(RESHARD_TEST_SAVE_PAUSE="1.0"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.time() + 240
        temps = []
        while time.time() < deadline and proc.poll() is None:
            temps = glob.glob(str(bad / key / ".rank-*.tmp-*"))
            if len(temps) == 2 and all(os.path.exists(result / f"pid-{r}") for r in range(2)):
                break
            time.sleep(0.05)
        assert len(temps) == 2, "both ranks should be writing: " + (proc.communicate()[1] or "")[-4000:]
        time.sleep(1.2)  # a tensor or two into the files
        os.kill(int((result / "pid-1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not (bad / "reshard.json").exists()
    assert not (bad / key / "rank-00001-of-00002.reshard").exists()
    cli("verify", bad, rc=1)
    cli("verify", bad / key, rc=1)
    # reshard.load refuses a directory without a manifest (an FSDP1 load: the worker's re-run).
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    with pytest.raises(reshard.NotFoundError, match="no reshard.json"):
        reshard.load(model, str(bad))
    # The previous checkpoint is untouched and still verifies.
    assert good_files == {p: open(p, "rb").read() for p in good_files}
    cli("verify", good, rc=0)
    # A re-run of the save completes the interrupted checkpoint (and loads back: the worker checks).
    _worker(2, out, bad, tmp_path / "r3")
    cli("verify", bad, rc=0)


def test_fsdp1_save_refusals(checkpoint, tmp_path):
    src = checkpoint("qwen2", "fp32", False)
    out, saved = tmp_path / "out", tmp_path / "saved"
    plain = _fsdp1_layout(src, out, 2)
    orig = _fsdp1_layout(src, out, 2, "--use-orig-params")
    # NO_SHARD on two ranks: every rank holds the whole FlatParameter, which no fsdp1 layout
    # describes (nor loads: the job is built without a load); the save refuses on every rank.
    r = _worker(2, out, tmp_path / "unused", tmp_path / "r0", "--mode", "expect-error", "--strategy",
                "NO_SHARD", "--no-load", "--expect-error", "NO_SHARD on 2 ranks")
    assert all("NO_SHARD" in x["error"] for x in r)
    assert not os.path.exists(tmp_path / "unused" / "reshard.json")
    # Optimizer state saved by a use_orig_params job does not go into a job without it.
    _worker(2, out, saved, tmp_path / "r1", "--orig", "--steps", 1)
    assert _manifest(saved)["layouts"].keys() == {orig}
    r = _worker(2, out, saved, tmp_path / "r2", "--mode", "optim-refused", "--steps", 1,
                "--expect-error", f"holds optimizer state for layout(s) {orig} only, another layout "
                                  f"than this job's {plain}")
    assert all(plain in x["error"] for x in r)


_BUFFER_DTYPE_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
import reshard

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.1, 3.3, 8, dtype=torch.float32) + 1e-4)
    def forward(self, x):
        return self.lin(x) * self.scale
torch.manual_seed(0)
m = M()
want = m.scale.clone()
model = FSDP(m, device_id=torch.device("cpu"),
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
model(torch.randn(2, 8))
live = dict(model.named_buffers())
assert any(b.dtype == torch.bfloat16 for b in live.values()), {n: b.dtype for n, b in live.items()}
rep = reshard.save(model, sys.argv[1], source=None)
h = json.loads(reshard._C._testing.read_header(rep.file))
e = next(t for t in h["tensors"] if t["name"] == "scale")
print("RESULT", json.dumps({"dtype": e["dtype"], "layout": rep.layout,
                            "want_rounded": want.to(torch.bfloat16).float().tolist()}), flush=True)
dist.destroy_process_group()
os._exit(0)  # without interpreter teardown: see tests/python/dist_util.py worker_main
"""


def test_fsdp1_buffers_cast_by_mixed_precision_are_saved_in_their_own_dtype(tmp_path):
    """MixedPrecision(buffer_dtype=bf16) casts buffers in place; the save writes them in the
    dtype the model had (as FSDP's state_dict does), so the file agrees with convert's."""
    saved = tmp_path / "saved"
    p = subprocess.run([sys.executable, "-c", _BUFFER_DTYPE_SCRIPT, str(saved)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert r["dtype"] == "F32", r
    got = reshard_tensor(saved, r["layout"], "scale")
    assert got.dtype == torch.float32 and got.tolist() == r["want_rounded"]


def reshard_tensor(out, key, name):
    from reshard.layout import torch_dtype

    path = os.path.join(out, key, "rank-00000-of-00001.reshard")
    h = json.loads(reshard._C._testing.read_header(path))
    e = next(t for t in h["tensors"] if t["name"] == name)
    t = torch.empty(e["local_shape"], dtype=torch_dtype(e["dtype"]))
    reshard._C._testing.load_raw(path, [(name, t.data_ptr(), e["nbytes"], False)], io="buffered")
    return t
