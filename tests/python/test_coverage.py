"""The coverage matrix (scripts/coverage/matrix.py) on a fixed sample of architectures, in CI.

Each sample architecture is built as a tiny model from its config class's defaults, written with
save_pretrained, converted with the CLI for FSDP2 at world sizes 2 and 3 and FSDP1 at 2, and
loaded in one torchrun job per world size (gloo, CPU); every parameter, buffer and the logits
are compared bit for bit with from_pretrained (scripts/coverage/worker.py). The whole matrix is
scripts/coverage/matrix.py's job, its output docs/coverage.md.

What is asserted:
* no case of the sample is a silent mismatch (a load that succeeded but differs) or a crash;
  a refusal carries reshard's message;
* the architectures that pass today (PASS_TODAY, one per mechanism) pass every case, and
  reshard's own check_weights agrees: a regression fails here; the others (REFUSED_TODAY, refused
  by reshard or by FSDP itself, with the reason given) may start to pass;
* BERT's tie split by the FSDP units is named, and a legacy BERT checkpoint (LayerNorm.gamma /
  .beta) converts and loads exactly;
* the encoder and encoder-decoder samples (OTHER_TASKS_PASS_TODAY: BERT's masked-LM class, T5 and
  BART's conditional-generation classes, the decoder's logits with decoder_input_ids) pass every
  case, in the same jobs, and the generated table has a section per family;
* the instrument itself sees a difference: a control loads llama's conversion but compares it
  with a checkpoint one element of which was changed, and must be a mismatch naming that
  parameter and the logits, in every case.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
COVERAGE = os.path.join(REPO, "scripts", "coverage")
if COVERAGE not in sys.path:
    sys.path.insert(0, COVERAGE)

import matrix  # noqa: E402
import tiny  # noqa: E402

# Every case of these passes today: one architecture per mechanism.
PASS_TODAY = {
    "llama": "plain Llama-style decoder",
    "gpt2": "tied embeddings (lm_head = wte), Conv1D weights",
    "gemma": "tied embeddings, embed_scale computed in the model's dtype",
    "gptj": "non-persistent rotary table (embed_positions) recomputed in fp32",
    "apertus": "persistent buffers (act_fn.beta / eps) whole on every rank",
    "gptj@bin-fp16": "a torch.save .bin checkpoint in fp16",
    "gpt_neox": "the hub's names differ from the model's (embed_out -> lm_head), renamed on load",
    "mixtral": "per-expert MoE weights fused into gate_up_proj / down_proj on load",
    "bert": "a tie (decoder = word_embeddings) that the FSDP units split into two parameters",
    "ernie4_5_moe": "keep-in-fp32 router modules: FSDP units of their own (FSDP2 and FSDP1 --wrap)",
    "marian": "a frozen parameter (sinusoidal positions): FSDP1 with use_orig_params",
    "bart": "_no_split_modules names an encoder class the causal-LM class does not build",
}
# Refused today in some case, with reshard's message naming the reason; they may start to pass.
# One module holds fp32 A_log and bf16 weights: convert refuses its FSDP1 unit by name, and
# FSDP2 itself refuses to shard it (reshard's load succeeded; FSDP's lazy init does not).
REFUSED_TODAY = {
    "olmo_hybrid": {"fsdp1-ws2": ("refused", "mixes dtypes"),
                    "fsdp2-ws2": ("fsdp-refuses", "uniform original parameter dtype"),
                    "fsdp2-ws3": ("fsdp-refuses", "uniform original parameter dtype")},
    # fp32 Conv1d units whose forward the model never calls (it reads conv1d.weight itself): FSDP
    # never unshards them. The worker runs from_pretrained's own model under the same units, which
    # fails the same way: FSDP's limit, not reshard's (was "crash").
    "inkling_text": {c: ("fsdp-refuses", "fails the same way on from_pretrained's own model")
                     for c in ("fsdp2-ws2", "fsdp2-ws3", "fsdp1-ws2")},
    # RWKV's eval forward rescales its weights in place (_rescale_layers), which segfaults on
    # FSDP1's flat parameters: the job dies; matrix.py then runs from_pretrained's own model
    # under the same units, which dies in the same frame (FSDP1's limit, not reshard's).
    "rwkv": {"fsdp1-ws2": ("fsdp-refuses", "FSDP1 dies the same way on from_pretrained's own model")},
}
# The encoder and encoder-decoder families (AutoModelForMaskedLM / AutoModelForSeq2SeqLM's
# mappings), loaded in the same torchrun jobs: every case passes today.
OTHER_TASKS_PASS_TODAY = {
    "masked-lm": {"bert": "BertForMaskedLM: an MLM head tied to the word embeddings",
                  # reshard.load found a tied parameter by its first name only, and FSDP2 /
                  # unsharded loads refused it (lm_head.bias; the file holds lm_head.decoder.bias).
                  "luke": "a tie kept as one parameter whose first name is not the one in the file"},
    "seq2seq-lm": {"t5": "T5: shared embeddings of encoder and decoder, relative-position buckets, "
                         "decoder_input_ids",
                   "bart": "BART: learned positions with an offset, final_logits_bias a persistent buffer",
                   # Its sinusoidal embed_positions are parameters the model never saves
                   # (_keys_to_ignore_on_save): computed at load as from_pretrained computes them,
                   # zeros in the FSDP1 flat shard of the conversion.
                   "marian": "MarianMTModel: unsaved sinusoidal position parameters, computed at load"},
}
CASES = ("fsdp2-ws2", "fsdp2-ws3", "fsdp1-ws2")
CONTROL_TENSOR = "model.layers.1.mlp.down_proj.weight"


def _control(cache: str) -> dict:
    """llama's conversion checked against a copy of its checkpoint with one element changed."""
    from safetensors.torch import load_file, save_file

    build = tiny.build(tiny.parse_entry_id("llama"), cache)
    assert build["status"] == "built", build
    src = os.path.join(cache, "control-llama", "src")
    shutil.copytree(build["src"], src)
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    w = tensors[CONTROL_TENSOR]
    w[3, 5] = -w[3, 5] if w[3, 5] != 0 else torch.ones((), dtype=w.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return {"id": "control-llama", "src": src, "out": os.path.join(cache, "llama", "out"),
            "model_class": build["model_class"], "dtype": "bf16", "cases": list(CASES)}


def _legacy_bert(cache: str) -> dict:
    """BERT as checkpoints written before transformers 4 have it (LayerNorm.gamma / .beta),
    which from_pretrained renames by its legacy conversion; convert captures it."""
    from safetensors.torch import load_file, save_file

    from reshard import model_manifest

    build = tiny.build(tiny.parse_entry_id("bert"), cache)
    assert build["status"] == "built", build
    entry_dir = os.path.join(cache, "legacy-bert")
    src = os.path.join(entry_dir, "src")
    shutil.copytree(build["src"], src)
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in tensors.items()}
    assert sum(k.endswith(".gamma") for k in legacy) >= 3
    save_file(legacy, path, metadata={"format": "pt"})
    assert model_manifest.main([src, "-o", os.path.join(entry_dir, "reshard-model.json")]) == 0
    b = dict(build, id="legacy-bert", src=src)
    failed = matrix.convert(b, cache, list(CASES))
    assert not failed, failed
    return {"id": "legacy-bert", "src": src, "out": os.path.join(entry_dir, "out"),
            "model_class": build["model_class"], "dtype": "bf16", "cases": list(CASES),
            "fsdp1": build.get("fsdp1") or {}}


