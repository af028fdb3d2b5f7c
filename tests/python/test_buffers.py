"""Buffers exactly as from_pretrained has them, whatever the dtype the model is built in.

GPT-J and CodeGen keep a non-persistent rotary table (`attn.embed_positions`, fp32). Their
constructor computes it while torch's default dtype is the model's (bf16/fp16 under
`from_config(dtype=...)`), so its inverse frequencies are rounded; from_pretrained recomputes
it in `_init_weights` after leaving that context, in fp32. Every test here compares against
transformers' own from_pretrained of the same checkpoint (an independent reference), and
checks first that the checkpoint does exercise the difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import make_bin_checkpoint, make_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
RESHARD = os.environ.get("RESHARD_BIN", os.path.join(REPO, "build", "reshard"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _convert(src, out, world, *extra, capture=False):
    # capture: convert captures the model manifest (transformers' conversion: Pythia's embed_out).
    env = dict(os.environ, RESHARD_MODEL_CAPTURE="1", RESHARD_PYTHON=sys.executable) if capture else None
    subprocess.run([RESHARD, "convert", str(src), "-o", str(out), "--world-size", str(world), *extra],
                   check=True, capture_output=True, env=env)


def _constructor_buffers(src, dtype):
    """The buffers as the constructor computes them under from_config(dtype=...): what
    reshard.empty_model kept before buffers were recomputed as from_pretrained does."""
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(str(src))
    cls = getattr(transformers, config.architectures[0])
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype)
    return {n: b.clone() for n, b in model.named_buffers()}


def _assert_equal_to(model, ref, what):
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(ref_params), what
    for name, p in params.items():
        want = ref_params[name]
        assert p.dtype == want.dtype and p.shape == want.shape, (what, name, p.dtype, want.dtype)
        assert torch.equal(_bits(p), _bits(want)), f"{what}: parameter {name} differs"
    ref_buffers = dict(ref.named_buffers())
    buffers = dict(model.named_buffers())
    assert sorted(buffers) == sorted(ref_buffers), what
    for name, b in buffers.items():
        want = ref_buffers[name]
        assert b.dtype == want.dtype, (what, name, b.dtype, want.dtype)
        assert torch.equal(_bits(b), _bits(want)), \
            f"{what}: buffer {name} differs by {(b.double() - want.double()).abs().max().item()}"


@pytest.fixture(scope="module")
def rotary_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("buffer_ckpts")
    made = {}
    for arch in ("gptj", "codegen"):
        for dtype in ("bf16", "fp16"):
            made[(arch, dtype)] = make_checkpoint(str(root / f"{arch}-{dtype}"), arch, dtype, False)
    return made


@pytest.mark.parametrize("arch", ["gptj", "codegen"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_plain_load_buffers_equal_from_pretrained(rotary_ckpts, tmp_path, arch, dtype):
    from transformers import AutoModelForCausalLM

    src = rotary_ckpts[(arch, dtype)]
    ref = AutoModelForCausalLM.from_pretrained(src)
    assert ref.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # The checkpoint exercises the bug: the constructor's table is not from_pretrained's.
    ctor = _constructor_buffers(src, ref.dtype)
    name = "transformer.h.0.attn.embed_positions"
    assert not torch.equal(ctor[name], dict(ref.named_buffers())[name])

    out = tmp_path / "out"
    _convert(src, out, 1)
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    report = reshard.load(model, str(out))
    assert name in report.buffers_restored
    _assert_equal_to(model, ref, f"{arch} {dtype}")
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(_bits(model(ids).logits), _bits(ref(ids).logits))


def test_buffers_of_a_model_not_built_by_empty_model(rotary_ckpts, tmp_path):
    """A model the user built without reshard.empty_model (from_config under the low
    precision dtype): reshard.load computes the buffers as from_pretrained does itself."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    src = rotary_ckpts[("gptj", "fp16")]
    out = tmp_path / "out"
    _convert(src, out, 1)
    config = transformers.AutoConfig.from_pretrained(str(out))
    with init_empty_weights(include_buffers=False):
        model = transformers.GPTJForCausalLM._from_config(config, dtype=torch.float16)
    model.to_empty(device="cpu")
    reshard.load(model, str(out))
    _assert_equal_to(model, AutoModelForCausalLM.from_pretrained(src), "gptj fp16 from_config")


def test_auto_dtype_without_config_dtype_follows_the_weights(tmp_path):
    """A .bin checkpoint whose config names no dtype (GPT-J fp16 as transformers < 5 wrote it):
    from_pretrained(dtype="auto") builds the model in the weights' dtype, and so does
    reshard.empty_model; buffers and parameters equal from_pretrained's."""
    from transformers import AutoModelForCausalLM

    src = make_bin_checkpoint(str(tmp_path / "gptj-bin"), "gptj", "fp16")
    assert json.load(open(os.path.join(src, "config.json"))).get("dtype") is None
    out = tmp_path / "out"
    _convert(src, out, 1)
    model = reshard.empty_model(str(out))
    assert next(model.parameters()).dtype == torch.float16
    model.to_empty(device="cpu")
    reshard.load(model, str(out))
    _assert_equal_to(model, AutoModelForCausalLM.from_pretrained(src), "gptj fp16 .bin")


