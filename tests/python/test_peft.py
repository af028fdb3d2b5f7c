"""LoRA (PEFT) fine-tuning under FSDP2 with the base weights from rank files.

* reshard.empty_model(OUT, peft_config=...) -> fully_shard -> to_empty -> reshard.load at world
  sizes 1, 2, 3 (Llama bf16 with fp32 adapters, rank-4 adapters over 3 ranks give an empty
  shard; Qwen2 fp32 with tied embeddings): every parameter equals an independent reference
  built by PEFT itself on an unsharded model (get_peft_model(from_pretrained(SRC)) under the
  same seed), buffers and logits bit for bit, 10 steps lower the loss and change only the
  adapters (tests/python/peft_worker.py);
* a saved adapter directory loads as PeftModel.from_pretrained loads it (Linear and Embedding
  targets);
* refusals, by name: PEFT methods other than LoRA, initialisations that read the base weights,
  a PEFT model wrapped without reshard (its initialisation lost with the meta device), an
  adapter for other target modules or another rank, an adapter directory without safetensors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_util import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "peft_worker.py")

peft = pytest.importorskip("peft", reason="peft is a pinned test dependency (scripts/setup.sh)")


def _converted(checkpoint, cli, tmp_path, arch, dtype, sharded, ws):
    src = checkpoint(arch, dtype, sharded)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", ws, rc=0)
    return src, out


def _run(ws, src, out, tmp_path, *extra):
    result = tmp_path / "result"
    result.mkdir(exist_ok=True)
    torchrun(ws, WORKER, "--src", src, "--out", out, "--result", result, *extra, timeout=400)
    reports = [json.load(open(result / f"rank-{r}.json")) for r in range(ws)]
    assert all(r["losses"][-1] < r["losses"][0] for r in reports)
    return reports


@pytest.mark.parametrize("arch,dtype,sharded,ws,init", [
    ("llama", "bf16", True, 1, "gaussian"),
    ("llama", "bf16", True, 2, "true"),
    ("llama", "bf16", True, 3, "gaussian"),
    ("qwen2", "fp32", False, 2, "gaussian"),
    ("qwen2", "fp32", False, 3, "true"),
])
def test_lora_adapters_initialised_as_peft_does_base_from_rank_files(checkpoint, cli, tmp_path, arch, dtype,
                                                                       sharded, ws, init):
    src, out = _converted(checkpoint, cli, tmp_path, arch, dtype, sharded, ws)
    reports = _run(ws, src, out, tmp_path, "--init", init)
    assert reports[0]["adapters"]["source"].startswith("initialised as PEFT")
    assert reports[0]["adapters"]["tensors"] == 8  # 2 layers x (q_proj, v_proj) x (A, B)


def _save_adapter(src, path, seed, **cfg):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(src, dtype="auto"),
                           LoraConfig(lora_alpha=8, init_lora_weights="gaussian", **cfg))
    with torch.no_grad():  # not PEFT's initial values: a trained adapter's
        for n, p in model.named_parameters():
            # An embedding target: PEFT saves the base embedding too (save_embedding_layers),
            # and from_pretrained takes it; changed here, so that not taking it shows.
            if "lora_" in n or "embed_tokens.base_layer" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("arch,dtype,sharded,ws,targets", [
    ("llama", "bf16", True, 2, "q_proj,v_proj,embed_tokens"),
    ("qwen2", "fp32", False, 3, "q_proj,v_proj"),
])
def test_saved_adapter_loads_as_peft_model_from_pretrained(checkpoint, cli, tmp_path, arch, dtype, sharded, ws,
                                                           targets):
    src, out = _converted(checkpoint, cli, tmp_path, arch, dtype, sharded, ws)
    adapter = _save_adapter(src, tmp_path / "adapter", 11, r=4, target_modules=targets.split(","))
    reports = _run(ws, src, out, tmp_path, "--adapter", adapter, "--targets", targets)
    assert reports[0]["adapters"]["source"] == str(adapter)
    if "embed_tokens" in targets:
        assert reports[0]["adapters"]["base_tensors_from_adapter"] == [
            "base_model.model.model.embed_tokens.base_layer.weight"]
        assert reports[0]["adapters"]["tensors"] == 10  # + lora_embedding_A / _B


def test_save_export_adapter_and_resume(checkpoint, cli, tmp_path):
    """10 steps at world size 3 -> reshard.save (adapters + optimizer) -> 3 more steps.
    `reshard export --adapter` gives a PEFT directory whose tensors are the trained adapters
    bit for bit; a new job loads the base from OUT and the adapters from the save (checked
    against PeftModel.from_pretrained of the export), restores the optimizer and continues with
    the uninterrupted run's losses exactly (same world size, CPU: deterministic)."""
    from safetensors.torch import load_file

    src, out = _converted(checkpoint, cli, tmp_path, "qwen2", "fp32", False, 3)
    saved, dump = tmp_path / "saved", tmp_path / "trained.safetensors"
    first = _run(3, src, out, tmp_path, "--save", saved, "--dump", dump)
    names = sorted(os.listdir(saved))
    assert "adapter_config.json" in names and "reshard.json" in names, names
    r = cli("verify", saved, rc=0)
    assert "OK" in r.out
    r = cli("export", saved, "-o", tmp_path / "plain", rc=2)  # not a model: says what to run
    assert "--adapter" in r.err
    exported = tmp_path / "exported"
    cli("export", saved, "-o", exported, "--adapter", rc=0)
    assert sorted(os.listdir(exported)) == ["adapter_config.json", "adapter_model.safetensors"]
    trained = load_file(str(dump))
    got = load_file(str(exported / "adapter_model.safetensors"))
    assert len(got) == len(trained) == 8
    for live_name, t in trained.items():
        key = live_name.replace(".default.", ".")
        assert torch.equal(got[key], t), f"{key}: exported adapter differs from the trained one"
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    torchrun(3, WORKER, "--src", src, "--out", out, "--result", resumed_dir, "--adapter", saved,
             "--ref-adapter", exported, "--resume", timeout=400)
    for rank in range(3):
        again = json.load(open(resumed_dir / f"rank-{rank}.json"))
        assert again["adapters"]["source"] == str(saved)
        assert again["losses"] == first[rank]["more"], (again["losses"], first[rank]["more"])


