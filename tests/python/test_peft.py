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
  adapter for other target modules or another rank, an adapter directory without safetensors;
* `reshard export --merge` (reshard.merge): from_pretrained of the merged export equals
  merge_and_unload() of PEFT's unsharded model with the trained adapters, every tensor bit for
  bit (Llama bf16 + fp32 adapters at world size 2, Qwen2 fp32 tied at 3); the arithmetic against
  PEFT's for bf16/fp16 bases, bf16 adapters, fan_in_fan_out, embeddings, rank/alpha patterns;
  reshard.save(..., base=True) loads, exports and merges from OUT alone; refusals (not an
  adapter save, another model as the base, no base recorded, output inside the source, no
  Python).
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
    r = cli("export", saved, "-o", tmp_path / "plain", rc=3)  # not a model: says what to run
    assert "--adapter" in r.err
    exported = tmp_path / "exported"
    r = cli("export", saved, "-o", exported, "--adapter", rc=0)
    assert r.out.startswith("wrote adapter_model.safetensors of layout"), r.out  # the file it wrote
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


# --- merged export (reshard export --merge) and saves holding the base -----------------------


def _bits(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _merged_reference(src, dump, r, alpha, targets):
    """merge_and_unload() of PEFT's own unsharded model with the trained adapters (the worker's
    dump, full tensors by live names): the independent reference."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trained = load_file(str(dump))
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(src, dtype="auto"),
                         LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights="gaussian"))
    params = dict(ref.named_parameters())
    assert set(trained) <= set(params), sorted(set(trained) - set(params))[:4]
    with torch.no_grad():
        for n, t in trained.items():
            assert params[n].dtype == t.dtype, (n, params[n].dtype, t.dtype)
            params[n].copy_(t)
    return ref.merge_and_unload().state_dict()


def _assert_merged(hf_dir, want, src):
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto").state_dict()
    base = AutoModelForCausalLM.from_pretrained(src, dtype="auto").state_dict()
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:6]
    changed = 0
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (k, got[k].dtype, want[k].dtype)
        assert torch.equal(_bits(got[k]), _bits(want[k])), \
            f"{k}: differs from merge_and_unload() (max abs {(got[k].float() - want[k].float()).abs().max()})"
        changed += not torch.equal(_bits(got[k]), _bits(base[k]))
    assert changed == 4, changed  # 2 layers x (q_proj, v_proj): the merge changed exactly those


def test_merge_export_equals_merge_and_unload(checkpoint, cli, tmp_path):
    """Llama, bf16 base with fp32 adapters (the in-place add rounds once), trained at world
    size 2 -> reshard.save (adapters only; the save records the base) -> `reshard export
    --merge` into several safetensors files -> from_pretrained equals merge_and_unload() of
    PEFT's unsharded model with the same trained adapters, every tensor bit for bit. lora_alpha
    5 / r 3: a scaling that is no power of two. (World size 3, Qwen2 fp32 with tied embeddings:
    test_save_with_base_is_self_contained.)"""
    src, out = _converted(checkpoint, cli, tmp_path, "llama", "bf16", True, 2)
    saved, dump = tmp_path / "saved", tmp_path / "trained.safetensors"
    _run(2, src, out, tmp_path, "--save", saved, "--dump", dump, "--lora-rank", "3", "--alpha", "5", "--more", "0")
    record = json.load(open(saved / "reshard-adapter.json"))
    assert record["base"]["stored"] is False and record["base"]["out"] == str(out), record["base"]
    want = _merged_reference(src, dump, 3, 5, ["q_proj", "v_proj"])
    merged = tmp_path / "merged"
    r = cli("export", saved, "-o", merged, "--merge", "--max-shard-size", "20KB", rc=0)
    assert "4 LoRA target(s)" in r.out and str(out) in r.out, r.out
    assert (merged / "model.safetensors.index.json").exists()  # sharded: several files merged into
    assert "adapter_config.json" not in os.listdir(merged)
    _assert_merged(merged, want, src)


def test_save_with_base_is_self_contained(checkpoint, cli, tmp_path):
    """reshard.save(..., base=True) of Qwen2 (fp32, tied embeddings) at world size 3 (rank 3
    over 3 ranks): a new job builds and loads from OUT alone (every parameter equals the
    trained model's); `export OUT` is the base (the source checkpoint's tensors, bit for bit),
    `--adapter` the adapters, and `--merge`, with no --base, equals merge_and_unload() of
    PEFT's unsharded model with the trained adapters bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src, out = _converted(checkpoint, cli, tmp_path, "qwen2", "fp32", False, 3)
    saved, dump, dump_all = tmp_path / "saved", tmp_path / "trained.safetensors", tmp_path / "all.safetensors"
    _run(3, src, out, tmp_path, "--save", saved, "--save-base", "--dump", dump, "--dump-all", dump_all,
         "--more", "0", "--lora-rank", "3", "--alpha", "5")
    assert json.load(open(saved / "reshard-adapter.json"))["base"]["stored"] is True
    cli("verify", saved, rc=0)

    adapter = tmp_path / "adapter"
    cli("export", saved, "-o", adapter, "--adapter", rc=0)
    exported = load_file(str(adapter / "adapter_model.safetensors"))
    trained = load_file(str(dump))
    assert sorted(exported) == sorted(k.replace(".default.", ".") for k in trained)

    # A new job from OUT alone: every parameter as trained (the dump), and as PEFT loads the
    # base with the exported adapters (the worker's reference).
    again = tmp_path / "again"
    again.mkdir()
    torchrun(3, WORKER, "--src", src, "--out", saved, "--result", again, "--expect", dump_all,
             "--ref-adapter", adapter, "--lora-rank", "3", "--alpha", "5", timeout=400)
    assert json.load(open(again / "rank-0.json"))["adapters"]["source"] == str(saved)

    plain = tmp_path / "plain"
    cli("export", saved, "-o", plain, rc=0)
    assert "adapter_config.json" not in os.listdir(plain) and "reshard-adapter.json" not in os.listdir(plain)
    got = AutoModelForCausalLM.from_pretrained(str(plain), dtype="auto").state_dict()
    base = AutoModelForCausalLM.from_pretrained(src, dtype="auto").state_dict()
    assert got.keys() == base.keys()
    for k in base:
        assert torch.equal(_bits(got[k]), _bits(base[k])), f"{k}: the exported base differs from the source"

    merged = tmp_path / "merged"
    r = cli("export", saved, "-o", merged, "--merge", rc=0)
    assert "the save itself" in r.out, r.out
    _assert_merged(merged, _merged_reference(src, dump, 3, 5, ["q_proj", "v_proj"]), src)


@pytest.fixture
def saved_ws1(ws1, tmp_path):
    """An adapter save at world size 1 (one process): adapters changed as by training."""
    import reshard

    src, out = ws1
    torch.manual_seed(3)
    model = reshard.empty_model(out, peft_config=_lora(init_lora_weights="gaussian"))
    model.to_empty(device="cpu")
    reshard.load(model, out)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.1)
    saved = tmp_path / "saved"
    reshard.save(model, saved)
    return src, out, saved


