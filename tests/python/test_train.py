"""The trainer (python -m reshard.train) and the accelerate recipe, end to end on CPU:
several processes (torchrun / accelerate launch), FSDP2 on gloo, real transformers models.

* two ranks: weights right after the load equal from_pretrained bit for bit, greedy generation
  equals from_pretrained's, the loss falls; AutoTokenizer from OUT;
* one process (no torchrun): .jsonl data, byte-level tokens, and a wrong reference refused;
* accelerate launch, two processes: accelerate's fp32 upcast, weights equal
  from_pretrained(...).float(), the loss falls;
* FSDP1 (--fsdp1, accelerate's FSDP1 plugin): weights equal from_pretrained, the loss falls;
  --save-dir / --resume with --fsdp1 --use-orig-params give the uninterrupted losses;
* tensor parallel (--tp 2 on four ranks, mesh dp_shard=2 x tp=2): a tied Qwen2 with q/k/v
  biases; loaded from the FSDP2 layout (the commands that store the DTensor layout printed),
  then from the DTensor layout: weights
  equal from_pretrained bit for bit (the tie kept), greedy generation too, the loss falls;
* expert parallel (--ep 2 on four ranks, reshard.ep: experts on efsdp=2 x ep=2, the rest on
  fsdp=4): a tiny Mixtral; weights equal from_pretrained bit for bit, the losses and gradient
  norms those of FSDP2 on two ranks up to bf16 rounding, resumed bit for bit; refusals by name;
* host memory: a ~500 MB Llama-shaped bf16 checkpoint; what each rank's peak RSS grows by during
  the load is bounded by that rank's bytes (and is far from the whole model).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BIN = os.path.dirname(sys.executable)
TORCHRUN = os.path.join(BIN, "torchrun")
ACCELERATE = os.path.join(BIN, "accelerate")
RECIPE = os.path.join(REPO, "recipes", "accelerate")
MiB = 1 << 20


def _env():
    paths = [os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def _run(cmd, timeout=240, expect_rc=0):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=_env(),
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)
    out = f"$ {' '.join(map(str, cmd))}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    if expect_rc == 0:
        assert proc.returncode == 0, out
    elif expect_rc == 1:
        assert proc.returncode != 0, "expected a failure\n" + out
    else:
        assert proc.returncode == expect_rc, f"expected exit {expect_rc}\n" + out
    return proc, out


def _convert(reshard_bin, src, out, world, *extra):
    _run([reshard_bin, "convert", src, "-o", out, "--world-size", world, *extra])


def _reports(json_dir, world):
    return [json.load(open(os.path.join(json_dir, f"rank-{r}.json"))) for r in range(world)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _char_tokenizer(directory):
    """A character-level fast tokenizer of 32 ids (fits the test models' 37-word vocabulary),
    saved with save_pretrained so that AutoTokenizer finds it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz .,\n":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(directory)


def _loss_fell(losses, min_drop):
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert last < first - min_drop, f"loss did not fall by {min_drop}: first {first:.4f}, last {last:.4f}: {losses}"
    return first, last


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, reshard_bin):
    """The tiny Llama (bf16, sharded safetensors) with a tokenizer, converted for 2 ranks, and a
    copy without tokenizer converted for 1 rank; plus another seed as a wrong reference."""
    root = tmp_path_factory.mktemp("train")
    src = str(root / "llama")
    checkpoints.make_checkpoint(src, "llama", "bf16", True)
    _char_tokenizer(src)
    out2 = str(root / "out-ws2")
    _convert(reshard_bin, src, out2, 2)
    assert os.path.exists(os.path.join(out2, "tokenizer.json")), os.listdir(out2)
    bare = str(root / "llama-bare")
    checkpoints.make_checkpoint(bare, "llama", "bf16", False)
    out1 = str(root / "out-ws1")
    _convert(reshard_bin, bare, out1, 1)
    other = str(root / "llama-seed1")
    checkpoints.make_checkpoint(other, "llama", "bf16", False, seed=1)
    return {"src": src, "out2": out2, "bare": bare, "out1": out1, "other": other, "root": root}


def test_trainer_two_ranks_loads_exactly_and_learns(tiny, tmp_path, reshard_bin):
    from transformers import AutoModelForCausalLM

    json_dir = tmp_path / "json"
    proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", tiny["out2"],
                      "--steps", "24", "--grad-accum", "2", "--batch-size", "4", "--seq-len", "64",
                      "--lr", "3e-3", "--max-grad-norm", "1.0", "--log-every", "4",
                      "--check-weights", tiny["src"], "--check-generate", tiny["src"],
                      "--json-out", json_dir])
    reps = _reports(json_dir, 2)
    n_params = len(list(AutoModelForCausalLM.from_pretrained(tiny["src"]).parameters()))
    layout = json.loads(subprocess.run([reshard_bin, "inspect", tiny["out2"], "--json"], check=True,
                                       capture_output=True, text=True).stdout)["layouts"]["fsdp2-ws2"]
    for r, rep in enumerate(reps):
        assert rep["rank"] == r and rep["world_size"] == 2
        assert rep["load"]["file"].endswith(f"fsdp2-ws2/rank-{r:05d}-of-00002.reshard"), rep["load"]
        assert rep["params_checked"] == n_params
        assert rep["mixed_precision"] and rep["param_dtype"] == "torch.float32"
        assert rep["load"]["converted_tensors"] > 0  # bf16 file -> fp32 master weights
        assert rep["tokenizer"].startswith("AutoTokenizer"), rep["tokenizer"]
        gen = rep["generate"]
        assert len(gen["generated"]) == len(gen["prompt"]) + 12
        assert rep["losses"] == reps[0]["losses"]  # all-reduced: one loss curve
        assert len(rep["losses"]) == 24 and len(rep["grad_norms"]) == 24
        assert rep["tokens_per_s"] > 0 and rep["rss"]["peak_final"] > 0
    assert reps[0]["generate"]["generated"] == reps[1]["generate"]["generated"]
    assert sum(rep["load"]["bytes"] for rep in reps) == layout["nbytes"]
    first, last = _loss_fell(reps[0]["losses"], 1.0)
    assert "check-weights:" in proc.stdout and "check-generate:" in proc.stdout, log
    assert proc.stdout.count("step ") >= 6, log
    print(f"\ntrainer 2 ranks: loss {first:.3f} -> {last:.3f}, load {reps[0]['load']['seconds'] * 1e3:.1f} ms "
          f"/ {reps[1]['load']['seconds'] * 1e3:.1f} ms, peak RSS {reps[0]['rss']['peak_final'] / MiB:.0f} MiB")