@pytest.fixture(scope="module")
def coverage(tmp_path_factory, reshard_bin):
    cache = str(tmp_path_factory.mktemp("coverage"))
    os.environ.setdefault("RESHARD_BIN", reshard_bin)
    extra = [_control(cache), _legacy_bert(cache)]
    result = matrix.run(list(PASS_TODAY) + list(REFUSED_TODAY), cache, extra=extra, limit_s=240,
                        also={t: list(ids) for t, ids in OTHER_TASKS_PASS_TODAY.items()})
    return result, cache


def _describe(records) -> str:
    return "\n".join(f"{r['id']:16s} {r['case']:10s} {r['status']:9s} {matrix.cell(r)[:160]}" for r in records)


def test_sample_passes_or_is_refused_with_a_reason(coverage):
    result, _ = coverage
    records = result["records"]
    assert {(r["id"], r["case"]) for r in records} == {(e, c) for e in list(PASS_TODAY) + list(REFUSED_TODAY)
                                                       for c in CASES}, _describe(records)
    bad = [r for r in records if r["status"] not in ("pass", "refused", "fsdp-refuses")]
    assert not bad, "silent mismatch, crash or skipped in the sample:\n" + _describe(bad) + "\n" + \
        json.dumps(bad, indent=1, default=str)[:6000]
    for r in records:
        if r["status"] == "refused":
            assert r.get("stage") in ("convert", "load") and len(r.get("message", "")) > 20, r
        if r["status"] == "fsdp-refuses":
            assert r.get("stage") in ("shard", "forward") and "FSDP" in r.get("message", "") or \
                "flatten" in r.get("message", ""), r


def test_what_passes_today_still_passes(coverage):
    result, _ = coverage
    regressed = [r for r in result["records"] if r["id"] in PASS_TODAY and
                 (r["status"] != "pass" or r.get("logits") != "equal")]
    assert not regressed, "passed before, not now:\n" + _describe(regressed)
    for r in result["records"]:
        if r["id"] in PASS_TODAY:
            assert r["params_checked"] > 0 and r["buffers_checked"] >= 0, r


def test_what_is_refused_today_names_its_reason(coverage):
    result, _ = coverage
    for r in result["records"]:
        if r["id"] in REFUSED_TODAY and r["status"] != "pass":
            status, reason = REFUSED_TODAY[r["id"]][r["case"]]
            assert r["status"] == status and reason in r["message"], r