def test_merge_refusals(checkpoint, cli, saved_ws1, tmp_path, capsys):
    """Through the CLI (exit status passed on) and, to spare a Python start each, reshard.merge's
    main in this process: --merge of a conversion, an output inside the source, another model
    as the base (by the source the save records, then by shapes), no base recorded."""
    from reshard.merge import main as merge_main

    src, out, saved = saved_ws1

    def merge(*args):
        capsys.readouterr()
        rc = merge_main([str(a) for a in args])
        return rc, capsys.readouterr().err

    # --merge of a save that is not an adapter save (a conversion)
    r = cli("export", out, "-o", tmp_path / "m1", "--merge", rc=2)
    assert "lists no adapter_config.json" in r.err and str(out) in r.err, r.err
    # no Python to run the merge in: says what to install, or which variable to set
    r = cli("export", saved, "-o", tmp_path / "m0", "--merge", env={"RESHARD_PYTHON": str(tmp_path / "no-python")},
            rc=3)
    assert "was not found" in r.err and "RESHARD_PYTHON" in r.err and "torch" in r.err, r.err
    # the output inside the source
    rc, err = merge(saved, "-o", saved / "merged")
    assert rc == 2 and "must lie outside" in err, err
    # another model as the base: refused by the source the save records, naming both paths
    other = tmp_path / "other"
    cli("convert", checkpoint("qwen2", "fp32", False), "-o", other, "--world-size", 1, rc=0)
    r = cli("export", saved, "-o", tmp_path / "m2", "--merge", "--base", other, rc=3)
    assert "is not the base the adapters" in r.err and str(other) in r.err and str(saved) in r.err, r.err
    # a save that records no base: --base is needed; then another model's shapes are refused
    rec_path = saved / "reshard-adapter.json"
    rec = json.load(open(rec_path))
    rec["base"] = {"stored": False, "out": None, "layout": None, "source": None}
    json.dump(rec, open(rec_path, "w"))
    rc, err = merge(saved, "-o", tmp_path / "m3")
    assert rc == 2 and "pass --base OUT" in err, err
    rc, err = merge(saved, "-o", tmp_path / "m4", "--base", other)
    assert rc == 3 and "another model" in err and str(other) in err and str(saved) in err, err
    left = [n for n in os.listdir(tmp_path) if n.startswith(("m", ".m"))]
    assert left == [], f"refused merges left {left}"
    rc, err = merge(saved, "-o", tmp_path / "m5", "--base", out)  # the right base
    assert rc == 0 and os.path.exists(tmp_path / "m5" / "model.safetensors"), err
    # reshard.load from an adapter save without its base says how to load it
    import reshard

    model = reshard.empty_model(saved, peft_config=_lora())
    model.to_empty(device="cpu")
    with pytest.raises(reshard.InvalidArgumentError, match=r"without its base .*adapter="):
        reshard.load(model, saved)