def test_trainer_single_process_jsonl_bytes_and_refusal(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"Line {i}: the miller counted {i % 7} sheep near the river.", "id": i}) + "\n")
    json_dir, plain_dir = tmp_path / "json", tmp_path / "plain"
    args = [sys.executable, "-m", "reshard.train", tiny["out1"], "--data", data, "--steps", "16",
            "--seq-len", "32", "--batch-size", "4", "--lr", "5e-3", "--no-bf16", "--param-dtype", "checkpoint"]
    proc, log = _run([*args, "--check-weights", tiny["bare"], "--check-generate", tiny["bare"],
                      "--json-out", json_dir])
    (rep,) = _reports(json_dir, 1)
    # The checks run forwards without backward; they must leave training exactly as without them
    # (FSDP2 keeps the root's gathered parameters after a forward unless resharded).
    _run([*args, "--json-out", plain_dir])
    (plain,) = _reports(plain_dir, 1)
    assert rep["losses"] == plain["losses"], (rep["losses"], plain["losses"])
    assert rep["world_size"] == 1 and rep["load"]["file"].endswith("rank-00000-of-00001.reshard")
    assert rep["param_dtype"] == "torch.bfloat16" and not rep["mixed_precision"]
    assert rep["load"]["converted_tensors"] == 0
    assert rep["tokenizer"].startswith("byte-level fallback"), rep["tokenizer"]
    assert "byte-level fallback" in proc.stdout, log
    _loss_fell(rep["losses"], 0.5)
    # The same load checked against another checkpoint must fail, naming what differs.
    proc, log = _run([sys.executable, "-m", "reshard.train", tiny["out1"], "--steps", "1",
                      "--check-weights", tiny["other"]], expect_rc=1)
    assert "differ from from_pretrained" in proc.stderr and "model.embed_tokens.weight" in proc.stderr, log
    proc, log = _run([sys.executable, "-m", "reshard.train", tiny["out1"], "--steps", "1",
                      "--check-generate", tiny["other"]], expect_rc=1)
    assert "greedy generation differs" in proc.stderr, log


@pytest.mark.parametrize("config,live_dtype", [("fsdp2.yaml", "torch.float32"),
                                               ("fsdp2-no-mp.yaml", "torch.bfloat16")])
def test_accelerate_recipe_two_processes(tiny, tmp_path, config, live_dtype):
    """bf16 mixed precision: accelerate upcasts to fp32 and the load converts (weights equal
    from_pretrained(...).float()); without mixed precision the bf16 bytes land as they are."""
    from transformers import AutoModelForCausalLM

    json_dir = tmp_path / "json"
    proc, log = _run([ACCELERATE, "launch", "--config_file", os.path.join(RECIPE, config),
                      "--num_processes", "2", "--main_process_port", _free_port(),
                      os.path.join(RECIPE, "train_accelerate.py"), tiny["out2"], "--steps", "20",
                      "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--log-every", "5",
                      "--check-weights", tiny["src"], "--json-out", json_dir])
    reps = _reports(json_dir, 2)
    n_params = len(list(AutoModelForCausalLM.from_pretrained(tiny["src"]).parameters()))
    for r, rep in enumerate(reps):
        assert rep["world_size"] == 2 and rep["rank"] == r
        assert rep["prepared_on_meta"], "accelerate.prepare must leave the empty model on meta"
        assert rep["file_dtype"] == "torch.bfloat16" and rep["param_dtype"] == live_dtype, rep
        if live_dtype == "torch.float32":
            assert rep["mixed_precision"] == "bf16" and rep["load"]["converted_tensors"] > 0
        else:
            assert rep["mixed_precision"] == "no" and rep["load"]["converted_tensors"] == 0
        assert rep["load"]["file"].endswith(f"rank-{r:05d}-of-00002.reshard")
        assert rep["params_checked"] == n_params
        assert rep["optimizer_params"] == n_params
    first, last = _loss_fell(reps[0]["losses"], 1.0)
    assert f"equal from_pretrained({tiny['src']}) bit for bit (live dtype {live_dtype})" in proc.stdout, log
    print(f"\naccelerate recipe ({config}) 2 ranks: loss {first:.3f} -> {last:.3f}")


def test_accelerate_recipe_lora_two_processes(tiny, tmp_path, reshard_bin):
    """The recipe's LoRA variant as recipes/accelerate.md writes it: accelerate shards the PEFT
    model (bf16 mixed precision), the optimizer holds the 8 adapter tensors, the adapters start
    as PEFT initialises them, and the loss falls."""
    pytest.importorskip("peft", reason="peft is a pinned test dependency (scripts/setup.sh)")
    json_dir = tmp_path / "json"
    _run([ACCELERATE, "launch", "--config_file", os.path.join(RECIPE, "fsdp2.yaml"),
          "--num_processes", "2", "--main_process_port", _free_port(),
          os.path.join(RECIPE, "train_accelerate.py"), tiny["out2"], "--lora", "4", "--steps", "30",
          "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
          "--seq-len", "64", "--batch-size", "4", "--lr", "3e-2", "--log-every", "5", "--json-out", json_dir,
          "--save", tmp_path / "acc-lora"])
    for rep in _reports(json_dir, 2):
        assert rep["optimizer_params"] == 28, rep  # 2 layers x 7 targets x (A, B)
        assert rep["adapters"]["source"].startswith("initialised as PEFT"), rep["adapters"]
        assert rep["prepared_on_meta"]
    _loss_fell(_reports(json_dir, 2)[0]["losses"], 0.05)
    # The merged model, as the recipe says: equal to merge_and_unload() of PEFT's model with
    # the saved adapters (export --adapter, which test_peft.py checks against the trained ones).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved, adapter, merged = tmp_path / "acc-lora", tmp_path / "adapter", tmp_path / "merged"
    _run([reshard_bin, "export", saved, "-o", adapter, "--adapter"])
    _run([reshard_bin, "export", saved, "-o", merged, "--merge"])
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["src"], dtype="auto"),
                                     str(adapter)).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(merged), dtype="auto").state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(-1).view(torch.uint8),
                                                              want[k].view(-1).view(torch.uint8)), k


