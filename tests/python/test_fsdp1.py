"""FSDP1 (FullyShardedDataParallel) layouts against real FSDP1 on CPU/gloo, several processes.

Each case captures the model manifest with `python -m reshard.manifest`, converts with the CLI,
verifies against the source, then runs tests/python/fsdp1_worker.py under torchrun: FSDP1
flattens and shards from_pretrained's weights itself (the reference) and, separately, an empty
model is loaded with reshard.load; the local flat shards must be equal bit for bit (padding
included), summon_full_params must give from_pretrained's weights, logits must match the
reference, and AdamW steps must lower the loss. Checkpoints are written by transformers."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from checkpoints import make_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
RESHARD = os.environ.get("RESHARD_BIN", os.path.join(ROOT, "build", "reshard"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in [os.path.join(ROOT, "python"), HERE,
                                                  os.environ.get("PYTHONPATH", "")] if p))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp1_ckpts")
    made = {}
    for arch, dtype, sharded in [("llama", "bf16", True), ("qwen2", "fp32", False),
                                 ("gpt2", "fp32", False)]:
        path = root / f"{arch}-{dtype}"
        make_checkpoint(str(path), arch, dtype, sharded)
        made[arch] = path
    return made


def manifest(src, out):
    proc = subprocess.run([sys.executable, "-m", "reshard.manifest", str(src), "-o",
                           str(out / "reshard-model.json")], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    return proc


def convert(src, out, ws, *extra):
    proc = subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", str(ws),
                           "--layout", "fsdp1", "--json", *extra], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def verify(out, src):
    proc = subprocess.run([RESHARD, "verify", str(out), "--source", str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def run_ranks(nproc, src, out, tmp_path, *extra):
    result = tmp_path / "result"
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
                           os.path.join(HERE, "fsdp1_worker.py"), "--src", str(src), "--out", str(out),
                           "--result", str(result), *extra],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.load(open(p)) for p in sorted(glob.glob(f"{result}.*"))]
    assert len(results) == nproc, proc.stderr[-4000:]
    return results


CASES = [
    # id, arch, world size, convert flags, worker flags
    ("llama-ws3-bf16", "llama", 3, [], ["--live-dtype", "bf16"]),
    ("llama-ws4-orig-fp32-mp-bf16", "llama", 4,
     ["--use-orig-params", "--param-dtype", "bf16", "--dtype", "fp32"],
     ["--live-dtype", "fp32", "--orig", "--param-dtype", "bf16"]),
    ("llama-ws5-padded", "llama", 5, [], ["--live-dtype", "bf16"]),
    # zstd frames are appended in header order, not source order (a flat parameter gathers
    # pieces of many source tensors): 4 KiB chunks make several frames per flat shard.
    ("llama-ws3-zstd", "llama", 3, ["--compress", "zstd", "--chunk-size", "4096"],
     ["--live-dtype", "bf16"]),
    ("qwen2-tied-ws2-orig", "qwen2", 2, ["--use-orig-params"], ["--live-dtype", "fp32", "--orig"]),
    ("qwen2-tied-ws3", "qwen2", 3, [], ["--live-dtype", "fp32"]),
    ("gpt2-two-classes-ws3-orig-mp", "gpt2", 3,
     ["--wrap", "GPT2Block", "--wrap", "GPT2MLP", "--use-orig-params", "--param-dtype", "bf16"],
     ["--live-dtype", "fp32", "--orig", "--param-dtype", "bf16", "--wrap", "GPT2Block,GPT2MLP"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fsdp1_load_equals_fsdp1_own_sharding(ckpts, tmp_path, case):
    _, arch, ws, flags, worker = case
    src, out = ckpts[arch], tmp_path / "out"
    manifest(src, out)
    summary = convert(src, out, ws, *flags)
    assert summary["layout_complete"]
    assert verify(out, src).startswith("OK")
    results = run_ranks(ws, src, out, tmp_path, *worker)
    for r in results:
        assert r["ok"], r
        assert r["layout"] == summary["layout"]
        assert r["losses"][-1] < r["losses"][0]
    if case[0] == "llama-ws5-padded":
        # 19824-element layer units over 5 ranks: the last rank carries FSDP1's zero padding.
        assert any(u["padded"] > 0 for r in results for u in r["units"])


def test_fsdp1_hybrid_shard_uses_rank_within_replica(ckpts, tmp_path):
    src, out = ckpts["llama"], tmp_path / "out"
    manifest(src, out)
    convert(src, out, 2, "--dtype", "fp32")
    results = run_ranks(4, src, out, tmp_path, "--live-dtype", "fp32", "--strategy", "HYBRID_SHARD",
                        "--replicas", "2")
    assert all(r["ok"] for r in results), results
    assert {r["layout"] for r in results} == {"fsdp1-ws2-LlamaDecoderLayer-fp32"}


def test_fsdp1_world_size_1_no_shard(ckpts, tmp_path):
    src, out = ckpts["llama"], tmp_path / "out"
    manifest(src, out)
    convert(src, out, 1, "--use-orig-params")
    results = run_ranks(1, src, out, tmp_path, "--live-dtype", "bf16", "--orig", "--steps", "2")
    assert results[0]["ok"], results


def test_fsdp1_refusals(ckpts, tmp_path):
    src, out = ckpts["qwen2"], tmp_path / "out"
    manifest(src, out)
    convert(src, out, 2, "--use-orig-params")
    # to_empty(recurse=False) as param_init_fn unties lm_head from embed_tokens: refused, with
    # the fix named.
    r = run_ranks(2, src, out, tmp_path, "--live-dtype", "fp32", "--orig", "--plain-init",
                  "--expect-error", "reshard.fsdp1_param_init_fn")
    assert all(x["ok"] for x in r), r
    # Without OUT/reshard-model.json no other layout can be replanned for the job (reshard.load
    # reads an fsdp1 job's rank from another layout when it is there: test_load_anywhere).
    os.remove(out / "reshard-model.json")
    # The job runs without use_orig_params: no layout matches; the error says what to convert.
    r = run_ranks(2, src, out, tmp_path, "--live-dtype", "fp32",
                  "--expect-error", "reshard convert <checkpoint> -o")
    assert all(x["ok"] for x in r), r
    assert "alignment" in r[0]["error"] or "parameter" in r[0]["error"]
    # Another world size: nothing for ws 3.
    r = run_ranks(3, src, out, tmp_path, "--live-dtype", "fp32", "--orig",
                  "--expect-error", "no fsdp1 layout for world size 3")
    assert all(x["ok"] for x in r), r


def test_fsdp1_cli_manifest_inspect_and_errors(ckpts, tmp_path):
    src, out = ckpts["llama"], tmp_path / "out"
    # Without a model manifest, convert explains how to capture one.
    proc = subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", "2",
                           "--layout", "fsdp1"], capture_output=True, text=True)
    assert proc.returncode == 3
    assert "python -m reshard.model_manifest" in proc.stderr
    assert not os.path.exists(out / "reshard.json")
    m = manifest(src, out)
    assert "LlamaDecoderLayer" in m.stdout
    data = json.load(open(out / "reshard-model.json"))
    assert [p["names"] for p in data["params"][:2]] == [["model.embed_tokens.weight"],
                                                        ["model.layers.0.self_attn.q_proj.weight"]]
    # A wrap class the model lacks is refused, listing the model's classes.
    proc = subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", "2",
                           "--layout", "fsdp1", "--wrap", "LlamaDecoderLayr"], capture_output=True, text=True)
    assert proc.returncode == 2 and "LlamaDecoderLayer" in proc.stderr and "LlamaDecoderLayr" in proc.stderr
    # Into a new directory: the refusal leaves no empty -o behind (it did, after the capture).
    fresh = tmp_path / "fresh"
    proc = subprocess.run([RESHARD, "convert", str(src), "-o", str(fresh), "--world-size", "2",
                           "--layout", "fsdp1", "--wrap", "LlamaDecoderLayr"], capture_output=True, text=True,
                          env=dict(ENV, RESHARD_MODEL_CAPTURE="1"))
    assert proc.returncode == 2 and "LlamaDecoderLayr" in proc.stderr, proc.stderr
    assert not fresh.exists(), sorted(os.listdir(fresh))
    summary = convert(src, out, 2)
    assert summary["wrap"] == ["LlamaDecoderLayer"] and summary["unused_tensors"] == []
    again = convert(src, out, 2)
    assert again["ranks_written"] == [] and again["ranks_up_to_date"] == [0, 1]
    text = subprocess.run([RESHARD, "inspect", str(out / summary["layout"] / "rank-00001-of-00002.reshard")],
                          capture_output=True, text=True, check=True).stdout
    assert "model.layers.0._flat_param" in text and "self_attn.q_proj.weight" in text
    assert "FSDP1: wrap LlamaDecoderLayer" in text
    # verify finds a flipped bit and names the unit.
    f = out / summary["layout"] / "rank-00001-of-00002.reshard"
    raw = bytearray(f.read_bytes())
    raw[4096 + 10] ^= 0x40
    f.write_bytes(bytes(raw))
    proc = subprocess.run([RESHARD, "verify", str(out)], capture_output=True, text=True)
    assert proc.returncode == 1 and "_flat_param" in proc.stdout and "checksum" in proc.stdout


@pytest.mark.parametrize("arch,ws,flags", [("llama", 5, []), ("gpt2", 3, ["--wrap", "GPT2Block", "--wrap",
                                                                         "GPT2MLP", "--use-orig-params"])])
def test_fsdp1_layout_exports_back_to_the_source(ckpts, tmp_path, arch, ws, flags):
    """reshard export of an FSDP1 layout: every source tensor comes back byte for byte (padding
    dropped), and from_pretrained loads the export with no missing keys."""
    import torch
    import transformers
    from safetensors import safe_open

    src, out, hf = ckpts[arch], tmp_path / "out", tmp_path / "hf"
    manifest(src, out)
    convert(src, out, ws, *flags)
    proc = subprocess.run([RESHARD, "export", str(out), "-o", str(hf)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    def tensors(d):
        got = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    got[k] = h.get_tensor(k)
        return got

    a, b = tensors(str(src)), tensors(str(hf))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    cls = getattr(transformers, json.load(open(os.path.join(src, "config.json")))["architectures"][0])
    model, info = cls.from_pretrained(str(hf), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_fsdp1_job_of_other_units_at_the_same_world_size_reads_the_layout_there(ckpts, tmp_path):
    """OUT holds fsdp1-ws2 wrapped by decoder layer; the job wraps the root alone, at world size
    2. It was refused with a convert command that wrote nothing new (no --wrap: the default
    units again); now the job's units are planned over that layout, as at another world size,
    and every parameter equals from_pretrained (the worker's check). The command a refusal
    names for a root-only job carries --wrap of the root class."""
    from reshard.load_fsdp1 import fsdp1_convert_command

    src, out = ckpts["llama"], tmp_path / "out"
    manifest(src, out)
    convert(src, out, 2)
    results = run_ranks(2, src, out, tmp_path, "--live-dtype", "bf16", "--wrap", "root")
    assert all(r["ok"] for r in results), results

    class Handle:
        world_size = 2

    class Root:
        module = torch.nn.Linear(1, 1)
        _use_orig_params = False

    cmd = fsdp1_convert_command(str(out), torch.nn.Sequential(), [("", Root(), Handle())], None)
    assert cmd == f"reshard convert <checkpoint> -o {out} --world-size 2 --layout fsdp1 --wrap Linear", cmd
