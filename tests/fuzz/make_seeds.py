"""Writes seed corpora for the fuzz targets from real files.

    python tests/fuzz/make_seeds.py OUT_DIR [RESHARD_BIN]
creates
  OUT_DIR/zip (whole archives) and OUT_DIR/pickle (their data.pkl records), from torch.save:
    state dicts of every dtype, tied storages, views, Parameters, fp8 (_rebuild_tensor_v3),
    pickle protocols 2-5, an OrderedDict with _metadata, a plain dict, and a Python-zipfile
    archive without 64-byte alignment;
  OUT_DIR/safetensors (whole files): tiny models written by transformers' save_pretrained
    (one file and sharded), the test suite's "mixed" checkpoint (every dtype, 0-dim, empty,
    escaped and non-ASCII names) and safetensors' save_file with and without metadata;
  OUT_DIR/index: model.safetensors.index.json of sharded save_pretrained checkpoints and
    pytorch_model.bin.index.json of sharded torch.save checkpoints;
  OUT_DIR/rank (preamble + header, the data region cut out: the input format of
    fuzz_rank_file.cc) and OUT_DIR/manifest (reshard.json), from RESHARD_BIN (default
    build/reshard) converting those checkpoints: world sizes 1, 2, 3 and 8, raw and zstd,
    --dtype fp32, a partial --ranks conversion and DTensor layouts (--mesh, --plan);
  OUT_DIR/plan: the parallel plan those DTensor conversions use (fuzz_parallel_plan.cc).
  and hostile-* seeds of issue 25's shapes (write_hostile_shapes): nesting around the JSON
    depth limit, 5,000 tensors, NUL and path names, a pickle MEMOIZE flood.
Every file is deterministic (seeded); names are the file's role, so reruns overwrite.
"""

import collections
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def states():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=gen)
    emb = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    sd = collections.OrderedDict()
    sd["view"] = base[8:32].view(4, 6)
    sd["rest"] = base[32:]
    sd["emb"] = emb
    sd["head"] = emb.view(5, 3)
    sd["p"] = torch.nn.Parameter(torch.ones(2, 2))
    sd["i64"] = torch.tensor(2**40)
    sd["half"] = torch.randn(3, generator=gen).half()
    sd["f64"] = torch.randn(2, generator=gen).double()
    sd["b"] = torch.tensor([True, False])
    sd["u8"] = torch.arange(4, dtype=torch.uint8)
    sd["fp8"] = torch.zeros(4, dtype=torch.float8_e4m3fn)
    sd["u16"] = torch.zeros(3, dtype=torch.uint16)
    sd["empty"] = torch.empty(0, 3)
    sd._metadata = collections.OrderedDict({"": {"version": 1}, "x": {"version": 2}})
    yield "ordered", sd
    yield "plain", {"a": torch.randn(3, 2, generator=gen), "b": torch.arange(5)}
    yield "empty", {}


def tiny_llama(path, dtype, sharded):
    """A Llama small enough that its safetensors file is a good fuzz seed (a few KB)."""
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=12,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path, max_shard_size=600 if sharded else 1 << 20)
    return path