# ---------------------------------------------------------------------------------------
# Host memory on a model big enough to tell
# ---------------------------------------------------------------------------------------

def _write_llama_bf16(path, layers=16, file_bytes=150 << 20):
    """A Llama-shaped bf16 checkpoint (hidden 1024, MLP 2816, vocab 32000, `layers` layers:
    ~254 M parameters, ~509 MB), written with safetensors one file at a time; key names and
    shapes come from transformers' own model built on the meta device."""
    import transformers as tr
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    cfg = tr.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    with init_empty_weights():
        shapes = {k: v.shape for k, v in tr.LlamaForCausalLM(cfg).state_dict().items()}
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    groups, cur, size = [], [], 0
    for name, shape in shapes.items():
        cur.append(name)
        size += shape.numel() * 2
        if size >= file_bytes:
            groups.append(cur)
            cur, size = [], 0
    groups += [cur] if cur else []
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16) for n in group}
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def test_peak_rss_bounded_by_rank_bytes(tmp_path, reshard_bin):
    src, out = str(tmp_path / "llama-500mb"), str(tmp_path / "out")
    model_bytes = _write_llama_bf16(src)
    assert 400e6 < model_bytes < 600e6, model_bytes
    _convert(reshard_bin, src, out, 2)
    common = ["--steps", "1", "--batch-size", "1", "--seq-len", "16", "--param-dtype", "checkpoint"]
    base_dir, run_dir = tmp_path / "baseline", tmp_path / "run"
    _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", out, *common,
          "--dry-baseline", "--json-out", base_dir])
    proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", out, *common,
                      "--json-out", run_dir])
    base, reps = _reports(base_dir, 2), _reports(run_dir, 2)
    lines = []
    for r, (b, rep) in enumerate(zip(base, reps)):
        assert b["dry_baseline"] and "load" not in b
        rank_bytes = rep["load"]["bytes"]
        assert rank_bytes == rep["local_param_bytes"], (rank_bytes, rep["local_param_bytes"])
        assert abs(rank_bytes - model_bytes / 2) < 0.1 * model_bytes, (rank_bytes, model_bytes)
        baseline = b["rss"]["peak_final"]
        peak = rep["rss"]["peak_after_load"]
        grown = peak - baseline
        in_run = rep["rss"]["load_increment"]  # peak after the load - RSS right before it
        bound = int(1.15 * rank_bytes) + 96 * MiB
        lines.append(f"rank {r}: rank bytes {rank_bytes / MiB:.1f} MiB, baseline peak RSS {baseline / MiB:.0f} MiB, "
                     f"peak RSS after load {peak / MiB:.0f} MiB, grown {grown / MiB:.0f} MiB (in-run "
                     f"{in_run / MiB:.0f} MiB), bound {bound / MiB:.0f} MiB, model {model_bytes / MiB:.0f} MiB, "
                     f"load {rep['load']['seconds']:.2f} s ({rep['load']['gbps']:.2f} GB/s), "
                     f"peak RSS after 1 step {rep['rss']['peak_final'] / MiB:.0f} MiB")
        # The shard really landed in host memory (else the measurement would prove nothing) ...
        assert in_run >= 0.9 * rank_bytes, lines[-1]
        # ... and the load costs this rank's bytes plus small buffers: nobody holds the model.
        assert grown <= bound and in_run <= bound, lines[-1]
        assert grown < 0.7 * model_bytes and in_run < 0.7 * model_bytes, lines[-1]
    print("\n" + "\n".join(lines))
    assert all(len(rep["losses"]) == 1 for rep in reps)


# ---------------------------------------------------------------------------------------
# Data helpers (in-process)
# ---------------------------------------------------------------------------------------

def test_shipped_corpus_and_data_helpers(tmp_path):
    from reshard import train

    corpus = train.DEFAULT_CORPUS
    assert 100_000 < os.path.getsize(corpus) < 300_000
    # The corpus is exactly what its generator writes (deterministic, no third-party text).
    gen = os.path.join(os.path.dirname(corpus), "make_corpus.py")
    _run([sys.executable, gen, "--check"])
    docs = train.load_documents(None)
    assert len(docs) == 1 and docs[0].startswith("The Village Book")

    encode, eos, desc = train.make_encoder(str(tmp_path), 37)  # no tokenizer files there
    assert eos is None and desc.startswith("byte-level fallback")
    assert encode("Az\u00e9") == [b % 37 for b in "Az\u00e9".encode("utf-8")]
    stream = train.token_stream(["ab", "cd"], encode, None, 37)
    assert stream.tolist() == [b % 37 for b in b"abcd"]
    with pytest.raises(ValueError, match="token id 40 >= vocab_size 37"):
        train.token_stream(["x"], lambda t: [40], None, 37)
    with pytest.raises(ValueError, match="--seq-len 8 needs more"):
        train.Batches(torch.arange(8), 2, 8, 0, 0)
    b0 = train.Batches(torch.arange(1000), 3, 16, seed=5, rank=0).next()
    assert b0.shape == (3, 16) and torch.equal(b0[:, 1:] - b0[:, :-1], torch.ones(3, 15, dtype=torch.int64))
    assert torch.equal(b0, train.Batches(torch.arange(1000), 3, 16, seed=5, rank=0).next())
    assert not torch.equal(b0, train.Batches(torch.arange(1000), 3, 16, seed=5, rank=1).next())

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected an object with a string field"):
        train.load_documents(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two", "meta": 1}\n')
    assert train.load_documents(str(good)) == ["one", "two"]
    assert train.token_stream(["ab", "cd"], encode, 1, 37).tolist() == [97 % 37, 98 % 37, 1, 99 % 37, 100 % 37]


# ---------------------------------------------------------------------------------------
# FSDP1: the trainer (--fsdp1) and accelerate's FSDP1 plugin
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp1_out(tiny, reshard_bin):
    """tiny's output directory with an fsdp1 layout for 2 ranks, fp32 (the live dtype of both
    jobs: fp32 master weights under bf16 mixed precision)."""
    _run([sys.executable, "-m", "reshard.manifest", tiny["src"], "-o",
          os.path.join(tiny["out2"], "reshard-model.json")])
    _run([reshard_bin, "convert", tiny["src"], "-o", tiny["out2"], "--world-size", "2",
          "--layout", "fsdp1", "--dtype", "fp32"])
    return tiny["out2"]


def test_trainer_fsdp1_two_ranks(tiny, fsdp1_out, tmp_path):
    from transformers import AutoModelForCausalLM

    json_dir = tmp_path / "json"
    proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", fsdp1_out,
                      "--fsdp1", "--steps", "24", "--grad-accum", "2", "--batch-size", "4", "--seq-len", "64",
                      "--lr", "3e-3", "--log-every", "4", "--check-weights", tiny["src"],
                      "--check-generate", tiny["src"], "--json-out", json_dir])
    reps = _reports(json_dir, 2)
    n_params = len(list(AutoModelForCausalLM.from_pretrained(tiny["src"]).parameters()))
    for r, rep in enumerate(reps):
        assert rep["fsdp"] == 1 and rep["fsdp_units"] == 3  # 2 decoder layers + the root
        assert rep["load"]["file"].endswith(f"fsdp1-ws2-LlamaDecoderLayer-fp32/rank-{r:05d}-of-00002.reshard")
        assert rep["load"]["converted_tensors"] == 0  # converted offline
        assert rep["params_checked"] == n_params
        assert rep["losses"] == reps[0]["losses"]
    assert reps[0]["generate"]["generated"] == reps[1]["generate"]["generated"]
    first, last = _loss_fell(reps[0]["losses"], 1.0)
    assert "FSDP1 units" in proc.stdout and "check-generate:" in proc.stdout, log
    print(f"\ntrainer --fsdp1 2 ranks: loss {first:.3f} -> {last:.3f}")