# --- refusals (one process, world size 1) ---------------------------------------------------


@pytest.fixture
def ws1(checkpoint, cli, tmp_path):
    return _converted(checkpoint, cli, tmp_path, "llama", "bf16", False, 1)


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **kw})


def test_other_peft_methods_are_refused_by_name(ws1):
    import reshard
    from peft import IA3Config, get_peft_model

    _, out = ws1
    with pytest.raises(reshard.UnsupportedError, match="IA3Config: reshard supports LoRA"):
        reshard.empty_model(out, peft_config=IA3Config(target_modules=["k_proj", "v_proj"],
                                                       feedforward_modules=[]))
    model = get_peft_model(reshard.empty_model(out), IA3Config(target_modules=["k_proj", "v_proj"],
                                                               feedforward_modules=[]))
    model.to_empty(device="cpu")
    with pytest.raises(reshard.UnsupportedError, match=r"k_proj: PEFT layer peft\.tuners\.ia3.*supports LoRA"):
        reshard.load(model, out)


@pytest.mark.parametrize("kw,what", [({"use_dora": True}, "use_dora=True"),
                                     ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
                                     ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_initialisations_from_the_base_weights_are_refused_with_the_way_out(ws1, kw, what):
    import reshard

    _, out = ws1
    with pytest.raises(reshard.UnsupportedError, match=what.replace("(", r"\(")) as e:
        reshard.empty_model(out, peft_config=_lora(**kw))
    assert "adapter=DIR" in str(e.value) or "requires_grad" in str(e.value)


def test_a_peft_model_wrapped_without_reshard_is_refused_not_left_garbage(ws1):
    import reshard
    from peft import get_peft_model

    _, out = ws1
    model = get_peft_model(reshard.empty_model(out), _lora())
    model.to_empty(device="cpu")
    with pytest.raises(reshard.InvalidArgumentError, match=r"8 adapter parameter.*reshard\.empty_model\(OUT, "
                                                         r"peft_config=config\)"):
        reshard.load(model, out)


def test_an_adapter_for_other_targets_or_rank_is_refused(ws1, tmp_path):
    import reshard

    src, out = ws1
    other_targets = _save_adapter(src, tmp_path / "a1", 1, r=4, target_modules=["k_proj"])
    other_rank = _save_adapter(src, tmp_path / "a2", 1, r=8, target_modules=["q_proj", "v_proj"])
    for adapter, want in [(other_targets, r"has no tensor .*q_proj\.lora_A\.weight.*targets \['k_proj'\]"),
                          (other_rank, r"has shape \[8, 48\], the model's .* has \[4, 48\].*r=8")]:
        model = reshard.empty_model(out, peft_config=_lora())
        model.to_empty(device="cpu")
        with pytest.raises(reshard.LayoutMismatchError, match=want):
            reshard.load(model, out, adapter=str(adapter))
    os.remove(other_rank / "adapter_model.safetensors")
    model = reshard.empty_model(out, peft_config=_lora())
    model.to_empty(device="cpu")
    with pytest.raises(reshard.NotFoundError, match="adapter_model.safetensors: missing"):
        reshard.load(model, out, adapter=str(other_rank))
    plain = reshard.empty_model(out)
    plain.to_empty(device="cpu")
    with pytest.raises(reshard.InvalidArgumentError, match="no PEFT layers"):
        reshard.load(plain, out, adapter=str(other_targets))
