"""Asynchronous reshard.save (blocking=False) on CPU: FSDP2 in several processes (torchrun
--standalone, gloo), async_save_worker.py.

* Saves every step while training goes on (writes slowed by RESHARD_TEST_SAVE_PAUSE so that
  the next steps change every parameter while the files are written): every committed
  checkpoint holds exactly the model (parameters, buffer) and optimizer state of its step,
  read back by the independent reference reader and compared with full tensors the job
  gathered at that step; a resume from each gives the uninterrupted run's losses.
* SIGKILL of a rank at random moments, 30 times, with background writes in flight: the newest
  checkpoint that is committed verifies and holds its step's state, nothing uncommitted
  verifies, and the next run resumes from it with the uninterrupted losses.
* A write that fails in the background (RLIMIT_FSIZE: EFBIG, as on a full disk): the error
  reaches wait() on every rank, and the next save when nothing waited; nothing is committed.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import reference_reader as rf
from dist_util import REPO, dist_env, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "async_save_worker.py")


def _results(result, nproc):
    return [json.load(open(os.path.join(result, f"rank-{r}.json"))) for r in range(nproc)]


def _losses(result, rank=0):
    out = {}
    with open(os.path.join(result, f"losses-{rank}.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            out[d["step"]] = d["loss"]
    return out


def _saved_state(ckpt):
    """name -> full tensor of a saved checkpoint, assembled from its rank files by the
    reference reader (parameters, buffers; optimizer state as "<param>#<key>")."""
    m = rf.read_manifest(str(ckpt))
    (key, layout), = m["layouts"].items()
    assert layout["complete"]
    full = {}
    for sub in ("", "optim"):
        d = os.path.join(ckpt, key, sub)
        pieces = {}
        for r in range(layout["world_size"]):
            f = rf.RankFile.open(os.path.join(d, rf.rank_file_name(r, layout["world_size"])))
            f.verify_data()
            for t in f.header["tensors"]:
                pieces.setdefault(t["name"], []).append((t["shard"], f.read_tensor(t["name"])))
        for name, parts in pieces.items():
            if parts[0][0] is None:  # whole on every rank: all equal
                for _, t in parts[1:]:
                    assert torch.equal(t, parts[0][1]), name
                full[name] = parts[0][1]
            else:
                parts.sort(key=lambda p: p[0]["start"])
                full[name] = torch.cat([t for _, t in parts], 0)
    return full


def _assert_state_equal(saved, ref, what):
    from safetensors.torch import load_file

    want = load_file(ref)
    assert sorted(saved) == sorted(want), (what, sorted(saved), sorted(want))
    for k, v in want.items():
        got = saved[k].reshape(v.shape)
        assert got.dtype == v.dtype and torch.equal(got.reshape(-1).view(torch.uint8),
                                                    v.reshape(-1).view(torch.uint8)), f"{what}: {k}"


def test_async_saves_hold_the_state_of_their_step(tmp_path):
    saves, dump, result = tmp_path / "saves", tmp_path / "dump", tmp_path / "result"
    dump.mkdir()
    result.mkdir()
    steps = 4
    torchrun(2, WORKER, "--save-dir", saves, "--result", result, "--steps", steps, "--dump", dump,
             env={"RESHARD_TEST_SAVE_PAUSE": "0.03"}, timeout=300)
    reports = _results(result, 2)
    # The calls returned before the files were written (the next steps ran meanwhile).
    assert all(r["pending_after_return"] >= steps - 1 for r in reports), reports
    assert all(r["last_stall"] < r["last_durable"] for r in reports), reports
    assert {r["last_snapshot"] for r in reports} == {"host"}  # CPU tensors: the host buffer
    for s in range(1, steps + 1):
        ckpt = saves / f"step-{s:08d}"
        _assert_state_equal(_saved_state(ckpt), dump / f"step-{s}.safetensors", f"step {s}")
    # A resume from each checkpoint gives the uninterrupted run's losses.
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps(_losses(result)))
    r2 = tmp_path / "r2"
    r2.mkdir()
    torchrun(2, WORKER, "--mode", "resume_all", "--save-dir", saves, "--result", r2, "--steps", steps,
             "--expect", expect, timeout=300)
    assert _results(r2, 2)[0]["resumed_from"] == list(range(1, steps + 1))


def test_background_write_error_reaches_wait_and_the_next_save(tmp_path, cli):
    saves, result = tmp_path / "saves", tmp_path / "result"
    result.mkdir()
    torchrun(2, WORKER, "--mode", "diskfull", "--save-dir", saves, "--result", result, timeout=300)
    for r, out in enumerate(_results(result, 2)):
        assert out["a"].startswith("ReshardIOError") and "failed on rank 1" in out["a"], out
        assert "File too large" in out["a"] or "EFBIG" in out["a"] or "too large" in out["a"], out
        assert out["b"].startswith("ReshardIOError") and "previous asynchronous reshard.save" in out["b"] \
            and str(saves / "b") in out["b"], out
    for d in ("a", "b"):  # nothing partial is committed
        assert not (saves / d / "reshard.json").exists()
        assert not (saves / d / "fsdp2-ws2" / "rank-00001-of-00002.reshard").exists()
        cli("verify", saves / d, rc=1)
    cli("verify", saves / "c", rc=0)
    _assert_state_equal(_saved_state(saves / "c"), result / "c.safetensors", "c")


def _committed(saves):
    return sorted(int(os.path.basename(p)[5:]) for p in glob.glob(str(saves / "step-*"))
                  if os.path.exists(os.path.join(p, "reshard.json")))


def _plain_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))


def test_one_process_handle_and_the_fallback_without_room(tmp_path, cli, monkeypatch):
    """World size 1, no process group: the handle's API; the next save waits for the one in
    flight; with no room for a host snapshot, "auto" writes before returning (warning)."""
    import reshard
    from reshard import engine

    model = _plain_model()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setenv("RESHARD_TEST_SAVE_PAUSE", "0.2")
    h = reshard.save(model, tmp_path / "a", blocking=False)
    assert not h.done() and "writing" in repr(h) and h.snapshot == "host"
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.01)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    time.sleep(0.3)  # the writer has read the pause (each tensor waits 0.2 s)
    monkeypatch.setenv("RESHARD_TEST_SAVE_PAUSE", "0")
    h2 = reshard.save(model, tmp_path / "b", blocking=False)  # waits for the first
    assert h.done() and h.wait().file and "committed" in repr(h)
    assert reshard.wait_pending().out == str(tmp_path / "b") and h2.done()
    assert reshard.wait_pending() is None
    for d in ("a", "b"):
        cli("verify", tmp_path / d, rc=0)
    saved = rf.RankFile.open(tmp_path / "a" / "fsdp2-ws1" / "rank-00000-of-00001.reshard")
    for n, v in want.items():
        assert torch.equal(saved.read_tensor(n), v), n  # the values of the call, not the later ones
    monkeypatch.setattr(engine, "host_snapshot_fits", lambda nbytes: False)
    with pytest.warns(UserWarning, match="no room for a snapshot"):
        h3 = reshard.save(model, tmp_path / "c", blocking=False)
    assert h3.done() and h3.snapshot == "none" and h3.wait().blocking
    cli("verify", tmp_path / "c", rc=0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_job(nproc, args, **env):
    """The worker's ranks as processes of one gloo job, started directly (what torchrun
    would do, without its own start-up and teardown: a kill loop runs many jobs)."""
    port = _free_port()
    procs = []
    for r in range(nproc):
        e = dist_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                     WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), **env)
        procs.append(subprocess.Popen([sys.executable, WORKER, *map(str, args)], env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, cwd=REPO))
    return procs


def test_sigkill_during_background_writes_30_times(tmp_path, cli):
    # The uninterrupted run: losses and full state of every step (no saves).
    ref_steps = 80
    ref, dump = tmp_path / "ref", tmp_path / "dump"
    ref.mkdir()
    dump.mkdir()
    torchrun(2, WORKER, "--save-dir", tmp_path / "none", "--result", ref, "--steps", ref_steps, "--dump", dump,
             "--no-save", timeout=300)
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps(_losses(ref)))
    saves = tmp_path / "saves"
    rng = random.Random(20261202)
    in_flight = 0
    resumed = []
    for i in range(30):
        result = tmp_path / f"run-{i}"
        result.mkdir()
        procs = _start_job(2, ["--save-dir", saves, "--result", result, "--steps", 10 ** 6, "--resume",
                               "--expect", expect], RESHARD_TEST_SAVE_PAUSE="0.02")
        errs = []
        try:
            deadline = time.time() + 120
            while time.time() < deadline and all(p.poll() is None for p in procs) and \
                    not all(os.path.exists(result / f"pid-{r}") for r in range(2)):
                time.sleep(0.02)
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            time.sleep(rng.uniform(0.0, 1.5))
            in_flight += bool(glob.glob(str(saves / "step-*" / "fsdp2-ws2" / "**" / ".rank-*.tmp-*"),
                                        recursive=True))
            victim = rng.randrange(2)
            procs[victim].send_signal(signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.3))  # the survivor runs on until the launcher stops it
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            errs = [p.communicate(timeout=60)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert not glob.glob(str(result / "FAIL-*")), (i, [open(p).read() for p in glob.glob(str(result / "FAIL-*"))])
        start = int((result / "start-0").read_text())
        steps = _committed(saves)
        # This run resumed from the newest committed checkpoint of the previous one.
        assert start == (resumed[-1] if resumed else 0) + 1, (i, start, resumed, [e[-2000:] for e in errs])
        newest = steps[-1] if steps else 0  # 0: killed before its first save committed
        resumed.append(newest)
        assert newest < ref_steps, "the reference run is too short for this many steps"
        if newest:
            ckpt = saves / f"step-{newest:08d}"
            cli("verify", ckpt, rc=0)
            _assert_state_equal(_saved_state(ckpt), dump / f"step-{newest}.safetensors",
                                f"run {i}, step {newest}")
        newer = saves / f"step-{newest + 1:08d}"
        if newer.exists():  # the save that was in flight: not committed, does not verify
            assert not (newer / "reshard.json").exists()
            cli("verify", newer, rc=1)
    # Most kills hit a background write, and the training made progress across the kills.
    assert in_flight >= 15, in_flight
    assert resumed[-1] >= 10, resumed


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "host", "auto"])
def test_async_save_from_cuda_snapshot(checkpoint, cli, tmp_path, where):
    """On a GPU: the snapshot in new device memory or in the pinned host buffer holds the
    values of the call, although every parameter and state tensor is overwritten right after
    it returns; the saved checkpoint loads back to exactly those values."""
    import reshard

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
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_state = {(n, k): v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    h = reshard.save(model, str(saved), optimizer=opt, step=1, source=str(out), blocking=False,
                     snapshot=where)
    assert h.snapshot == ("device" if where == "auto" else where)  # a tiny model fits the GPU
    with torch.no_grad():  # the job goes on and changes everything at once
        for p in model.parameters():
            p.add_(1.0)
            for v in opt.state[p].values():
                v.add_(1.0)
    report = h.wait()
    assert report.snapshot == h.snapshot and not report.blocking
    assert report.stall_seconds <= report.durable_seconds
    cli("verify", saved, rc=0)
    fresh = reshard.empty_model(str(saved), dtype=torch.float32)
    fresh.to_empty(device="cuda")
    reshard.load(fresh, str(saved))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    reshard.load_optimizer(opt2, fresh, str(saved))
    for n, p in fresh.named_parameters():
        assert torch.equal(p, want[n]), n
        for k, v in opt2.state[p].items():
            assert torch.equal(v, want_state[(n, k)]), (n, k)