@pytest.mark.parametrize("arch,dtype,world", [("gptj", "fp16", 2), ("codegen", "bf16", 3)])
def test_fsdp2_buffers_equal_from_pretrained(rotary_ckpts, tmp_path, arch, dtype, world):
    """FSDP2 over gloo: tests/python/fsdp_worker.py compares every parameter's full tensor,
    every buffer (dtype and bits) and the logits with from_pretrained on every rank."""
    src = rotary_ckpts[(arch, dtype)]
    out = tmp_path / "out"
    _convert(src, out, world)
    result = tmp_path / "result"
    result.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.path.join(REPO, "python"),
                                                                  os.environ.get("PYTHONPATH", "")] if p),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([TORCHRUN, "--nproc-per-node", str(world), "--standalone",
                           os.path.join(HERE, "fsdp_worker.py"), "--src", str(src), "--out", str(out),
                           "--result", str(result), "--steps", "0"],  # fp16 AdamW on random weights: NaN
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for r in range(world):
        rep = json.load(open(result / f"rank-{r}.json"))
        assert "transformer.h.0.attn.embed_positions" in rep["buffers_restored"], rep


def test_check_weights_on_a_zero_dim_bf16_buffer():
    """reshard.train's bit comparison handles 0-dim tensors of 2-byte dtypes (Gemma keeps a
    0-dim bf16 buffer)."""
    from reshard.check import bits

    a = torch.tensor(1.5, dtype=torch.bfloat16)
    assert torch.equal(bits(a), bits(a.clone()))
    assert not torch.equal(bits(a), bits(torch.tensor(-1.5, dtype=torch.bfloat16)))


# ---------------------------------------------------------------------------------------
# The seed's scenario: GPT-J fp16 pytorch_model.bin through both accelerate recipes as written
# ---------------------------------------------------------------------------------------

ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
RECIPE = os.path.join(REPO, "recipes", "accelerate")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.path.join(REPO, "python"),
                                                                  os.environ.get("PYTHONPATH", "")] if p),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)
    assert proc.returncode == 0, f"$ {' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="module", params=["gptj-fp16-bin", "pythia-bf16"])
def recipe_ckpt(request, tmp_path_factory):
    """The seed's scenario (GPT-J fp16 as a pytorch_model.bin) and a Pythia (GPT-NeoX in the
    hub layout, embed_out, which convert renames by transformers' conversion)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gptj-fp16-bin":
        src = make_bin_checkpoint(str(root / "gptj-fp16-bin"), "gptj", "fp16")
        # As the hub's GPT-J fp16 checkpoint has it: the config names the dtype, in the key
        # that transformers < 5 wrote.
        path = os.path.join(src, "config.json")
        config = json.load(open(path))
        config["torch_dtype"] = "float16"
        json.dump(config, open(path, "w"))
        rotary = "transformer.h.0.attn.embed_positions"
    else:
        src = make_checkpoint(str(root / "pythia"), "gpt_neox", "bf16", False)
        from safetensors import safe_open

        with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
            assert "embed_out.weight" in f.keys()  # the hub layout
        rotary = "gpt_neox.rotary_emb.inv_freq"
    out = str(root / "out")
    _convert(src, out, 2, capture=True)
    return request.param, src, out, rotary


@pytest.mark.parametrize("config", ["fsdp2.yaml", "fsdp1.yaml"])
def test_accelerate_recipes_gptj_fp16_bin_and_pythia(recipe_ckpt, tmp_path, config):
    """--check-weights compares every parameter and buffer with from_pretrained(SRC) (built in
    the checkpoint's dtype, as the model was), in the live dtypes; the recipe trains."""
    name, src, out, rotary = recipe_ckpt
    if config == "fsdp1.yaml":
        if name == "gptj-fp16-bin":  # the manifest captured by hand; Pythia's convert captures it
            _run([sys.executable, "-m", "reshard.manifest", src, "-o", os.path.join(out, "reshard-model.json")])
        _convert(src, out, 2, "--layout", "fsdp1", "--dtype", "fp32", capture=True)
    json_dir = tmp_path / "json"
    proc = _run([ACCELERATE, "launch", "--config_file", os.path.join(RECIPE, config),
                 "--num_processes", "2", "--main_process_port", _free_port(),
                 os.path.join(RECIPE, "train_accelerate.py"), out, "--steps", "4", "--seq-len", "32",
                 "--batch-size", "2", "--log-every", "2", "--check-weights", src, "--json-out", json_dir])
    assert "bit for bit" in proc.stdout, proc.stdout[-3000:]
    for r in range(2):
        rep = json.load(open(json_dir / f"rank-{r}.json"))
        assert rotary in rep["load"]["buffers_restored"], rep["load"]
        assert all(x == x for x in rep["losses"]), rep["losses"]  # no NaN


def test_trainer_param_dtype_checkpoint_gptj(rotary_ckpts, tmp_path):
    """reshard.train --param-dtype checkpoint builds the model in bf16; --check-weights
    compares parameters and buffers with from_pretrained."""
    src = rotary_ckpts[("gptj", "bf16")]
    out = tmp_path / "out"
    _convert(src, out, 2)
    proc = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", out,
                 "--param-dtype", "checkpoint", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                 "--check-weights", src])
    assert "bit for bit (live dtype torch.bfloat16)" in proc.stdout, proc.stdout[-3000:]
