"""Checkpoints in transformers' hub layout, whose names and shapes differ from the model's:
convert applies transformers' own conversion (captured by python -m reshard.model_manifest,
which `reshard convert` runs itself), so the rank files hold the live model's tensors.

* Mixtral (per-expert w1/w2/w3 in three safetensors files -> experts.gate_up_proj/down_proj),
  Qwen3-MoE, DeepSeek-V3 (+ its persistent e_score_correction_bias, whole on every rank and
  fp32 as from_pretrained keeps it) and GPT-NeoX (embed_out -> lm_head): convert -> FSDP2 load
  at world sizes 2 and 3, every parameter, buffer and the logits equal to from_pretrained
  (fsdp_worker.py) -> 5 training steps -> reshard.save -> reshard export -> from_pretrained of
  the export equals the trained model, every state_dict entry bit for bit;
* `reshard verify --source` passes on the converted layout and finds a changed expert byte;
* the capture's plan against transformers' own loader, tensor by tensor (independent of the
  core: from_pretrained of the same checkpoint);
* the refusal without the conversion names the real cause;
* the capture refuses an op it cannot express, by name, and convert refuses with it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from dist_util import torchrun as _torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = {"RESHARD_MODEL_CAPTURE": "1", "RESHARD_PYTHON": sys.executable}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _from_pretrained(src):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.from_pretrained(src)
    cls = getattr(transformers, cfg.architectures[0])
    return cls.from_pretrained(src, dtype="auto")


@pytest.mark.parametrize("arch,sharded", [("mixtral", True), ("qwen3_moe", False), ("deepseek_v3", False),
                                          ("gpt_neox", False)])
def test_hub_layout_converts_loads_trains_saves_and_exports_exactly(arch, sharded, checkpoint, cli, tmp_path):
    from safetensors.torch import load_file

    src = checkpoint(arch, "bf16", sharded)
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 2, rc=0, env=CAPTURE)
    assert "capturing the model manifest" in r.err
    assert not [n for n in os.listdir(out) if "capture" in n], os.listdir(out)  # its temporary is gone
    conversion = json.load(open(out / "reshard-model.json"))["conversion"]
    assert conversion["targets"] and not conversion["refused"]
    cli("convert", src, "-o", out, "--world-size", 3, rc=0, env=CAPTURE)  # finds OUT's manifest
    r = cli("verify", out, "--source", src, rc=0)
    assert "OK" in r.out
    for ws in (2, 3):
        os.makedirs(tmp_path / f"r{ws}")
        _torchrun(ws, os.path.join(HERE, "fsdp_worker.py"), "--src", src, "--out", out,
                  "--result", tmp_path / f"r{ws}", "--steps", 0)
    # 5 steps at world size 3, save, export, from_pretrained of the export.
    saved, dump = tmp_path / "saved", tmp_path / "trained.safetensors"
    os.makedirs(tmp_path / "rs", exist_ok=True)
    _torchrun(3, os.path.join(HERE, "save_worker.py"), "--out", out, "--save", saved, "--result",
              tmp_path / "rs", "--steps", 5, "--dump", dump)
    exported = tmp_path / "exported"
    cli("export", saved, "-o", exported, rc=0)
    trained = load_file(str(dump))
    model = _from_pretrained(str(exported))
    sd = model.state_dict()
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    assert set(sd) - tied <= set(trained), sorted(set(sd) - set(trained))
    for name, v in sd.items():
        want = trained[name]
        assert v.dtype == want.dtype and v.shape == want.shape, (name, v.dtype, want.dtype, v.shape, want.shape)
        assert torch.equal(_bits(v), _bits(want)), f"{name}: from_pretrained(export) differs from the trained model"
    steps = [json.load(open(tmp_path / "rs" / f"rank-{r}.json"))["losses"] for r in range(3)]
    assert steps[0][-1] < steps[0][0], steps[0]
    # --hub-names: the checkpoint's own layout again (per-expert keys, embed_out), which
    # from_pretrained converts back into the same trained model.
    hub = tmp_path / "exported-hub"
    r = cli("export", saved, "-o", hub, "--hub-names", "--json", rc=0)
    assert json.loads(r.out)["hub_names"] is True
    hub_keys = set()
    for f in os.listdir(hub):
        if f.endswith(".safetensors"):
            hub_keys |= set(load_file(str(hub / f)))
    source_keys = set()
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            source_keys |= set(load_file(os.path.join(src, f)))
    assert hub_keys == source_keys, sorted(hub_keys ^ source_keys)[:8]
    again = _from_pretrained(str(hub)).state_dict()
    assert set(again) == set(sd)
    for name, v in again.items():
        assert torch.equal(_bits(v), _bits(sd[name])), f"{name}: from_pretrained(export --hub-names) differs"


@pytest.mark.parametrize("arch,sharded,ws", [("mixtral", True, 3), ("deepseek_v3", False, 2), ("gpt_neox", False, 3)])
def test_export_hub_names_gives_back_the_source_tensors_byte_for_byte(arch, sharded, ws, checkpoint, cli, tmp_path):
    """convert applies transformers' conversion; export --hub-names inverts it: the same keys,
    dtypes, shapes and bytes as the checkpoint convert read."""
    from safetensors import safe_open

    src = checkpoint(arch, "bf16", sharded)
    out, hub = tmp_path / "out", tmp_path / "hub"
    cli("convert", src, "-o", out, "--world-size", ws, rc=0, env=CAPTURE)
    cli("export", out, "-o", hub, "--hub-names", "--max-shard-size", "40kB", rc=0)

    def tensors(d):
        got = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as h:
                    for k in h.keys():
                        got[k] = h.get_tensor(k)
        return got

    want, got = tensors(src), tensors(hub)
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:8]
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), f"{k}: export --hub-names differs from the source"
    # Without the conversion there is nothing to invert: the model's names, said so.
    plain = tmp_path / "plain"
    r = cli("export", out, "-o", plain, "--json", rc=0)
    assert json.loads(r.out)["hub_names"] is False
    assert set(tensors(plain)) != set(want)
    # Each export converts again as it is: the model manifest goes with its conversion to the
    # checkpoint's names (which it fits), without it to the model's (a convert of that export
    # applied it to tensors it does not fit, and refused); its modules and parameters stay.
    with_conv, without = (json.loads((d / "reshard-model.json").read_text()) for d in (hub, plain))
    assert with_conv["conversion"]["targets"] and "conversion" not in without, sorted(without)
    assert without["params"] == with_conv["params"] and without["modules"] == with_conv["modules"]
    for d in (hub, plain):
        cli("convert", d, "-o", tmp_path / f"{d.name}-again", "--world-size", ws, rc=0)
        cli("verify", tmp_path / f"{d.name}-again", "--source", d, rc=0)


def test_export_hub_names_without_a_model_manifest_says_why(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", False)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, "--no-capture", rc=0)
    r = cli("export", out, "-o", tmp_path / "hub", "--hub-names")
    assert r.rc != 0 and "reshard-model.json" in r.text and "--hub-names" in r.text, r
    assert not os.path.exists(tmp_path / "hub")


def test_the_plan_equals_transformers_loader_tensor_by_tensor(checkpoint, tmp_path):
    """The conversion, evaluated in Python from the checkpoint's own tensors, gives exactly
    from_pretrained's parameters (checks the capture independently of the C++ executor)."""
    from safetensors import safe_open

    import reshard._C as C
    from reshard.conversion import capture_conversion
    from reshard.model_manifest import build_meta_model

    src = checkpoint("mixtral", "bf16", True)
    files = [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith(".safetensors")]
    raw = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                raw[k] = h.get_tensor(k)

    def evaluate(x):
        if x["op"] == "key":
            return raw[x["key"]]
        parts = [evaluate(c) for c in x["of"]]
        if x["op"] == "stack":
            return torch.stack(parts, x["dim"])
        if x["op"] == "cat":
            return torch.cat(parts, x["dim"])
        return parts[0].narrow(x["dim"], x["start"], x["stop"] - x["start"])

    plan = capture_conversion(build_meta_model(src), C.checkpoint_tensors(src))
    assert {t["name"] for t in plan["targets"]} >= {"model.layers.0.mlp.experts.gate_up_proj",
                                                   "model.layers.1.mlp.experts.down_proj",
                                                   "model.layers.0.mlp.gate.weight"}
    ref = _from_pretrained(src).state_dict()
    for t in plan["targets"]:
        got = evaluate(t["expr"])
        assert list(got.shape) == t["shape"] == list(ref[t["name"]].shape), t["name"]
        assert torch.equal(_bits(got), _bits(ref[t["name"]].to(got.dtype))), t["name"]