def write_safetensors_and_index(out, work):
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    from checkpoints import make_bin_checkpoint, make_checkpoint

    st = os.path.join(out, "safetensors")
    ix = os.path.join(out, "index")
    os.makedirs(st, exist_ok=True)
    os.makedirs(ix, exist_ok=True)
    ckpts = {}
    for name, dtype, sharded in (("llama-bf16", torch.bfloat16, False),
                                 ("llama-fp32", torch.float32, False),
                                 ("llama-bf16-sharded", torch.bfloat16, True)):
        ckpts[name] = tiny_llama(os.path.join(work, name), dtype, sharded)
    ckpts["mixed"] = make_checkpoint(os.path.join(work, "mixed"), "mixed", "bf16", sharded=False)
    ckpts["mixed-sharded"] = make_checkpoint(os.path.join(work, "mixed-sharded"), "mixed",
                                             "bf16", sharded=True)
    ckpts["gpt2-sharded"] = make_checkpoint(os.path.join(work, "gpt2-sharded"), "gpt2", "bf16",
                                            sharded=True)
    for name, path in ckpts.items():
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            if os.path.getsize(f) <= 64 << 10:
                shutil.copy(f, os.path.join(st, f"{name}-{os.path.basename(f)}"))
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            shutil.copy(index, os.path.join(ix, f"{name}.safetensors.index.json"))
    gen = torch.Generator().manual_seed(3)
    small = {"a": torch.randn(3, 2, generator=gen), "s": torch.tensor(1.5),
             "e": torch.empty(0, 2, dtype=torch.bfloat16), "i": torch.arange(3, dtype=torch.int8)}
    save_file(small, os.path.join(st, "small-meta.safetensors"), metadata={"format": "pt"})
    save_file(small, os.path.join(st, "small.safetensors"))
    save_file({}, os.path.join(st, "empty.safetensors"))
    bin_path = make_bin_checkpoint(os.path.join(work, "bin-sharded"), "gpt2", "bf16",
                                   sharded=True)
    shutil.copy(os.path.join(bin_path, "pytorch_model.bin.index.json"),
                os.path.join(ix, "gpt2.bin.index.json"))
    return ckpts