def test_accelerate_recipe_fsdp1_two_processes(tiny, fsdp1_out, tmp_path):
    from transformers import AutoModelForCausalLM

    json_dir = tmp_path / "json"
    proc, log = _run([ACCELERATE, "launch", "--config_file", os.path.join(RECIPE, "fsdp1.yaml"),
                      "--num_processes", "2", "--main_process_port", _free_port(),
                      os.path.join(RECIPE, "train_accelerate.py"), fsdp1_out, "--steps", "20",
                      "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--log-every", "5",
                      "--check-weights", tiny["src"], "--json-out", json_dir])
    reps = _reports(json_dir, 2)
    n_params = len(list(AutoModelForCausalLM.from_pretrained(tiny["src"]).parameters()))
    for r, rep in enumerate(reps):
        assert rep["fsdp_version"] == 1 and rep["param_dtype"] == "torch.float32"  # accelerate's upcast
        assert rep["layout"] == "fsdp1-ws2-LlamaDecoderLayer-fp32", rep
        assert rep["params_checked"] == n_params
    first, last = _loss_fell(reps[0]["losses"], 1.0)
    print(f"\naccelerate recipe (fsdp1.yaml) 2 ranks: loss {first:.3f} -> {last:.3f}")


def test_trainer_fsdp1_resume_gives_the_uninterrupted_losses(tiny, reshard_bin, tmp_path):
    """--fsdp1 --use-orig-params (bf16 mixed precision, fp32 master weights): N steps + save +
    resume N steps give exactly the losses and gradient norms of 2N uninterrupted steps; every
    checkpoint is in the job's own fsdp1 layout and verifies."""
    out = str(tmp_path / "out")
    _run([sys.executable, "-m", "reshard.manifest", tiny["src"], "-o", os.path.join(out, "reshard-model.json")])
    _run([reshard_bin, "convert", tiny["src"], "-o", out, "--world-size", "2", "--layout", "fsdp1",
          "--use-orig-params", "--param-dtype", "bf16", "--dtype", "fp32"])

    def train(json_dir, *extra):
        proc, _ = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", out,
                        "--fsdp1", "--use-orig-params", "--seq-len", "32", "--batch-size", "2",
                        "--lr", "3e-3", "--warmup-steps", "2", "--grad-accum", "2",
                        "--json-out", json_dir, *map(str, extra)], timeout=400)
        return _reports(json_dir, 2), proc

    whole, _ = train(tmp_path / "whole", "--steps", 6)
    saves = tmp_path / "saves"
    first, _ = train(tmp_path / "first", "--steps", 3, "--save-dir", saves)
    assert first[0]["checkpoints"] == [str(saves / "step-00000003")]
    key = "fsdp1-ws2-LlamaDecoderLayer-orig-pbf16"
    with open(saves / "step-00000003" / "reshard.json") as f:
        assert list(json.load(f)["layouts"]) == [key]
    _run([reshard_bin, "verify", saves / "step-00000003"])
    second, proc = train(tmp_path / "second", "--steps", 6, "--resume", saves, "--save-dir", saves,
                         "--save-every", 2)
    assert "resume:" in proc.stdout and "at step 3" in proc.stdout
    assert second[0]["first_step"] == 4 and second[0]["fsdp"] == 1
    assert second[0]["load"]["file"].endswith(f"step-00000003/{key}/rank-00000-of-00002.reshard")
    assert second[0]["checkpoints"] == [str(saves / "step-00000004"), str(saves / "step-00000006")]
    for r in range(2):
        assert len(whole[r]["losses"]) == 6 and len(second[r]["losses"]) == 3
        # Exactly: same weights, optimizer state, data order and learning rates.
        assert first[r]["losses"] == whole[r]["losses"][:3]
        assert second[r]["losses"] == whole[r]["losses"][3:], (second[r]["losses"], whole[r]["losses"])
        assert second[r]["grad_norms"] == whole[r]["grad_norms"][3:]
    _run([reshard_bin, "verify", saves / "step-00000006"])


