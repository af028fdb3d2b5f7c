"""Tied parameters a checkpoint holds apart (python/reshard/ties.py). transformers'
from_pretrained unties a pair the config ties (tie_word_embeddings: lm_head.weight ->
model.embed_tokens.weight) when the checkpoint holds both names with different values, and ties
it when they are equal. reshard.empty_model(OUT) must build what from_pretrained builds, from
the Hugging Face files and from conversions at any world size (the rank files' headers, all of
them: here the two differ only in rows that the last rank of three holds), and the load must
then equal from_pretrained bit for bit; a model built tied otherwise is refused, not loaded
with one value in both."""

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import reshard
from reshard.ties import differing_tied_pairs

PAIR = [("lm_head.weight", "model.embed_tokens.weight")]


def _llama(path, tie):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _with_config_tied(src, dst, head=None):
    """dst: src's files with config tie_word_embeddings=True, lm_head.weight replaced by `head`
    (a function of the embedding) when given."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    if head is not None:
        sd = load_file(dst / "model.safetensors")
        sd["lm_head.weight"] = head(sd["model.embed_tokens.weight"]).contiguous()
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _as_bin(src, dst, one_storage=False):
    """dst: src's checkpoint as one torch .bin file (what torch.save of a state_dict writes:
    every name, a tie's two names pointing at one storage when `one_storage`)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    sd = load_file(src / "model.safetensors")
    if one_storage:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    torch.save(sd, dst / "pytorch_model.bin")
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory, reshard_bin):
    import subprocess

    root = tmp_path_factory.mktemp("ties")
    untied = _llama(root / "untied", tie=False)

    def last_rows_differ(e):  # the same but for the last 8 rows: only rank 2 of 3 sees it
        h = e.clone()
        h[-8:] += 1
        return h

    out = {
        "apart": _with_config_tied(untied, root / "apart", last_rows_differ),
        "equal": _with_config_tied(untied, root / "equal", lambda e: e.clone()),
        "tied": _llama(root / "tied", tie=True),  # save_pretrained writes one name of the tie
    }
    # The same as torch .bin files, which hold both names of a tie (torch.save): apart and equal as
    # two storages, tied as one storage under both names.
    out["apart-bin"] = _as_bin(out["apart"], root / "apart-bin")
    out["equal-bin"] = _as_bin(out["equal"], root / "equal-bin")
    out["tied-bin"] = _as_bin(out["tied"], root / "tied-bin", one_storage=True)
    for name in list(out):
        for ws in (1, 3):
            dst = root / f"{name}-ws{ws}"
            subprocess.run([reshard_bin, "convert", out[name], "-o", dst, "--world-size", str(ws)], check=True,
                           capture_output=True)
            out[f"{name}-ws{ws}"] = dst
        # An FSDP1 layout alone: no FSDP2 headers to decide from, the captured model manifest does.
        dst = root / f"{name}-fsdp1"
        subprocess.run([reshard_bin, "convert", out[name], "-o", dst, "--world-size", "2", "--layout", "fsdp1"],
                       check=True, capture_output=True, env=dict(os.environ, RESHARD_MODEL_CAPTURE="1"))
        out[f"{name}-fsdp1"] = dst
    return out


def _ref(src):
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)


def _is_tied(m):
    return m.lm_head.weight is m.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["apart", "equal", "tied", "apart-bin", "equal-bin", "tied-bin"])
def test_empty_model_ties_as_from_pretrained_and_load_equals_it(sources, name):
    ref = _ref(sources[name])
    want_tied = not name.startswith("apart")
    assert _is_tied(ref) == want_tied  # transformers itself: the independent reference
    rsd = ref.state_dict()
    for form in ("", "-ws1", "-ws3", "-fsdp1"):
        out = str(sources[name + form])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model = reshard.empty_model(out)
        assert _is_tied(model) == want_tied, (out, model.all_tied_weights_keys)
        assert any("different values" in str(x.message) for x in w) == (not want_tied), [str(x.message) for x in w]
        assert differing_tied_pairs(out, PAIR) == ([] if want_tied else PAIR), out
        if form in ("-ws3", "-fsdp1"):
            continue  # decided above (headers; the model manifest); their loads need a job of 3 / FSDP1
        model.to_empty(device="cpu")
        reshard.load(model, out)
        assert _is_tied(model) == want_tied
        sd = model.state_dict()
        assert sd.keys() == rsd.keys()
        for k in rsd:
            assert torch.equal(sd[k].view(-1).view(torch.uint8), rsd[k].view(-1).view(torch.uint8)), (out, k)


def test_a_model_built_tied_is_refused_for_a_checkpoint_holding_the_pair_apart(sources):
    cfg = transformers.AutoConfig.from_pretrained(sources["apart"])
    for out in (sources["apart-ws1"], sources["apart"], sources["apart-bin"], sources["apart-bin-ws1"]):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        assert _is_tied(model)
        with pytest.raises(reshard.LayoutMismatchError, match="lm_head.weight and model.embed_tokens.weight with "
                                                              "different values"):
            reshard.load(model, str(out))
    # Another model altogether (tied, other shapes): the load's own refusal, not the tie's.
    other = transformers.AutoConfig.from_pretrained(sources["apart"])
    other.hidden_size, other.intermediate_size = 32, 64
    model = transformers.AutoModelForCausalLM.from_config(other, dtype=torch.bfloat16)
    for out in (sources["apart-ws1"], sources["apart"]):
        with pytest.raises(reshard.LayoutMismatchError, match="global shape") as e:
            reshard.load(model, str(out))
        assert "different values" not in str(e.value), e.value
    # Equal values: tied, as from_pretrained ties them, and loaded.
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(sources["equal"]),
                                                          dtype=torch.bfloat16)
    reshard.load(model, str(sources["equal-ws1"]))
    assert _is_tied(model)
