"""Issue 25's hostile inputs through the CLI and the Python API: a source manifest whose
aux_files name paths (reshard.save wrote outside OUT), deeply nested manifests (RecursionError
or a crash instead of ReshardError), FIFOs as weight, index, rank files (hangs), convert into a
directory holding someone else's files, copies that widened permissions, and terminal escape
sequences in tensor names reaching inspect's output. Each command runs under a time limit:
a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest

import reshard


@pytest.fixture(scope="module")
def converted(tmp_path_factory, reshard_bin):
    """A small checkpoint converted to fsdp2-ws1 (shared, never modified: tests copy it)."""
    import subprocess

    from checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("hostile")
    src = root / "src"
    make_checkpoint(str(src), "qwen2", "fp32", False)
    out = root / "out"
    subprocess.run([reshard_bin, "convert", str(src), "-o", str(out), "--world-size", "1"],
                   check=True, capture_output=True, timeout=120)
    return src, out


def _copy_tree(a, b):
    import shutil

    shutil.copytree(a, b, symlinks=True)
    return b


def _edit_manifest(out, edit):
    p = out / "reshard.json"
    m = json.loads(p.read_text())
    edit(m)
    p.write_text(json.dumps(m, indent=2) + "\n")


def _model(out):
    model = reshard.empty_model(str(out))
    model.to_empty(device="cpu")
    return model


# ---- 1. aux_files that are paths ----------------------------------------------------------

@pytest.mark.parametrize("name", ["../../escape.txt", "/tmp/reshard-hostile-absolute.txt",
                                  "sub/../../escape.txt", "tok\x1b[2J.json"])
def test_aux_file_path_is_refused_by_verify_load_and_save(converted, cli, tmp_path, name):
    src, good = converted
    out = _copy_tree(good, tmp_path / "a" / "b" / "out")
    model = _model(good)
    reshard.load(model, str(good))
    _edit_manifest(out, lambda m: m["aux_files"].append(name))
    # The file the name points at exists, so nothing stops at "missing".
    target = os.path.normpath(os.path.join(out, name)) if not name.startswith("/") else name
    if "\x1b" not in name:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write("attacker content")
    try:
        shown = json.dumps(name).replace("\\u001b", "\\x1b")
        r = cli("verify", out, rc=1)
        assert "reshard.json" in r.text and "aux_files[" in r.text and shown in r.text, r.text
        assert "expected a plain file name" in r.text, r.text
        assert "\x1b" not in r.text
        with pytest.raises(reshard.ReshardError, match=r"aux_files\["):
            reshard.load(_model(good), str(out))
        saved = tmp_path / "c" / "d" / "saved"
        with pytest.raises(reshard.ReshardError, match=r"aux_files\["):
            reshard.save(model, str(saved), source=str(out))
        # Nothing written beside or above OUT: the escape target of `saved` does not exist.
        escaped = os.path.normpath(os.path.join(saved, name))
        if not name.startswith("/"):
            assert not os.path.exists(escaped), escaped
        assert not (saved / "reshard.json").exists()
    finally:
        if name.startswith("/") and os.path.exists(target):
            os.remove(target)


# ---- 2. deep nesting ----------------------------------------------------------------------

def test_deep_manifest_is_a_reshard_error_not_a_crash(converted, cli, tmp_path):
    src, good = converted
    out = _copy_tree(good, tmp_path / "out")
    text = (out / "reshard.json").read_text().rstrip()
    assert text.endswith("}")
    deep = "[" * 100000 + "]" * 100000  # 200 KB: SIGSEGV in every reader before the limit
    (out / "reshard.json").write_text(text[:-1] + ', "extra": ' + deep + "}\n")
    for cmd in (("verify", out), ("inspect", out)):
        r = cli(*cmd, timeout=60)
        assert r.rc in (1, 3), r.text
        assert "nested more than 64 levels" in r.text and "reshard.json" in r.text, r.text
    with pytest.raises(reshard.ReshardError, match="nested more than 64 levels"):
        reshard.load(_model(good), str(out))
    # The safetensors header of the source, the index, config.json for export --dtype too.
    bad = tmp_path / "deep.safetensors"
    header = b'{"w":' + deep.encode() + b"}"
    bad.write_bytes(struct.pack("<Q", len(header)) + header)
    r = cli("inspect", bad, timeout=60)
    assert r.rc == 3 and "nested more than 64 levels" in r.text, r.text
    exp = _copy_tree(good, tmp_path / "exp")
    (exp / "config.json").write_text('{"dtype": "float32", "x": ' + deep + "}")
    r = cli("export", exp, "-o", tmp_path / "hf", "--dtype", "bf16", timeout=60)
    assert r.rc != 0 and "config.json" in r.text and "nested more than 64" in r.text, r.text


# ---- 4. special files and permissions -------------------------------------------------------

def test_fifo_weight_index_and_rank_files_are_refused_not_waited_on(converted, cli, tmp_path):
    src, good = converted
    weights = tmp_path / "w"
    weights.mkdir()
    os.mkfifo(weights / "model.safetensors")
    for cmd in (("inspect", weights / "model.safetensors"), ("inspect", weights),
                ("convert", weights, "-o", tmp_path / "o1", "--world-size", "1")):
        r = cli(*cmd, timeout=30)
        assert r.rc != 0 and "FIFO" in r.text and "expected a regular file" in r.text, r.text
    index = tmp_path / "i"
    index.mkdir()
    os.mkfifo(index / "model.safetensors.index.json")
    r = cli("convert", index, "-o", tmp_path / "o2", "--world-size", "1", timeout=30)
    assert r.rc != 0 and "FIFO" in r.text, r.text
    out = _copy_tree(good, tmp_path / "out")
    rank = out / "fsdp2-ws1" / "rank-00000-of-00001.reshard"
    rank.unlink()
    os.mkfifo(rank)
    for cmd in (("verify", out), ("inspect", rank)):
        r = cli(*cmd, timeout=30)
        assert r.rc != 0 and "FIFO" in r.text, r.text
    with pytest.raises(reshard.ReshardError, match="FIFO"):
        reshard.load(_model(good), str(out))


def test_symlinked_secret_is_not_published_with_wider_permissions(converted, cli, tmp_path):
    src, _ = converted
    mine = _copy_tree(src, tmp_path / "src")
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "s3cret"}')
    secret.chmod(0o600)
    (mine / "tokenizer.json").unlink(missing_ok=True)
    (mine / "tokenizer.json").symlink_to(secret)
    (mine / "config.json").chmod(0o640)
    out = tmp_path / "out"
    cli("convert", mine, "-o", out, "--world-size", "1", rc=0)
    for name, mode in (("tokenizer.json", 0o600), ("config.json", 0o640)):
        st = os.lstat(out / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode, (name, oct(st.st_mode))
    hf = tmp_path / "hf"
    cli("export", out, "-o", hf, rc=0)
    for name, mode in (("tokenizer.json", 0o600), ("config.json", 0o640)):
        assert stat.S_IMODE(os.lstat(hf / name).st_mode) == mode, name


def test_symlink_planted_as_lock_file_is_refused(converted, cli, tmp_path):
    src, good = converted
    out = _copy_tree(good, tmp_path / "out")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (out / ".reshard.lock").unlink(missing_ok=True)
    (out / ".reshard.lock").symlink_to(victim)
    r = cli("convert", src, "-o", out, "--world-size", "2", timeout=60)
    assert r.rc != 0 and ".reshard.lock" in r.text and "symbolic link" in r.text, r.text
    assert victim.read_text() == "precious"


# ---- 5. convert into someone else's directory ------------------------------------------------

def test_convert_into_a_foreign_directory_needs_force(converted, cli, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "another checkpoint"}')
    r = cli("convert", src, "-o", out, "--world-size", "1", rc=3)
    assert "config.json" in r.text and "--force" in r.text and "without reshard.json" in r.text
    assert (out / "config.json").read_text() == '{"model_type": "another checkpoint"}'
    assert not (out / "fsdp2-ws1").exists()
    cli("convert", src, "-o", out, "--world-size", "1", "--force", rc=0)
    cli("convert", src, "-o", out, "--world-size", "2", rc=0)  # now a reshard output of src
    cli("verify", out, rc=0)


# ---- 6. terminal escapes in tensor names ----------------------------------------------------

def test_escape_sequences_in_tensor_names_are_shown_escaped(cli, tmp_path):
    name = "evil\x1b]0;owned\x07\x1b[2J"
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "evil.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    r = cli("inspect", path, rc=0)
    assert "evil\\x1b]0;owned\\x07\\x1b[2J" in r.out, r.out
    assert "\x1b" not in r.out and "\x07" not in r.out
    out = tmp_path / "out"
    cli("convert", path, "-o", out, "--world-size", "1", rc=0)
    r = cli("inspect", out / "fsdp2-ws1" / "rank-00000-of-00001.reshard", rc=0)
    assert "\x1b" not in r.out and "evil\\x1b" in r.out, r.out


# ---- 4, 5. rank files of another conversion under OUT's manifest ----------------------------

@pytest.mark.parametrize("what", ["another dtype policy", "another source"])
def test_a_rank_file_of_another_conversion_is_refused_by_load_verify_and_export(converted, cli, tmp_path,
                                                                                what):
    """OUT's manifest says fsdp2-ws1 of source S; its rank file was replaced by one written as
    fsdp2-ws1-bf16 (issue 25, 5), or by a conversion of another source into the same OUT
    (issue 25, 4). The load must not take it silently; verify and export name it."""
    from checkpoints import make_checkpoint

    src, good = converted
    out = _copy_tree(good, tmp_path / "out")
    other = tmp_path / "other"
    if what == "another dtype policy":
        cli("convert", src, "-o", other, "--world-size", 1, "--dtype", "bf16", rc=0)
        replacement, needle = other / "fsdp2-ws1-bf16" / "rank-00000-of-00001.reshard", "fsdp2-ws1-bf16"
    else:
        make_checkpoint(str(tmp_path / "src2"), "qwen2", "fp32", False, seed=1)
        cli("convert", tmp_path / "src2", "-o", other, "--world-size", 1, rc=0)
        replacement, needle = other / "fsdp2-ws1" / "rank-00000-of-00001.reshard", "converted from source"
    target = out / "fsdp2-ws1" / "rank-00000-of-00001.reshard"
    os.chmod(target, 0o644)
    with open(replacement, "rb") as a, open(target, "wb") as b:
        b.write(a.read())
    with pytest.raises(reshard.LayoutMismatchError, match=needle):
        reshard.load(_model(good), str(out))
    r = cli("verify", out, rc=1)
    assert needle in r.text and str(target) in r.text, r.text
    r = cli("export", out, "-o", tmp_path / "hf")
    assert r.rc != 0 and needle in r.text, r.text
    assert not (tmp_path / "hf").exists()


def test_ctrl_c_during_convert_says_what_happened_and_a_rerun_finishes(cli, reshard_bin, tmp_path):
    """Finding 8: SIGINT while convert writes exits 130 with a message saying what was and was
    not committed and what to run; no temporary is left (it made verify/inspect say "not a
    reshard output directory"); verify then names the unfinished convert; a re-run finishes."""
    import signal
    import subprocess
    import time

    from safetensors.torch import save_file
    import torch

    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(96)},  # 403 MB
              str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = subprocess.Popen([reshard_bin, "convert", str(src), "-o", str(out), "--world-size", "4",
                             "--no-capture", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    layout = out / "fsdp2-ws4"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if layout.is_dir() and any(".tmp-" in n for n in os.listdir(layout)):
            break  # writing: a temporary exists
        time.sleep(0.002)
    assert proc.poll() is None, "convert finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted by SIGINT: convert stopped" in err and "Run the same command again" in err, err
    assert not (out / "reshard.json").exists()
    leftovers = [n for d in (out, layout) for n in os.listdir(d) if ".tmp-" in n]
    assert not leftovers, leftovers
    r = cli("verify", out, rc=1)
    assert "did not finish" in r.out and "Run that convert again" in r.out, r
    cli("convert", src, "-o", out, "--world-size", 4, "--no-capture", rc=0)
    assert "OK" in cli("verify", out, "--source", src, rc=0).out


# ---- round three: concurrent converts, memory bounds, padding, .bin CRCs ------------------

def _limited(reshard_bin, args, as_bytes, timeout=120):
    """`reshard ARGS` under an address-space limit of `as_bytes` (RLIMIT_AS)."""
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))

    return subprocess.run([reshard_bin, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, preexec_fn=limit,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))