def test_check_weights_agrees_and_ties_split_by_the_units_are_named(coverage):
    """reshard's own --check-weights passes wherever the independent comparison does; BERT's
    tie is two parameters once FSDP shards the embeddings in a unit of their own (FSDP2, and
    FSDP1 without use_orig_params): both equal from_pretrained's one tensor, and the record
    says so."""
    result, _ = coverage
    for r in result["records"]:
        if r["status"] == "pass":
            assert r.get("check_weights") == "ok", r
    bert = {r["case"]: r for r in result["records"] if r["id"] == "bert"}
    for case in ("fsdp2-ws2", "fsdp2-ws3"):
        assert bert[case]["ties_split_by_sharding"] == [
            "cls.predictions.decoder.weight = bert.embeddings.word_embeddings.weight"], bert[case]
    legacy = {r["case"]: r for r in result["extra"] if r["id"] == "legacy-bert"}
    assert set(legacy) == set(CASES) and all(r["status"] == "pass" for r in legacy.values()), legacy


def test_the_instrument_sees_one_changed_element(coverage):
    result, _ = coverage
    control = {r["case"]: r for r in result["extra"] if r["id"] == "control-llama"}
    assert set(control) == set(CASES), control
    for case, r in control.items():
        assert r["status"] == "mismatch", (case, r)
        named = [d.split(":")[0] for d in r["differ"]]
        assert f"parameter {CONTROL_TENSOR}" in named and "logits" in named, (case, r["differ"])
        assert all(n in (f"parameter {CONTROL_TENSOR}", "logits") for n in named), (case, r["differ"])


def test_the_table(coverage, tmp_path):
    result, _ = coverage
    result["meta"]["command"] = "pytest tests/python/test_coverage.py"
    doc = tmp_path / "coverage.md"
    matrix.write_doc(result, str(doc), result["meta"]["command"])
    text = doc.read_text()
    assert "| fsdp2-ws2 |" in text and "| llama | LlamaForCausalLM | identical | pass | pass | pass |" in text, text
    assert "| mixtral | MixtralForCausalLM | fused |" in text, text


def test_encoders_and_encoder_decoders_pass(coverage):
    result, _ = coverage
    also = result["also"]
    assert set(also) == set(OTHER_TASKS_PASS_TODAY), also.keys()
    for task, sample in OTHER_TASKS_PASS_TODAY.items():
        records = also[task]["records"]
        assert {(r["id"], r["case"]) for r in records} == {(e, c) for e in sample for c in CASES}, _describe(records)
        bad = [r for r in records if r["status"] != "pass" or r.get("logits") != "equal"
               or r.get("check_weights") != "ok"]
        assert not bad, f"{task}:\n" + _describe(bad) + "\n" + json.dumps(bad, indent=1, default=str)[:4000]
        for r in records:
            assert r["model_class"] == tiny.model_class_name(r["id"], task) and r["params_checked"] > 0, r
    # The encoder-decoders are loaded as their sequence-to-sequence classes (the forward takes
    # decoder_input_ids), not as the causal-LM decoders the causal matrix has.
    assert {r["model_class"] for r in also["seq2seq-lm"]["records"]} == {
        "T5ForConditionalGeneration", "BartForConditionalGeneration", "MarianMTModel"}


def test_the_rule_that_leaves_out_multimodal_and_speech_classes():
    """Every left-out type names its reason; a text class is never left out, a speech one is."""
    import transformers

    for task in ("masked-lm", "seq2seq-lm"):
        excluded = tiny.excluded(task)
        kept = tiny.model_types(task)
        assert not set(excluded) & set(kept)
        assert set(excluded) | set(kept) == set(tiny.mapping(task))
        for t in kept:
            assert getattr(transformers, tiny.model_class_name(t, task)).input_modalities in ("text", ("text",)), t
        for t, why in excluded.items():
            assert "multimodal / speech" in why or "sequence-to-sequence class" in why, (t, why)
    seq2seq = tiny.excluded("seq2seq-lm")
    assert "t5" not in seq2seq and "audio" in seq2seq.get("qwen2_audio", ""), seq2seq


def test_the_table_has_a_section_per_family(coverage, tmp_path):
    result, _ = coverage
    results = [result] + [dict(r, meta=dict(r["meta"], command="pytest")) for r in result["also"].values()]
    doc = tmp_path / "coverage.md"
    matrix.write_doc(results, str(doc))
    text = doc.read_text()
    for task in tiny.TASKS:
        assert f"## {tiny.FAMILIES[task]}" in text, text[:2000]
    assert "| bert | BertForMaskedLM | identical | pass" in text, text
    assert "| t5 | T5ForConditionalGeneration |" in text and "| bart | BartForConditionalGeneration |" in text
    # The header's figures count every family's entries.
    n = len(PASS_TODAY) + len(REFUSED_TODAY) + sum(len(v) for v in OTHER_TASKS_PASS_TODAY.values())
    assert f"**All families: {n} entries;" in text, text[:3000]