def test_trainer_lora_trains_adapters_only_and_resumes_exactly(tiny, reshard_bin, tmp_path):
    """--lora 4 (PEFT's default targets for Llama: q_proj, v_proj), two ranks: the optimizer
    holds the 8 adapter tensors only; 3 steps + save + resume 3 give exactly the losses of 6
    uninterrupted steps (the base from OUT, the adapters and optimizer from the checkpoint);
    the checkpoint (--save-base: the base too) exports as a PEFT adapter directory and, with
    --merge, as the merged model, equal to merge_and_unload() of PEFT's model with those
    adapters."""
    pytest.importorskip("peft", reason="peft is a pinned test dependency (scripts/setup.sh)")

    def train(json_dir, *extra):
        proc, _ = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", tiny["out2"],
                        "--lora", "4", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3",
                        "--json-out", json_dir, *map(str, extra)], timeout=400)
        return _reports(json_dir, 2), proc

    whole, proc = train(tmp_path / "whole", "--steps", 6)
    assert "lora: r=4, 8 adapter tensor(s)" in proc.stdout, proc.stdout
    assert whole[0]["lora"]["trainable_tensors"] == 8
    assert whole[0]["lora"]["adapters"]["source"].startswith("initialised as PEFT")
    _loss_fell(whole[0]["losses"], 0.0)
    saves = tmp_path / "saves"
    first, _ = train(tmp_path / "first", "--steps", 3, "--save-dir", saves, "--save-base")
    ckpt = saves / "step-00000003"
    with open(ckpt / "reshard.json") as f:
        manifest = json.load(f)
    assert "adapter_config.json" in manifest["aux_files"], manifest["aux_files"]
    _run([reshard_bin, "verify", ckpt])
    _run([reshard_bin, "export", ckpt, "-o", tmp_path / "adapter", "--adapter"])
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    _run([reshard_bin, "export", ckpt, "-o", tmp_path / "merged", "--merge"])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # The trainer keeps fp32 master weights, so the live base (and the save's) is fp32: the
    # merge is merge_and_unload() of that model, in fp32.
    base = AutoModelForCausalLM.from_pretrained(tiny["src"], dtype=torch.float32)
    want = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype="auto").state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32, (k, got[k].dtype)
        assert torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)), k
    second, proc = train(tmp_path / "second", "--steps", 6, "--resume", saves)
    assert "at step 3" in proc.stdout
    assert second[0]["lora"]["adapters"]["source"] == str(ckpt)
    for r in range(2):
        assert first[r]["losses"] == whole[r]["losses"][:3]
        assert second[r]["losses"] == whole[r]["losses"][3:], (second[r]["losses"], whole[r]["losses"])


# ---------------------------------------------------------------------------------------
# Refusals under torchrun: one line from one rank, every rank out promptly, the CLI's codes
# ---------------------------------------------------------------------------------------

def test_refusal_under_torchrun_is_one_line_and_prompt(tiny, tmp_path, reshard_bin):
    """3 processes on an incomplete world-size-2 conversion (rank 0 only; nothing to read world
    size 3 from): the load is refused on every rank; one line says so (naming the convert
    command that fits), no worker prints a traceback, exit code 3, and the job ends within
    seconds of the refusal (no rank waits in a collective)."""
    import time

    partial = str(tmp_path / "out-ws2-rank0")
    _convert(reshard_bin, tiny["src"], partial, 2, "--ranks", "0-0")
    t0 = time.monotonic()
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "3", "-m", "reshard.train",
                           partial, "--steps", "2"], capture_output=True, text=True, env=_env(),
                          timeout=240, stdin=subprocess.DEVNULL, cwd=REPO)
    elapsed = time.monotonic() - t0
    log = f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode != 0, log
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("reshard.train: ")]
    assert len(lines) == 1, log
    assert "fsdp2-ws3" in lines[0] and "--world-size 3" in lines[0], lines[0]
    # No worker prints a traceback; what remains is torchrun's own report of the failed workers.
    assert proc.stderr.count("Traceback (most recent call last)") <= 1, log
    assert "reshard/load.py" not in proc.stderr and "reshard/examples" not in proc.stderr, log
    assert "exitcode  : 3" in proc.stderr, log  # torchrun's report of the workers' exit code
    assert elapsed < 120, f"{elapsed:.0f} s"
    print(f"\nrefusal under torchrun: {elapsed:.1f} s, {len(proc.stderr.splitlines())} lines of stderr")


def test_resume_at_another_world_size_is_refused_on_every_rank(tiny, tmp_path, reshard_bin):
    """A reshard.train checkpoint of 2 ranks resumed by 1: the trainer state (data position,
    random state) is per rank, so the resume is refused by name on every rank, one line, exit 3
    -- not a silent resume with another rank's data position (nor, at a larger world size, some
    ranks dying in a collective). Said first, before the optimizer state's own refusal (which
    asked for a relayout that then only led here), and alike after such a relayout."""
    saves = tmp_path / "saves"
    _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", tiny["out2"], "--steps", "1",
          "--seq-len", "32", "--batch-size", "2", "--save-dir", saves], timeout=300)
    step = saves / "step-00000001"
    for relaid in (False, True):
        if relaid:
            _run([reshard_bin, "relayout", step, "--world-size", "1"])
        proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "1", "-m", "reshard.train", tiny["out2"],
                          "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--resume", saves],
                         timeout=300, expect_rc=1)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("reshard.train: ")]
        assert len(lines) == 1, log
        assert "trainer state (step, data position, random state) of 2 rank(s)" in lines[0] and \
            "this job has 1" in lines[0] and "run it with 2 processes" in lines[0], lines[0]
        assert "exitcode  : 3" in proc.stderr, log


def test_pointing_at_the_hugging_face_directory_loads_it(tiny, tmp_path):
    """reshard.train on the source checkpoint instead of its conversion: each rank reads its
    part of the Hugging Face files directly (nothing written beside them), and says so."""
    before = sorted(os.listdir(tiny["bare"]))
    proc, log = _run([sys.executable, "-m", "reshard.train", tiny["bare"], "--steps", "1",
                      "--check-weights", tiny["bare"]])
    assert f"from Hugging Face checkpoint {tiny['bare']}, read directly (no conversion stored)" in proc.stdout, log
    assert sorted(os.listdir(tiny["bare"])) == before, "nothing is written into the source"


# ---------------------------------------------------------------------------------------
# Tensor parallel: --tp
# ---------------------------------------------------------------------------------------