def test_a_convert_of_another_source_into_a_busy_out_fails_at_once(cli, reshard_bin, converted,
                                                                   tmp_path):
    """Item 4: two converts of different sources into one empty OUT at the same time. The
    second used to run to its end, its rank files replacing the first's (which had exited 0);
    now it is refused before writing anything, naming OUT, the running conversion and what to
    do. A conversion of the same source (another layout) still runs beside it."""
    import fcntl
    import signal
    import subprocess
    import time

    from safetensors.torch import save_file
    import torch

    src = tmp_path / "big"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(24)},  # 100 MB
              str(src / "model.safetensors"), metadata={"format": "pt"})
    other = converted[0]
    out = tmp_path / "out"
    a = subprocess.Popen([reshard_bin, "convert", str(src), "-o", str(out), "--world-size", "4",
                          "--no-capture", "--threads", "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    layout = out / "fsdp2-ws4"
    stopped = False
    try:
        def lock_is_free():
            fd = os.open(out / ".reshard.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return True
            except BlockingIOError:
                return False
            finally:
                os.close(fd)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and a.poll() is None:
            if layout.is_dir() and any(".tmp-" in n for n in os.listdir(layout)):
                a.send_signal(signal.SIGSTOP)  # A is writing rank files...
                while open(f"/proc/{a.pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "TZX":
                    time.sleep(0.001)          # (stopped, not just signalled)
                if lock_is_free():             # ...without OUT's lock
                    stopped = True
                    break
                a.send_signal(signal.SIGCONT)  # stopped at its end, holding it: later
            time.sleep(0.002)
        assert stopped, "convert A finished before B could start"
        before = sorted(os.listdir(out))
        t0 = time.monotonic()
        b = cli("convert", other, "-o", out, "--world-size", 4, "--no-capture", "--lock-wait", 30)
        took = time.monotonic() - t0
        assert b.rc == 3, b
        assert took < 10, f"B took {took:.1f} s to give up"
        for words in (str(out), "another conversion into this directory is running",
                      "of another source", f"reshard convert {src}", f"pid {a.pid}",
                      ".reshard.convert", "nothing was written", "convert into another directory"):
            assert words in b.err, (words, b.err)
        assert sorted(os.listdir(out)) == before
        # The same source into another layout shares OUT with A.
        cli("convert", src, "-o", out, "--world-size", 2, "--no-capture", rc=0)
    finally:
        if stopped:
            a.send_signal(signal.SIGCONT)
        _, err = a.communicate(timeout=120)
    assert a.returncode == 0, err
    r = cli("verify", out, "--source", src, rc=0)
    assert "OK" in r.out, r
    # Once A has ended, B is refused by the manifest (another source), as before.
    b = cli("convert", other, "-o", out, "--world-size", 4, "--no-capture", rc=3)
    assert "another source" in b.err, b


def _torch_zip(records):
    """A torch.save-like archive (stored records, CRCs by zipfile)."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, data)
    return buf.getvalue()


def _tiny_bin_records():
    import io
    import zipfile

    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.arange(24, dtype=torch.float32).reshape(6, 4)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def test_pickle_memo_flood_is_refused_within_a_memory_limit(reshard_bin, tmp_path):
    """Item 7: MEMOIZE repeated 50 M times in data.pkl (50 MB) took 2.8 GB of memory (250 MB:
    a bare std::bad_alloc). Now refused at the first memo entry past the objects built, under
    a 1 GiB address-space limit, naming the file."""
    import time

    recs = _tiny_bin_records()
    name, pkl = recs[0]
    assert name.endswith("data.pkl") and pkl.endswith(b".")
    flood = pkl[:-1] + b"\x94" * (50 << 20) + b"."
    path = tmp_path / "src" / "pytorch_model.bin"
    path.parent.mkdir()
    path.write_bytes(_torch_zip([(name, flood)] + recs[1:]))
    t0 = time.monotonic()
    for args in (("inspect", path), ("convert", path.parent, "-o", tmp_path / "out",
                                     "--world-size", 2, "--no-capture")):
        p = _limited(reshard_bin, args, 1 << 30)
        assert p.returncode == 3, p
        for words in (str(path), "data.pkl", "memo entry", "memo flood",
                      "at most one memo entry per object"):
            assert words in p.stderr, (words, p.stderr)
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out" / "fsdp2-ws2").exists()


def _set_chunk_size(out, key, chunk_size):
    """Rewrites every rank file of OUT/KEY to say `chunk_size` (each tensor has one chunk, so
    its checksums stay right), with the preamble's and the manifest's checksums recomputed."""
    import reference_reader as rf

    m = json.loads((out / "reshard.json").read_text())
    for entry in m["layouts"][key]["ranks"]:
        path = out / key / entry["file"]
        raw = path.read_bytes()
        magic, ver, flags, doff, dsize, hoff, hsize = struct.unpack_from("<8sIIQQQQ", raw)
        h = json.loads(raw[hoff:hoff + hsize])
        assert all(len(t["chunk_xxh3"]) == 1 for t in h["tensors"])
        h["chunk_size"] = chunk_size
        text = json.dumps(h).encode()
        pre = struct.pack("<8sIIQQQQQ", magic, ver, flags, doff, dsize, hoff, len(text),
                          rf.xxh3_64(text))
        path.write_bytes(pre + struct.pack("<Q", rf.xxh3_64(pre)) + raw[64:hoff] + text)
        entry["size"] = path.stat().st_size
        entry["header_xxh3"] = rf.hex16(rf.xxh3_64(text))
    (out / "reshard.json").write_text(json.dumps(m, indent=2) + "\n")


def test_export_of_16_gib_chunks_fits_in_4_gib(reshard_bin, converted, tmp_path):
    """Item 7: a layout whose headers say 16 GiB chunks (the format's limit) verified under a
    4 GiB address-space limit, but export allocated chunk_size per thread (std::bad_alloc)."""
    out = _copy_tree(converted[1], tmp_path / "out")
    _set_chunk_size(out, "fsdp2-ws1", 1 << 34)
    p = _limited(reshard_bin, ["verify", out, "--threads", 2], 4 << 30)
    assert p.returncode == 0, p
    p = _limited(reshard_bin, ["export", out, "-o", tmp_path / "hf", "--threads", 2], 4 << 30)
    assert p.returncode == 0, p
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = load_file(str(converted[0] / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(got[k].equal(want[k]) for k in want)


def test_convert_chunk_size_past_the_limit_is_refused_up_front(cli, reshard_bin, converted,
                                                              tmp_path):
    """Item 7: --chunk-size 1 TiB went on to allocate it per thread (std::bad_alloc)."""
    out = tmp_path / "out"
    for size in (1 << 40, (1 << 30) + 4096):
        r = cli("convert", converted[0], "-o", out, "--world-size", 1, "--no-capture",
                "--chunk-size", size, rc=2)
        for words in (f"--chunk-size {size}", "up to 1073741824 (1 GiB)", "worker thread",
                      "pinned memory"):
            assert words in r.err, (words, r.err)
        assert not out.exists()
    # 1 GiB itself is allowed; over small tensors it costs no memory (buffers are sized by
    # the longest chunk written, not chunk_size: 4 threads fit in a 2 GiB address space).
    p = _limited(reshard_bin, ["convert", converted[0], "-o", out, "--world-size", 1,
                               "--no-capture", "--chunk-size", 1 << 30, "--threads", 4], 2 << 30)
    assert p.returncode == 0, p
    cli("verify", out, "--source", converted[0], rc=0)


def test_bin_storage_crc_is_checked_by_verify_source(cli, tmp_path):
    """Item 10: a storage record of a torch.save archive changed after it was written (its
    CRC-32 no longer matches) converted silently, and verify --source agreed (the rank files
    hold what the source holds). verify --source now checks every record's CRC-32."""
    import io
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    path = src / "pytorch_model.bin"
    path.write_bytes(_torch_zip(_tiny_bin_records()))
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = [i for i in z.infolist() if i.filename.endswith("/data/0")][0]
    n, m = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + n + m + 7] ^= 0x40  # a bit of w[1]
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    cli("convert", src, "-o", out, "--world-size", 2, "--no-capture", rc=0)
    r = cli("verify", out, "--source", src, rc=1)
    for words in (str(path), f'record "{info.filename}"', "CRC-32", "the central directory says",
                  "the source changed after torch.save wrote it"):
        assert words in r.out, (words, r.out)
    cli("verify", out, rc=0)  # the rank files themselves are intact