def test_verify_finds_a_changed_expert_byte(checkpoint, cli, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(checkpoint("mixtral", "bf16", False), src)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 3, rc=0, env=CAPTURE)
    key = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    f = str(src / "model.safetensors")
    tensors = load_file(f)
    tensors[key] = tensors[key].clone()
    tensors[key][3, 5] += 1
    save_file(tensors, f, metadata={"format": "pt"})
    r = cli("verify", out, "--source", src)
    assert r.rc == 1, r
    assert "model.layers.1.mlp.experts.gate_up_proj" in r.text and key in r.text, r


def test_without_the_conversion_the_load_names_the_real_cause(checkpoint, cli, tmp_path):
    import reshard

    src = checkpoint("gpt_neox", "bf16", False)
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 1, "--no-capture", rc=0, env=CAPTURE)
    assert "capturing" not in r.err
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    with pytest.raises(reshard.LayoutMismatchError) as e:
        reshard.load(model, str(out))
    msg = str(e.value)
    assert "hub names for GPTNeoXForCausalLM" in msg and "embed_out.weight" in msg and "lm_head.weight" in msg
    assert "reshard convert" in msg and "another model" not in msg


def test_an_op_the_plan_cannot_express_is_refused_by_name(checkpoint, cli, tmp_path):
    """A conversion with a Transpose (as qwen3_vl_moe's): refused at capture, then by convert."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    import reshard._C as C
    from reshard.conversion import capture_conversion
    from reshard.model_manifest import build_meta_model, model_manifest, write_manifest

    src = checkpoint("llama", "bf16", False)
    register_checkpoint_conversion_mapping(
        "llama", [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", [Transpose(0, 1)])],
        overwrite=True)
    try:
        model = build_meta_model(src)
        plan = capture_conversion(model, C.checkpoint_tensors(src))
        manifest = model_manifest(model, checkpoint=src)
    finally:
        register_checkpoint_conversion_mapping("llama", [], overwrite=True)
    assert plan["refused"] and all("Transpose" in why for why in plan["refused"]), plan["refused"]
    path = tmp_path / "reshard-model.json"
    write_manifest(manifest, str(path))
    r = cli("convert", src, "-o", tmp_path / "out", "--world-size", 2, "--model-manifest", path, rc=3)
    assert "Transpose" in r.err and "cannot be converted" in r.err, r


def test_fsdp1_in_one_command_captures_the_manifest_itself(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", False)
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--world-size", 2, "--layout", "fsdp1", rc=0, env=CAPTURE)
    assert "capturing the model manifest" in r.err
    manifest = json.load(open(out / "reshard-model.json"))
    assert manifest["model_class"] == "LlamaForCausalLM" and manifest["format_version"] == 2
    cli("verify", out, "--source", src, rc=0)
    # Without a Python that has reshard: the note, then FSDP1's own refusal naming the command.
    r = cli("convert", src, "-o", tmp_path / "out2", "--world-size", 2, "--layout", "fsdp1", rc=3,
            env={"RESHARD_MODEL_CAPTURE": "1", "RESHARD_PYTHON": str(tmp_path / "no-such-python")})
    assert "could not capture them" in r.err and "python -m reshard.model_manifest" in r.err, r