def test_trainer_tensor_parallel_tp2_four_ranks(tmp_path, reshard_bin):
    """--tp 2 on four ranks: mesh dp_shard=2 x tp=2, transformers' tp plan. OUT without the
    DTensor layout: each rank reads its part of the FSDP2 layout (planned while loading) and the
    trainer prints the two commands that store the job's layout; after running them
    (parallel_plan + convert into the same OUT) the weights equal from_pretrained's bit for bit,
    the tied head and embeddings stay one parameter (check-weights), greedy generation equals
    from_pretrained's, and the loss falls, step by step as FSDP2 alone on two ranks makes it;
    saved at step 8 (reshard.save of the DTensor job) and resumed, the losses are the
    uninterrupted run's bit for bit."""
    import transformers

    src = tmp_path / "qwen2"
    cfg = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    out = tmp_path / "out"
    _convert(reshard_bin, src, out, 2)  # an FSDP2 layout only: the reference run's
    train = [TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "reshard.train", out, "--tp", "2"]
    json_dir = tmp_path / "json-from-ws2"
    proc, log = _run(train + ["--steps", "2", "--seq-len", "32", "--check-weights", src, "--json-out", json_dir],
                     timeout=600)
    capture = "python -m reshard.parallel_plan SRC -o qwen2_tp.json --fsdp dp_shard"
    convert = f"reshard convert SRC -o {out} --mesh dp_shard=2,tp=2 --plan qwen2_tp.json"
    assert "no DTensor layout of the mesh dp_shard=2,tp=2" in proc.stdout, log
    assert capture in proc.stdout and convert in proc.stdout, log
    n_params = len(list(transformers.AutoModelForCausalLM.from_pretrained(src).parameters()))
    for rep in _reports(json_dir, 4):
        # Read from the FSDP2 layout, planned for this rank's TP x FSDP placements.
        assert "fsdp2-ws2" in rep["load"]["source"] and "no conversion stored" in rep["load"]["source"], rep["load"]
        assert rep["params_checked"] == n_params
    assert sorted(json.loads((out / "reshard.json").read_text())["layouts"]) == ["fsdp2-ws2"]  # nothing stored

    plan = tmp_path / "qwen2_tp.json"
    _run([sys.executable, "-m", "reshard.parallel_plan", src, "-o", plan, "--fsdp", "dp_shard"])
    _run([reshard_bin, "convert", src, "-o", out, "--mesh", "dp_shard=2,tp=2", "--plan", plan])
    json_dir = tmp_path / "json"
    steps = ["--steps", "16", "--batch-size", "4", "--seq-len", "48", "--lr", "3e-3"]
    save_dir = tmp_path / "saves"
    proc, log = _run(train + steps + ["--check-weights", src, "--check-generate", src, "--json-out", json_dir,
                                      "--save-dir", save_dir, "--save-every", "8"], timeout=600)
    reps = _reports(json_dir, 4)
    assert "no DTensor layout" not in proc.stdout, log
    for r, rep in enumerate(reps):
        assert rep["tp"] == 2 and rep["mesh"] == "dp_shard=2,tp=2", rep
        assert rep["load"]["layout"].startswith("dtensor-dp_shard2.tp2-qwen2_tp."), rep["load"]
        assert rep["load"]["file"].endswith(f"rank-{r:05d}-of-00004.reshard"), rep["load"]
        assert rep["params_checked"] == n_params  # the tie is one parameter, as from_pretrained's
        assert rep["losses"] == reps[0]["losses"] and len(rep["losses"]) == 16
        assert rep["generate"]["generated"] == reps[0]["generate"]["generated"]
        assert all(math.isfinite(g) and g > 0 for g in rep["grad_norms"]), rep["grad_norms"]
    assert "check-weights: " in proc.stdout and "check-generate: " in proc.stdout, log
    first, last = _loss_fell(reps[0]["losses"], 0.3)
    # The same training as plain FSDP2 on two ranks: each tp group draws the batches of the
    # FSDP2 rank of its dp_shard index, and the loss, gradient norm and updates are the same
    # up to the order of TP's sums in bf16 (measured: losses within 0.001 after 4 steps).
    ref_dir = tmp_path / "json-fsdp2"
    _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", out, *steps,
          "--json-out", ref_dir], timeout=600)
    ref = _reports(ref_dir, 2)[0]
    for step, (a, b) in enumerate(zip(reps[0]["losses"], ref["losses"]), 1):
        assert abs(a - b) < 0.03, (step, reps[0]["losses"], ref["losses"])
    for step, (a, b) in enumerate(zip(reps[0]["grad_norms"], ref["grad_norms"]), 1):
        assert abs(a - b) < 0.05 * b, (step, reps[0]["grad_norms"], ref["grad_norms"])
    # reshard.save of the DTensor job at step 8, resumed: the uninterrupted losses, bit for bit.
    saved = json.loads((save_dir / "step-00000008" / "reshard.json").read_text())["layouts"]
    assert any(k.startswith("dtensor-dp_shard2.tp2-saved.") for k in saved), saved
    res_dir = tmp_path / "json-resumed"
    _run(train + steps + ["--resume", save_dir / "step-00000008", "--json-out", res_dir], timeout=600)
    resumed = _reports(res_dir, 4)
    assert resumed[0]["first_step"] == 9 and resumed[0]["losses"] == reps[0]["losses"][8:], \
        (resumed[0]["losses"], reps[0]["losses"])
    print(f"\ntrainer --tp 2 on 4 ranks: loss {first:.3f} -> {last:.3f}; FSDP2 on 2 ranks: "
          f"{ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f}, --tp: {reps[0]['losses'][0]:.4f} -> "
          f"{reps[0]['losses'][-1]:.4f}")


def test_trainer_tp_refuses_what_it_does_not_run():
    from reshard.examples import train

    for extra in (["--fsdp1"], ["--lora", "4"]):
        with pytest.raises(SystemExit):
            train.parse_args(["out", "--tp", "2", *extra])
    with pytest.raises(SystemExit):
        train.parse_args(["out", "--tp", "0"])
    assert train.parse_args(["out", "--tp", "2"]).tp == 2


# ---------------------------------------------------------------------------------------
# Expert parallel: --ep
# ---------------------------------------------------------------------------------------