@pytest.mark.parametrize("base_dtype,autocast,fan_in_fan_out", [
    (torch.float32, True, False), (torch.bfloat16, True, False), (torch.bfloat16, False, False),
    (torch.float16, True, True), (torch.bfloat16, False, True)])
def test_merge_arithmetic_is_peft_s(base_dtype, autocast, fan_in_fan_out):
    """reshard.merge's delta and in-place add, on full tensors, against PEFT's own
    merge_and_unload() of Linear (or GPT-2's Conv1D: fan_in_fan_out) and Embedding targets:
    bf16/fp16 bases with fp32 adapters (autocast_adapter_dtype) and bf16 adapters (cast to fp32
    on the CPU by PEFT), an alpha / r that is no power of two, rank_pattern / alpha_pattern."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from reshard.merge import _scaling, delta_weight, merge_into

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = Conv1D(53, 37) if fan_in_fan_out else torch.nn.Linear(37, 53, bias=False)
            self.lin2 = torch.nn.Linear(37, 41, bias=False) if not fan_in_fan_out else Conv1D(41, 37)
            self.emb = torch.nn.Embedding(61, 29)

    torch.manual_seed(5)
    model = M().to(base_dtype)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LoraConfig(r=5, lora_alpha=7, target_modules=["lin", "lin2", "emb"], init_lora_weights="gaussian",
                     fan_in_fan_out=fan_in_fan_out, rank_pattern={"lin2": 3}, alpha_pattern={"lin2": 11})
    peft_model = get_peft_model(model, cfg, autocast_adapter_dtype=autocast)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p))
    params = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    want = peft_model.merge_and_unload().state_dict()
    pre = "base_model.model."
    for mod, kind, a, b, scaling in [("lin", "linear", "lora_A.default.weight", "lora_B.default.weight", 7 / 5),
                                     ("lin2", "linear", "lora_A.default.weight", "lora_B.default.weight", 11 / 3),
                                     ("emb", "embedding", "lora_embedding_A.default", "lora_embedding_B.default",
                                      7 / 5)]:
        w = base[f"{mod}.weight"].clone()
        A, B = params[f"{pre}{mod}.{a}"], params[f"{pre}{mod}.{b}"]
        assert A.dtype == (torch.float32 if autocast else base_dtype)
        saved_cfg = json.loads(json.dumps(cfg.to_dict(), default=sorted))  # as adapter_config.json
        assert _scaling(saved_cfg, mod, A.shape[0], "adapter_config.json") == scaling
        merge_into(w, kind, delta_weight(kind, A, B, scaling, fan_in_fan_out))
        assert w.dtype == want[f"{mod}.weight"].dtype
        assert torch.equal(_bits(w), _bits(want[f"{mod}.weight"])), f"{mod}: differs from PEFT's merge"
        assert not torch.equal(_bits(w), _bits(base[f"{mod}.weight"]))