# A parallel plan (formats/parallel-plan.md) for tiny_llama: DTensor rank files and manifests,
# and the seed of fuzz_parallel_plan.cc.
LLAMA_PLAN = {
    "format": "reshard.parallel-plan", "format_version": 1, "name": "llama_tp",
    "fsdp": {"mesh_dim": "dp_shard"},
    "rules": [
        {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(1)"}},
        {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(1)"}},
        {"pattern": "model.layers.*.self_attn.*_proj.weight", "placements": {"tp": "S(0)"}},
        {"pattern": "model.layers.*.mlp.down_proj.weight", "placements": {"tp": "S(1)"}},
        {"pattern": "model.layers.*.mlp.*_proj.weight", "placements": {"tp": "S(0)"}},
        {"pattern": "lm_head.weight", "placements": {"tp": "_S(0,2)"}},
    ],
}


def write_rank_and_manifest(out, work, ckpts, reshard_bin):
    rk = os.path.join(out, "rank")
    mf = os.path.join(out, "manifest")
    pl = os.path.join(out, "plan")
    os.makedirs(pl, exist_ok=True)
    plan = os.path.join(pl, "llama_tp.json")
    with open(plan, "w") as f:
        json.dump(LLAMA_PLAN, f, indent=1)
    os.makedirs(rk, exist_ok=True)
    os.makedirs(mf, exist_ok=True)
    runs = [
        ("llama-bf16", [["--world-size", "1"], ["--world-size", "3"],
                        ["--world-size", "2", "--compress", "zstd"],
                        ["--world-size", "2", "--dtype", "fp32"],
                        ["--mesh", "dp_shard=3,tp=2", "--plan", plan],
                        ["--mesh", "dp_shard=2,tp=2,ep=1", "--plan", plan, "--compress", "zstd"]]),
        ("mixed-sharded", [["--world-size", "8", "--compress", "zstd:1"]]),
        ("gpt2-sharded", [["--world-size", "5", "--ranks", "1-2"]]),
    ]
    for name, convs in runs:
        dest = os.path.join(work, "out-" + name)
        for args in convs:
            subprocess.run([reshard_bin, "convert", ckpts[name], "-o", dest, *args],
                           check=True, stdout=subprocess.DEVNULL)
        shutil.copy(os.path.join(dest, "reshard.json"), os.path.join(mf, f"{name}.json"))
        for f in sorted(glob.glob(os.path.join(dest, "*", "rank-*.reshard"))):
            with open(f, "rb") as fh:
                raw = fh.read()
            header_offset = int.from_bytes(raw[32:40], "little")
            layout = os.path.basename(os.path.dirname(f))
            base = os.path.basename(f)[: -len(".reshard")]
            with open(os.path.join(rk, f"{name}-{layout}-{base}.bin"), "wb") as fh:
                fh.write(raw[:64] + raw[header_offset:])


def write_hostile_shapes(out):
    """Issue 25's shapes, small enough for a corpus: nesting just under and over the JSON
    depth limit (64, formats/manifest.md), many tensors, and a pickle MEMOIZE flood."""
    import json
    import struct

    def st(header: bytes, data: bytes = b"") -> bytes:
        return struct.pack("<Q", len(header)) + header + data

    seeds = {
        "safetensors": {
            "deep-63.safetensors": st(b'{"__metadata__":{},"w":' + b"[" * 62 + b"]" * 62 + b"}"),
            "deep-1000.safetensors": st(b'{"w":' + b"[" * 1000 + b"]" * 1000 + b"}"),
            "deep-objects.safetensors": st(b'{"a":' * 80 + b"1" + b"}" * 80),
            "many-tensors.safetensors": st(json.dumps(
                {f"model.layers.{i}.w": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                 for i in range(5000)}, separators=(",", ":")).encode(), b"\x01" * 5000),
        },
        "index": {
            "deep.json": b'{"weight_map":{"w":"a.safetensors"},"metadata":' + b"[" * 100
                         + b"]" * 100 + b"}",
            "nul-name.json": json.dumps({"weight_map": {"w": "a.safetensors\x00b"}}).encode(),
        },
        "manifest": {
            "deep.json": b'{"format":"reshard.manifest","x":' + b"{" * 100 + b"}" * 100 + b"}",
            "aux-escape.json": json.dumps({"format": "reshard.manifest", "format_version": 1,
                                           "aux_files": ["../../x"]}).encode(),
        },
        # Memo and object floods (item 7 of issue 25): one memo entry per object (accepted),
        # MEMOIZE repeated on one object and LONG_BINPUT under ever new keys (refused at the
        # first entry past the objects built), empty tuples and MARKs by the thousand (each
        # counted against the reader's memory limit).
        "pickle": {
            "memo-flood.pkl": b"\x80\x04" + b")\x94" * 20000 + b".",
            "memo-flood-one-object.pkl": b"\x80\x04)" + b"\x94" * 20000 + b".",
            "binput-flood.pkl": b"\x80\x02)" + b"".join(
                b"r" + struct.pack("<I", k) for k in range(5000)) + b".",
            "object-flood.pkl": b"\x80\x02" + b")" * 50000 + b".",
            "mark-flood.pkl": b"\x80\x02" + b"(" * 50000 + b".",
        },
    }
    for kind, files in seeds.items():
        os.makedirs(os.path.join(out, kind), exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(out, kind, "hostile-" + name), "wb") as f:
                f.write(data)


def main(out, reshard_bin=None):
    with tempfile.TemporaryDirectory() as work:
        ckpts = write_safetensors_and_index(out, work)
        reshard_bin = reshard_bin or os.environ.get("RESHARD_BIN") or os.path.join(
            ROOT, "build", "reshard")
        write_rank_and_manifest(out, work, ckpts, reshard_bin)
    write_torch_save(out)
    write_hostile_shapes(out)


def write_torch_save(out):
    os.makedirs(os.path.join(out, "zip"), exist_ok=True)
    os.makedirs(os.path.join(out, "pickle"), exist_ok=True)
    for name, sd in states():
        for proto in (2, 3, 4, 5):
            buf = io.BytesIO()
            torch.save(sd, buf, pickle_protocol=proto)
            raw = buf.getvalue()
            with open(os.path.join(out, "zip", f"{name}-p{proto}.bin"), "wb") as f:
                f.write(raw)
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
                with open(os.path.join(out, "pickle", f"{name}-p{proto}.pkl"), "wb") as f:
                    f.write(z.read(pkl))
                # The same records rewritten by Python's zipfile (other layout, no ZIP64).
                again = io.BytesIO()
                with zipfile.ZipFile(again, "w") as w:
                    for info in z.infolist():
                        w.writestr(info.filename, z.read(info))
                with open(os.path.join(out, "zip", f"{name}-p{proto}-pyzip.bin"), "wb") as f:
                    f.write(again.getvalue())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