def test_trainer_expert_parallel_ep2_four_ranks(tmp_path, reshard_bin):
    """--ep 2 on four ranks (reshard.ep: the tiny Mixtral's fused experts Shard(0) over ep=2 and
    fully_shard'ed over efsdp=2, the rest over fsdp=4). OUT holds only the FSDP2 layout of 4
    ranks: the trainer prints the commands that store the job's layouts and reads what is there;
    the weights equal from_pretrained's bit for bit (check-weights), the losses are the same on
    every rank and fall, step by step as FSDP2 alone on two ranks makes them (the same batches:
    each ep group draws those of its efsdp index); saved at step 5 (reshard.save's two layouts)
    and resumed, the losses and gradient norms are the uninterrupted run's bit for bit. Loaded
    from the Hugging Face checkpoint itself and saved after a step of lr 0, both exported layouts
    together are from_pretrained's tensors (in fp32) bit for bit: an independent check of the
    load."""
    import transformers
    from dtensor_common import tiny_mixtral
    from safetensors.torch import load_file

    src, out = tmp_path / "mixtral", tmp_path / "out"
    # Weights 10x transformers' default scale: the experts' share of the gradient is then a good
    # part of the norm (an expert-parallel backward that drops it is off by 7-19 % below).
    tiny_mixtral(src, initializer_range=0.2)
    _run([sys.executable, "-m", "reshard.model_manifest", src, "-o", out / "reshard-model.json"])
    _convert(reshard_bin, src, out, 4)
    train = [TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "reshard.train", out, "--ep", "2"]
    steps = ["--steps", "10", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3"]
    json_dir, save_dir = tmp_path / "json", tmp_path / "saves"
    proc, log = _run(train + steps + ["--check-weights", src, "--json-out", json_dir, "--save-dir", save_dir,
                                      "--save-every", "5"], timeout=600)
    assert "no DTensor layout of the mesh efsdp=2,ep=2" in proc.stdout, log
    for cmd in ("python -m reshard.ep SRC -o mixtral_ep.json",
                f"reshard convert SRC -o {out} --mesh efsdp=2,ep=2 --plan mixtral_ep.json"):
        assert cmd in proc.stdout, log
    assert "expert parallel: experts on mesh efsdp=2,ep=2, the rest on fsdp=4" in proc.stdout, log
    n_params = len(list(transformers.AutoModelForCausalLM.from_pretrained(src).parameters()))
    reps = _reports(json_dir, 4)
    for rep in reps:
        assert rep["ep"] == 2 and rep["mesh"] == "efsdp=2,ep=2" and rep["fsdp_units"] == 5, rep
        assert "resharded while reading to mesh efsdp=2,ep=2" in rep["load"]["source"], rep["load"]
        assert rep["params_checked"] == n_params == 21
        assert rep["losses"] == reps[0]["losses"] and len(rep["losses"]) == 10
        assert all(math.isfinite(g) and g > 0 for g in rep["grad_norms"]), rep["grad_norms"]
    first, last = _loss_fell(reps[0]["losses"], 0.2)
    layouts = sorted(json.loads((save_dir / "step-00000005" / "reshard.json").read_text())["layouts"])
    assert len(layouts) == 2 and layouts[0].startswith("dtensor-efsdp2.ep2-saved.") and layouts[1] == "fsdp2-ws4", \
        layouts
    # FSDP2 alone on two ranks, the same batches: the same training up to bf16 rounding
    # (measured: losses within 0.011, gradient norms within 0.4 % at step 1 and 2.7 % after; with
    # the gradient of the experts' input not summed over ep: 16 % at step 1, 7-19 % after).
    ref_dir = tmp_path / "json-fsdp2"
    _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", src, *steps,
          "--json-out", ref_dir], timeout=600)
    ref = _reports(ref_dir, 2)[0]
    for step, (a, b) in enumerate(zip(reps[0]["losses"], ref["losses"]), 1):
        assert abs(a - b) < 0.03, (step, reps[0]["losses"], ref["losses"])
    for step, (a, b) in enumerate(zip(reps[0]["grad_norms"], ref["grad_norms"]), 1):
        assert abs(a - b) < (0.02 if step == 1 else 0.05) * b, (step, reps[0]["grad_norms"], ref["grad_norms"])
    # Resumed from step 5: the uninterrupted losses and gradient norms, bit for bit.
    res_dir = tmp_path / "json-resumed"
    proc, log = _run(train + steps + ["--resume", save_dir / "step-00000005", "--json-out", res_dir], timeout=600)
    assert "resume: " in proc.stdout and "at step 5" in proc.stdout, log
    resumed = _reports(res_dir, 4)
    for r, rep in enumerate(resumed):
        assert rep["first_step"] == 6, rep["first_step"]
        assert rep["load"]["layout"] == f"{layouts[0]} + fsdp2-ws4", rep["load"]
        assert rep["load"]["file"].endswith(f"step-00000005/{layouts[0]}/rank-{r:05d}-of-00004.reshard"), rep["load"]
        assert rep["losses"] == reps[r]["losses"][5:], (rep["losses"], reps[r]["losses"])
        assert rep["grad_norms"] == reps[r]["grad_norms"][5:]
    # From the Hugging Face checkpoint itself; one step of lr 0 leaves the loaded weights as they
    # are: the save's two layouts, exported, are from_pretrained's tensors.
    once = tmp_path / "once"
    proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "reshard.train", src, "--ep", "2",
                      "--steps", "1", "--lr", "0", "--seq-len", "16", "--save-dir", once, "--save-blocking"],
                     timeout=600)
    assert "read directly (no conversion stored)" in proc.stdout or "through transformers' conversion" in proc.stdout, log
    ckpt = once / "step-00000001"
    got = {}
    for key in json.loads((ckpt / "reshard.json").read_text())["layouts"]:
        _run([reshard_bin, "export", ckpt, "-o", tmp_path / "export" / key, "--layout", key])
        got.update(load_file(str(tmp_path / "export" / key / "model.safetensors")))
    got.pop("model.rotary_emb.inv_freq", None)
    want = transformers.MixtralForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        w = w.float()
        assert got[k].dtype == torch.float32 and torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)), k
    print(f"\ntrainer --ep 2 on 4 ranks: loss {first:.3f} -> {last:.3f}; FSDP2 on 2 ranks: "
          f"{ref['losses'][0]:.4f} -> {ref['losses'][-1]:.4f}, --ep: {reps[0]['losses'][0]:.4f} -> "
          f"{reps[0]['losses'][-1]:.4f}")


