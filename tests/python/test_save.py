"""reshard.save / reshard.load_optimizer and reshard.train --save-dir/--resume on CPU: FSDP2 in
several processes (torchrun --standalone, gloo), checkpoints written by transformers itself.

* convert → load → save (world sizes 2 and 3): the saved rank files hold exactly the converted
  tensors (names, shapes, shards, dtypes, bytes, chunk checksums), and `reshard verify` passes;
* after training steps: save → load into a fresh model (and optimizer) gives the same
  full_tensor()s and state, and the next step the same loss (save_worker.py checks);
* HSDP 2x2: only replica 0 of each shard coordinate writes;
* resume: 2N steps uninterrupted and N steps + save (blocking) + resume N steps with
  asynchronous saves give identical losses; --keep 1 leaves only the newest checkpoint;
* a save killed mid-write (SIGKILL of one rank) leaves no manifest and nothing that verifies
  or loads, the previous checkpoint intact, and a re-run completes it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

import reshard
import reference_reader as rf

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
from dist_util import TORCHRUN, dist_env as _env, torchrun as _torchrun  # noqa: E402,F401


def _save_worker(nproc, out, save, result, *extra):
    os.makedirs(result, exist_ok=True)
    _torchrun(nproc, os.path.join(HERE, "save_worker.py"), "--out", out, "--save", save,
              "--result", result, *extra)
    return [json.load(open(os.path.join(result, f"rank-{r}.json"))) for r in range(nproc)]


def _layout_files(out, key):
    m = rf.read_manifest(str(out))
    assert m["layouts"][key]["complete"]
    return {r["rank"]: os.path.join(out, key, r["file"]) for r in m["layouts"][key]["ranks"]}


@pytest.mark.parametrize("arch,dtype,sharded,world", [("llama", "bf16", True, 2),
                                                      ("qwen2", "fp32", False, 3)])
def test_save_after_load_is_the_converted_layout(checkpoint, cli, tmp_path, arch, dtype, sharded, world):
    src = checkpoint(arch, dtype, sharded)
    out, saved = tmp_path / "out", tmp_path / "saved"
    cli("convert", src, "-o", out, "--world-size", world, rc=0)
    _save_worker(world, out, saved, tmp_path / "result")
    key = f"fsdp2-ws{world}"
    conv, mine = _layout_files(out, key), _layout_files(saved, key)
    assert sorted(conv) == sorted(mine) == list(range(world))
    for r in range(world):
        a, b = rf.RankFile.open(conv[r]), rf.RankFile.open(mine[r])
        assert b.header["rank"] == r and b.header["layout"]["key"] == key
        assert b.header["layout"]["dtype"] == "keep"
        assert b.header["source"]["files"] == [] and "saved" in b.header["source"]
        ta = {t["name"]: t for t in a.header["tensors"]}
        tb = {t["name"]: t for t in b.header["tensors"]}
        assert sorted(ta) == sorted(tb), sorted(set(ta) ^ set(tb))
        for name, t in ta.items():
            u = tb[name]
            for field in ("dtype", "global_shape", "shard", "local_shape", "nbytes", "chunk_xxh3", "xxh3"):
                assert t[field] == u[field], (r, name, field, t[field], u[field])
            assert a.read_bytes(name) == b.read_bytes(name), (r, name)
    cli("verify", saved, rc=0)
    manifest = rf.read_manifest(str(saved))
    assert manifest["source"]["saved"]["step"] == 0
    # The config and tokenizer files of OUT came along.
    assert set(manifest["aux_files"]) == set(rf.read_manifest(str(out))["aux_files"])
    for a in manifest["aux_files"]:
        assert (saved / a).read_bytes() == (out / a).read_bytes()
    # A saved checkpoint is not a conversion of SRC: --source says so.
    r = cli("verify", saved, "--source", src, rc=1)
    assert "converted from source" in r.text
    # And it refuses to be saved over.
    model = reshard.empty_model(str(saved))
    model.to_empty(device="cpu")
    with pytest.raises(reshard.InvalidArgumentError, match="already holds a checkpoint"):
        reshard.save(model, str(saved))


def test_trained_model_and_optimizer_round_trip(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", True)
    out, saved = tmp_path / "out", tmp_path / "saved"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    reports = _save_worker(2, out, saved, tmp_path / "result", "--steps", 3, "--dtype", "float32")
    for r in reports:
        assert r["params_checked"] > 0 and r["wrote"] and r["optimizer_file"]
        assert r["losses"][-1] < r["losses"][0]
    cli("verify", saved, rc=0)
    cli("verify", saved / "fsdp2-ws2" / "optim", rc=0)
    opt = rf.RankFile.open(saved / "fsdp2-ws2" / "optim" / "rank-00001-of-00002.reshard")
    names = {t["name"]: t for t in opt.header["tensors"]}
    assert names["model.embed_tokens.weight#exp_avg"]["dtype"] == "F32"
    assert names["model.embed_tokens.weight#exp_avg"]["shard"] == {"dim": 0, "start": 19, "end": 37}
    assert names["model.embed_tokens.weight#step"]["shard"] is None
    assert torch.frombuffer(bytearray(opt.read_bytes("model.embed_tokens.weight#step")),
                            dtype=torch.float32).item() == 3.0
    meta = json.load(open(saved / "fsdp2-ws2" / "optim" / "optimizer.json"))
    assert meta["class"] == "AdamW" and meta["step"] == 3
    assert meta["param_groups"][0]["betas"] == [0.8, 0.95]
    # The model file holds the trained fp32 master weights.
    model = rf.RankFile.open(saved / "fsdp2-ws2" / "rank-00000-of-00002.reshard")
    assert {t["dtype"] for t in model.header["tensors"]} == {"F32"}


def test_hsdp_only_replica_zero_writes(checkpoint, cli, tmp_path):
    src = checkpoint("qwen2", "bf16", True)
    out, saved = tmp_path / "out", tmp_path / "saved"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    reports = _save_worker(4, out, saved, tmp_path / "result", "--hsdp", 2)
    # Global rank g is replica g // 2, shard coordinate g % 2 on a (2, 2) mesh.
    assert [r["wrote"] for r in reports] == [True, True, False, False]
    assert [os.path.basename(r["file"]) if r["file"] else None for r in reports] == \
        ["rank-00000-of-00002.reshard", "rank-00001-of-00002.reshard", None, None]
    assert sorted(os.listdir(saved / "fsdp2-ws2")) == ["rank-00000-of-00002.reshard",
                                                       "rank-00001-of-00002.reshard"]
    cli("verify", saved, rc=0)


def _train(out, nproc, json_dir, *extra):
    proc = _torchrun(nproc, "-m", "reshard.train", out, "--seq-len", 32, "--batch-size", 2,
                     "--lr", 3e-3, "--warmup-steps", 2, "--grad-accum", 2, "--json-out", json_dir,
                     *extra, timeout=400)
    return [json.load(open(os.path.join(json_dir, f"rank-{r}.json"))) for r in range(nproc)], proc


def test_resume_gives_the_uninterrupted_losses(checkpoint, cli, tmp_path):
    src = checkpoint("llama", "bf16", True)
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    whole, _ = _train(out, 2, tmp_path / "whole", "--steps", 6)
    saves = tmp_path / "saves"
    first, proc = _train(out, 2, tmp_path / "first", "--steps", 3, "--save-dir", saves, "--save-blocking")
    assert "save: step 3 -> " in proc.stdout and "blocking: stall" in proc.stdout
    assert first[0]["checkpoints"] == [str(saves / "step-00000003")]
    cli("verify", saves / "step-00000003", rc=0)
    # Asynchronous saves (the default), the older checkpoints pruned once newer ones commit.
    second, proc = _train(out, 2, tmp_path / "second", "--steps", 6, "--resume", saves,
                          "--save-dir", saves, "--save-every", 2, "--keep", 1)
    assert "resume:" in proc.stdout and "at step 3" in proc.stdout
    assert "save: step 4 -> " in proc.stdout and "asynchronous: stall" in proc.stdout
    assert "save: step 6 committed" in proc.stdout
    assert second[0]["first_step"] == 4
    assert second[0]["checkpoints"] == [str(saves / "step-00000004"), str(saves / "step-00000006")]
    assert sorted(os.listdir(saves)) == ["step-00000006"]
    for r in range(2):
        assert len(whole[r]["losses"]) == 6 and len(second[r]["losses"]) == 3
        # Exactly: same weights, optimizer state, data order and learning rates.
        assert first[r]["losses"] == whole[r]["losses"][:3]
        assert second[r]["losses"] == whole[r]["losses"][3:], (second[r]["losses"], whole[r]["losses"])
        assert second[r]["grad_norms"] == whole[r]["grad_norms"][3:]
    cli("verify", saves / "step-00000006", rc=0)


def test_killed_save_leaves_no_checkpoint(checkpoint, cli, tmp_path):
    src = checkpoint("qwen2", "fp32", False)
    out, good, bad = tmp_path / "out", tmp_path / "good", tmp_path / "bad"
    cli("convert", src, "-o", out, "--world-size", 2, rc=0)
    _save_worker(2, out, good, tmp_path / "r1")
    good_files = {p: open(p, "rb").read() for p in glob.glob(str(good / "**" / "*"), recursive=True)
                  if os.path.isfile(p)}

    result = tmp_path / "r2"
    result.mkdir()
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", os.path.join(HERE, "save_worker.py"),
           "--out", str(out), "--save", str(bad), "--result", str(result), "--mode", "interrupted"]
    proc = subprocess.Popen(cmd, env=_env(RESHARD_TEST_SAVE_PAUSE="0.3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.time() + 240
        temps = []
        while time.time() < deadline and proc.poll() is None:
            temps = glob.glob(str(bad / "fsdp2-ws2" / ".rank-*.tmp-*"))
            if len(temps) == 2 and all(os.path.exists(result / f"pid-{r}") for r in range(2)):
                break
            time.sleep(0.05)
        assert len(temps) == 2, "both ranks should be writing: " + (proc.communicate()[1] or "")[-4000:]
        time.sleep(0.5)  # a few tensors into the files
        os.kill(int((result / "pid-1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert not (bad / "reshard.json").exists()
    assert not (bad / "fsdp2-ws2" / "rank-00001-of-00002.reshard").exists()
    cli("verify", bad, rc=1)
    cli("verify", bad / "fsdp2-ws2", rc=1)
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    with pytest.raises(reshard.NotFoundError, match="no reshard.json"):
        reshard.load(model, str(bad))
    # The previous checkpoint is untouched and still verifies.
    assert good_files == {p: open(p, "rb").read() for p in good_files}
    cli("verify", good, rc=0)
    # A re-run of the save completes the interrupted checkpoint, and removes the full-size
    # temporaries the killed processes left.
    assert glob.glob(str(bad / "fsdp2-ws2" / ".rank-*.tmp-*"))
    _save_worker(2, out, bad, tmp_path / "r3")
    cli("verify", bad, rc=0)
    assert not glob.glob(str(bad / "fsdp2-ws2" / ".rank-*.tmp-*"))


@pytest.mark.gpu
def test_save_from_cuda_through_small_staging(checkpoint, cli, tmp_path):
    """Device tensors go device → pinned staging → file in pieces (8 KiB of staging here, so
    every larger tensor takes several, double-buffered): the saved bytes are the live ones."""
    assert torch.cuda.is_available(), "GPU test selected on a machine without CUDA"
    assert reshard.build_info()["cuda"], "reshard was built without CUDA"
    src = checkpoint("llama", "bf16", True)
    out, saved = tmp_path / "out", tmp_path / "saved"
    cli("convert", src, "-o", out, "--world-size", 1, rc=0)
    model = reshard.empty_model(str(out), dtype=torch.float32)
    model.to_empty(device="cuda")
    reshard.load(model, str(out))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = (torch.arange(32, device="cuda").reshape(2, 16) * 7) % model.config.vocab_size
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    report = reshard.save(model, str(saved), optimizer=opt, step=2, source=str(out),
                          staging_bytes=8192)
    assert report.staging_bytes == 8192
    cli("verify", saved, rc=0)
    cpu = reshard.empty_model(str(saved), dtype=torch.float32)
    cpu.to_empty(device="cpu")
    reshard.load(cpu, str(saved))
    live = dict(model.named_parameters())
    for name, p in cpu.named_parameters():
        assert torch.equal(p, live[name].detach().cpu()), name
    fresh = reshard.empty_model(str(saved), dtype=torch.float32)
    fresh.to_empty(device="cuda")
    reshard.load(fresh, str(saved))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    reshard.load_optimizer(opt2, fresh, str(saved))
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        for k, v in opt.state[p].items():
            assert v.device == opt2.state[q][k].device and torch.equal(v, opt2.state[q][k]), (n, k)


def _loaded_plain_qwen2(checkpoint, cli, tmp_path):
    """Qwen2 fp32 converted for world size 1 into tmp_path/out and loaded into a plain module."""
    out = tmp_path / "out"
    cli("convert", checkpoint("qwen2", "fp32", False), "-o", out, "--world-size", 1, rc=0)
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    reshard.load(model, str(out))
    return model


def test_plain_module_save_and_saved_source_checked(checkpoint, cli, tmp_path):
    """One process, no process group, a plain module (world size 1); the saved source's
    fingerprint is checked by the C++ reader and by the independent Python reader."""
    saved = tmp_path / "saved"
    model = _loaded_plain_qwen2(checkpoint, cli, tmp_path)
    report = reshard.save(model, str(saved), step=7)
    assert report.wrote and report.layout == "fsdp2-ws1" and report.optimizer_file is None
    # No source given: config.json (and generation_config.json) come from the model.
    assert json.loads((saved / "config.json").read_text())["hidden_size"] == model.config.hidden_size
    cli("verify", saved, rc=0)
    fresh = reshard.empty_model(str(saved))
    fresh.to_empty(device="cpu")
    reshard.load(fresh, str(saved))
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    text = (saved / "reshard.json").read_text()
    assert '"step": 7' in text
    (saved / "reshard.json").write_text(text.replace('"step": 7', '"step": 8'))
    r = cli("verify", saved, rc=1)
    assert "computed from source.saved" in r.text
    with pytest.raises(rf.FormatError, match="computed from source.saved"):
        rf.read_manifest(str(saved))


def test_verify_of_a_damaged_save_says_save_again_not_convert(checkpoint, cli, tmp_path):
    """A truncated or missing rank file of a checkpoint saved from training is one problem, and
    the remedy is a new save (there is no source to convert from), not `reshard convert`."""
    saved = tmp_path / "saved"
    reshard.save(_loaded_plain_qwen2(checkpoint, cli, tmp_path), str(saved), step=3)
    rank_file = saved / "fsdp2-ws1" / "rank-00000-of-00001.reshard"
    os.truncate(rank_file, 4000)
    r = cli("verify", saved, rc=1)
    assert "(truncated); this checkpoint, saved from training, is damaged or incomplete: save it again" in r.out, r
    assert "FAILED: 1 problem(s)" in r.out and "reshard convert" not in r.out, r
    rank_file.unlink()
    r = cli("verify", saved, rc=1)
    assert "listed in the manifest but missing; this checkpoint, saved from training" in r.out, r
    assert "FAILED: 1 problem(s)" in r.out, r


def _plain_cross_dtype(out, saved, save_dtype, load_dtype):
    """A plain module of `save_dtype` loaded from OUT, 2 AdamW steps, saved with the optimizer;
    a plain module of `load_dtype` loads the save and its optimizer: the state as torch's
    load_state_dict casts it (saved.to(load_dtype); `step` as saved), and a step runs."""
    model = reshard.empty_model(str(out), dtype=save_dtype)
    model.to_empty(device="cpu")
    reshard.load(model, str(out))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(32).reshape(2, 16) % model.config.vocab_size
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    reshard.save(model, str(saved), optimizer=opt, step=2)
    # Every file of the save is readable as the process's umask allows (mkstemp's 0600 was
    # left on the JSON files: others sharing the checkpoint could not read its config).
    mask = os.umask(0o022)
    os.umask(mask)
    for root, _, names in os.walk(saved):
        for n in names:
            mode = os.stat(os.path.join(root, n)).st_mode & 0o777
            assert mode == 0o666 & ~mask, (os.path.join(root, n), oct(mode), oct(mask))
    fresh = reshard.empty_model(str(saved), dtype=load_dtype)
    fresh.to_empty(device="cpu")
    reshard.load(fresh, str(saved))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert reshard.load_optimizer(opt2, fresh, str(saved)) == len(opt.state)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert q.dtype == load_dtype
        st, st2 = opt.state[p], opt2.state[q]
        assert sorted(st) == sorted(st2) == ["exp_avg", "exp_avg_sq", "step"], (n, sorted(st2))
        assert st2["step"].dtype == st["step"].dtype and torch.equal(st2["step"], st["step"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            want = st[k].to(load_dtype)  # what torch's Optimizer.load_state_dict makes of it
            assert st2[k].dtype == load_dtype and st2[k].device == q.device, (n, k, st2[k].dtype)
            assert torch.equal(st2[k].view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), (n, k)
    fresh(input_ids=ids, labels=ids).loss.backward()
    opt2.step()  # the first step of the resumed job: the state's dtype is the parameters'
    assert all(v.dtype == q.dtype for q, st in opt2.state.items() for k, v in st.items() if k != "step")
    # An optimizer over other parameters than the save's is refused, naming them.
    named = list(fresh.named_parameters())
    for params, said in (
            ([p for n, p in named if "embed" not in n], r"1 saved parameter\(s\) not in it \('model.embed_tokens.weight'\)"),
            ([p for _, p in reversed(named)], r"the same \d+ parameters in another order \(position 0: saved "
                                               r"'model.embed_tokens.weight'"),
            ([p for _, p in named] + [torch.nn.Parameter(torch.zeros(2))],
             r"1 of its parameter\(s\) not saved \(a tensor that is no parameter of the model\)")):
        with pytest.raises(reshard.LayoutMismatchError, match=r"param_groups\[0\] holds other parameters than the "
                                                             r"optimizer's: " + said):
            reshard.load_optimizer(torch.optim.AdamW(params, lr=1e-2), fresh, str(saved))


def test_load_optimizer_casts_state_to_the_live_dtype(checkpoint, cli, tmp_path):
    """reshard.load_optimizer follows torch's Optimizer.load_state_dict: state tensors other than
    `step` end in the live parameter's dtype (saved.to(param.dtype), bit for bit), so that a bf16
    job's save resumes in an fp32 job and the other way round. A plain module in this process;
    FSDP2 over 2 ranks and tensor parallel tp=2 in optim_dtype_worker.py."""
    from dtensor_common import llama_plan, tiny_llama

    out = tmp_path / "out"
    cli("convert", checkpoint("qwen2", "fp32", False), "-o", out, "--world-size", 1, rc=0)
    _plain_cross_dtype(out, tmp_path / "plain-fp32", torch.float32, torch.bfloat16)
    _plain_cross_dtype(out, tmp_path / "plain-bf16", torch.bfloat16, torch.float32)
    # The save's own optimizer state gone, a relayout-made copy holding it: load_optimizer names
    # the way back (relayout alone refuses to rewrite the save's own layout), which works.
    saved = tmp_path / "plain-fp32"
    (key,) = reshard.layout.read_manifest(str(saved))["layouts"]
    cli("relayout", saved, "--world-size", 2, rc=0)
    shutil.rmtree(saved / key / "optim")
    model = reshard.empty_model(str(saved), dtype=torch.float32)
    model.to_empty(device="cpu")
    reshard.load(model, str(saved))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(reshard.NotFoundError) as e:
        reshard.load_optimizer(opt, model, str(saved))
    fix = f"reshard remove {saved} {key}, then reshard relayout {saved} --world-size 1 --from fsdp2-ws2"
    assert fix in str(e.value), str(e.value)
    cli("remove", saved, key, rc=0)
    cli("relayout", saved, "--world-size", 1, "--from", "fsdp2-ws2", rc=0)
    assert reshard.load_optimizer(opt, model, str(saved)) > 0

    src, out_fsdp, out_tp, work, result = (tmp_path / n for n in ("src", "out-fsdp", "out-tp", "work", "result"))
    tiny_llama(src)
    (tmp_path / "plan.json").write_text(json.dumps(llama_plan("llama_tp_rowemb", row_embeddings=True)))
    cli("convert", src, "-o", out_fsdp, "--world-size", 2, rc=0)
    cli("convert", src, "-o", out_tp, "--mesh", "tp=2", "--plan", tmp_path / "plan.json", rc=0)
    work.mkdir()
    result.mkdir()
    _torchrun(2, os.path.join(HERE, "optim_dtype_worker.py"), out_fsdp, out_tp, work, result)
    recs = [json.load(open(result / f"rank-{r}.json")) for r in range(2)]
    for r in recs:
        for kind in ("fsdp2", "tp"):
            for tag in (f"{kind}-bfloat16-to-float32", f"{kind}-float32-to-bfloat16"):
                assert r[tag]["checked"] > 0, (r["rank"], tag, r[tag])