def test_trainer_ep_shards_experts_on_dim1_as_torchtitan(tmp_path, reshard_bin):
    """--ep 2 on four ranks of a Mixtral with 2 experts: efsdp 2 x ep 2 > 2 experts, so
    reshard.ep.parallelize fully_shards the experts on tensor dim 1 (torchtitan's rule). OUT
    holds only fsdp2-ws4: the job reads what is there and prints the commands that store its
    layouts; run as printed, they give the layout the next run reads as stored (no resharding),
    the weights equal from_pretrained's bit for bit both times."""
    import shlex

    from dtensor_common import tiny_mixtral

    src, out = tmp_path / "mixtral", tmp_path / "out"
    tiny_mixtral(src, num_local_experts=2)
    _run([sys.executable, "-m", "reshard.model_manifest", src, "-o", out / "reshard-model.json"])
    _convert(reshard_bin, src, out, 4)
    train = [TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "reshard.train", out, "--ep", "2",
             "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--check-weights", src]
    proc, log = _run(train + ["--json-out", tmp_path / "j1"], timeout=600)
    (line,) = [ln for ln in proc.stdout.splitlines() if "To store this job's layouts" in ln]
    commands = line.split("(SRC): ", 1)[1].split(" && ")
    assert commands[0] == "python -m reshard.ep SRC -o mixtral_ep.json --world-size 4 --ep 2", commands
    assert "the rest on fsdp=4; experts fully_shard on tensor dim 1" in proc.stdout, log
    for rep in _reports(tmp_path / "j1", 4):
        assert rep["experts_fsdp_dim"] == 1 and rep["params_checked"] == 21, rep
        assert "resharded while reading to mesh efsdp=2,ep=2" in rep["load"]["source"], rep["load"]
    for cmd in commands:  # as printed, SRC the checkpoint, in a directory of their own
        argv = [str(src) if a == "SRC" else a for a in shlex.split(cmd)]
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [reshard_bin, *argv[1:]]
        subprocess.run(argv, check=True, cwd=tmp_path, env=_env(), capture_output=True, timeout=240)
    plan = json.loads((tmp_path / "mixtral_ep.json").read_text())
    assert [r["fsdp_dim"] for r in plan["rules"]] == [1, 1], plan
    proc, log = _run(train + ["--json-out", tmp_path / "j2"], timeout=600)
    assert "To store this job's layouts" not in proc.stdout, log
    for r, rep in enumerate(_reports(tmp_path / "j2", 4)):
        assert rep["experts_fsdp_dim"] == 1 and rep["params_checked"] == 21, rep
        assert rep["load"]["layout"].startswith("dtensor-efsdp2.ep2-mixtral_ep."), rep["load"]
        assert rep["load"]["layout"].endswith(" + fsdp2-ws4"), rep["load"]
        assert "resharded" not in rep["load"]["source"], rep["load"]


def test_trainer_ep_refuses_what_it_does_not_run(tmp_path, capsys):
    """--ep with --tp / --fsdp1 / --lora is a usage error; a model without fused experts is refused
    under torchrun, one line naming the model class; experts --ep does not divide are refused by
    reshard.ep naming the module, the count and the flag."""
    import transformers
    from accelerate import init_empty_weights

    import reshard
    from reshard import ep
    from reshard.examples import train

    for extra in (["--tp", "2"], ["--fsdp1"], ["--lora", "4"]):
        with pytest.raises(SystemExit):
            train.parse_args(["out", "--ep", "2", *extra])
        assert f"error: --ep 2 with {extra[0]}: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["out", "--ep", "0"])
    assert train.parse_args(["out", "--ep", "2"]).ep == 2
    cfg = dict(vocab_size=37, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    with init_empty_weights():
        three = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=3, **cfg))
        four = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **cfg))
    with pytest.raises(reshard.UnsupportedError) as e:
        ep.fused_experts(three, 2)
    assert str(e.value).startswith("MixtralForCausalLM: model.layers.0.mlp.experts (MixtralExperts) has 3 experts, "
                                   "not divisible by the expert-parallel size 2 (--ep 2)"), e.value
    assert [n for n, _ in ep.fused_experts(four, 2)] == ["model.layers.0.mlp.experts"]
    plan = ep.capture_plan(four, "mixtral_ep")
    assert plan["fsdp"] == {"mesh_dim": "efsdp"} and plan["rules"] == [
        {"pattern": f"model.layers.*.mlp.experts.{p}", "placements": {"ep": "S(0)"}} for p in ep.EXPERT_PARAMS]
    # Under torchrun: one line from rank 0, naming the class; exit code 3 on every rank.
    llama = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(llama)
    proc, log = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reshard.train", llama,
                      "--ep", "2", "--steps", "1"], expect_rc=1)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("reshard.train: ")]
    assert lines == ["reshard.train: LlamaForCausalLM has no fused experts (modules with parameters gate_up_proj "
                     "and down_proj, as transformers' MixtralExperts): expert parallel (--ep) needs a "
                     "mixture-of-experts model"], log
    assert "exitcode  : 3" in proc.stderr, log
    # python -m reshard.ep refuses it too (no plan file written).
    assert ep.main([str(llama), "-o", str(tmp_path / "llama_ep.json")]) == 2
    assert not (tmp_path / "llama_ep.json").exists()


def test_a_seq_len_beyond_the_models_context_is_refused_up_front(tmp_path):
    """GPT-2 with n_positions 16 and the default --seq-len 128: one line naming both and what to
    pass, exit 2 (was an IndexError from torch.embedding in the first step)."""
    import transformers

    src = tmp_path / "gpt2-16"
    cfg = transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(src)
    proc, log = _run([sys.executable, "-m", "reshard.train", src, "--steps", "1"], expect_rc=2)
    assert "reshard.train: --seq-len 128 is longer than the model's context (16 positions" in proc.stderr and \
        "pass --seq-len 16 or less" in proc.stderr, log
    assert "Traceback" not in proc.stderr, log
