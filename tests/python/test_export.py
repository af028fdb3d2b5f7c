"""End-to-end tests of `reshard export` against tiny checkpoints written by transformers.

convert (world sizes 1, 3, 8, raw and zstd) → export, then:
* every tensor equals the source's, same dtype, bit for bit (read with safetensors.safe_open);
* every weight file is byte-identical to `safetensors.torch.save_file` of the same tensors with
  `metadata={"format": "pt"}` (as save_pretrained calls it); a single-file transformers
  checkpoint comes back byte-identical to its own model.safetensors;
* sharded output is grouped as huggingface_hub's `split_torch_state_dict_into_shards` groups
  the tensors (in the source's order), the index is what transformers writes;
* `AutoModel*.from_pretrained(HF_DIR)` loads with no missing, unexpected or mismatched keys and
  the same weights as from the source (tied weights tied);
* `--dtype bf16` equals `Tensor.to(torch.bfloat16)`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints import load_source, weight_files

INDEX = "model.safetensors.index.json"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def convert(cli, src, out, ws, *extra):
    return cli("convert", src, "-o", out, "--world-size", ws, *extra, rc=0)


def export(cli, out, hf, *extra, rc=0):
    return cli("export", out, "-o", hf, *extra, rc=rc)


def read_file_tensors(path) -> Dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def source_order(src: str) -> List[str]:
    """The source's tensor order as reshard defines it: weight files by name, then offset
    (read from each file's own header here)."""
    index = os.path.join(src, INDEX)
    weight_map = json.load(open(index))["weight_map"] if os.path.exists(index) else None
    names = []
    for fname in weight_files(src):
        with open(os.path.join(src, fname), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for k in sorted(header, key=lambda k: header[k]["data_offsets"]):
            if weight_map is None or weight_map.get(k) == fname:
                names.append(k)
    return names


def expected_groups(src_tensors: Dict[str, torch.Tensor], order: List[str], max_shard_size):
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(
        {k: src_tensors[k] for k in order}, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size)
    return split.filename_to_tensors


def check_export(hf: Path, src: str, src_tensors: Dict[str, torch.Tensor], tmp_path: Path,
                 max_shard_size=None):
    """Every tensor back bit for bit; files as save_file writes them; index as transformers."""
    got_files = sorted(p.name for p in hf.glob("*.safetensors"))
    got: Dict[str, torch.Tensor] = {}
    for fname in got_files:
        tensors = read_file_tensors(hf / fname)
        # Byte-identical to safetensors' own writer given the same tensors.
        ref = tmp_path / f"ref-{fname}"
        save_file(tensors, str(ref), metadata={"format": "pt"})
        assert (hf / fname).read_bytes() == ref.read_bytes(), f"{fname} differs from save_file"
        with safe_open(str(hf / fname), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        for k, v in tensors.items():
            assert k not in got, f"{k} in two files"
            got[k] = v
    assert sorted(got) == sorted(src_tensors)
    for k, v in src_tensors.items():
        assert same_bits(got[k], v), k
    if max_shard_size is None:
        assert got_files == ["model.safetensors"] and not (hf / INDEX).exists()
    else:
        groups = expected_groups(src_tensors, source_order(src), max_shard_size)
        assert len(groups) > 1
        assert got_files == sorted(groups)
        for fname, names in groups.items():
            assert sorted(read_file_tensors(hf / fname)) == sorted(names), fname
        text = (hf / INDEX).read_text()
        index = json.loads(text)
        assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
        assert index["metadata"] == {
            "total_size": sum(t.numel() * t.element_size() for t in src_tensors.values())}
        assert index["weight_map"] == {k: f for f, names in groups.items() for k in names}
    for aux in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, aux)):
            assert (hf / aux).read_bytes() == Path(src, aux).read_bytes(), aux
    assert not [p for p in hf.parent.iterdir() if "export-tmp" in p.name]


# (arch, dtype, sharded, world size, extra convert flags)
ROUND_TRIPS = [
    ("llama", "bf16", True, 1, ()),
    ("llama", "bf16", True, 3, ()),
    ("llama", "bf16", True, 8, ()),
    ("llama", "fp32", False, 3, ("--compress", "zstd", "--chunk-size", "4096")),
    ("qwen2", "fp32", False, 8, ()),
    ("qwen2", "bf16", True, 3, ("--chunk-size", "4096")),
    ("gpt2", "bf16", True, 8, ()),
    ("bert", "fp32", False, 3, ()),
    ("mixed", "bf16", True, 5, ("--chunk-size", "4096")),
]


@pytest.mark.parametrize("arch,dtype,sharded,ws,extra", ROUND_TRIPS,
                         ids=[f"{a}-{d}-{'sharded' if s else 'single'}-ws{w}{'-zstd' if 'zstd' in e else ''}"
                              for a, d, s, w, e in ROUND_TRIPS])
def test_round_trip(cli, checkpoint, tmp_path, arch, dtype, sharded, ws, extra):
    src = checkpoint(arch, dtype, sharded)
    src_tensors = load_source(src)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, ws, *extra)
    r = export(cli, out, hf, "--json")
    summary = json.loads(r.out)
    assert summary["layout"] == f"fsdp2-ws{ws}" and summary["weight_files"] == ["model.safetensors"]
    check_export(hf, src, src_tensors, tmp_path)
    if not sharded and arch != "mixed":
        # A single-file checkpoint written by save_pretrained comes back identical.
        assert (hf / "model.safetensors").read_bytes() == Path(src, "model.safetensors").read_bytes()
    # Sharded: grouped as save_pretrained groups, with a limit that gives several files.
    total = sum(t.numel() * t.element_size() for t in src_tensors.values())
    limit = max(1, total // 4)
    hf2 = tmp_path / "hf-sharded"
    export(cli, out, hf2, "--max-shard-size", str(limit))
    check_export(hf2, src, src_tensors, tmp_path, max_shard_size=limit)


def _auto_class(arch):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM


@pytest.mark.parametrize("arch,dtype,sharded", [
    ("llama", "bf16", True), ("qwen2", "fp32", False), ("gpt2", "fp32", True),
    ("bert", "bf16", False)])
def test_from_pretrained_loads_the_export(cli, checkpoint, tmp_path, arch, dtype, sharded):
    src = checkpoint(arch, dtype, sharded)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 3)
    total = sum(t.numel() * t.element_size() for t in load_source(src).values())
    export(cli, out, hf, "--max-shard-size", str(total // 3))
    assert (hf / INDEX).exists()
    cls = _auto_class(arch)
    model, info = cls.from_pretrained(str(hf), output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref = cls.from_pretrained(src)
    got_sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sorted(got_sd) == sorted(ref_sd)
    for k, v in ref_sd.items():
        assert same_bits(got_sd[k], v), k
    if arch == "qwen2":  # tied: written once, tied again on load
        assert "lm_head.weight" not in load_source(str(hf))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch,dtype,to", [("llama", "fp32", "bf16"), ("qwen2", "bf16", "fp32"),
                                           ("gpt2", "fp32", "fp16")])
def test_dtype_equals_tensor_to(cli, checkpoint, tmp_path, arch, dtype, to):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[to]
    src = checkpoint(arch, dtype, True)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 3)
    export(cli, out, hf, "--dtype", to)
    got = read_file_tensors(hf / "model.safetensors")
    src_tensors = load_source(src)
    assert sorted(got) == sorted(src_tensors)
    for k, v in src_tensors.items():
        want = v.to(torch_dtype) if v.is_floating_point() else v
        assert same_bits(got[k], want), k
    # config.json names the weights' dtype (transformers loads in the config's dtype), and is
    # otherwise the source's.
    want_cfg = json.load(open(os.path.join(src, "config.json")))
    got_cfg = json.load(open(hf / "config.json"))
    name = str(torch_dtype).removeprefix("torch.")
    key = "dtype" if "dtype" in want_cfg else "torch_dtype"
    assert want_cfg[key] != name and got_cfg[key] == name, (want_cfg.get(key), got_cfg.get(key))
    assert {k: v for k, v in got_cfg.items() if k != key} == {k: v for k, v in want_cfg.items() if k != key}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf))
    assert {p.dtype for p in model.parameters()} == {torch_dtype}


def test_export_keeping_the_dtype_copies_config_as_it_is(cli, checkpoint, tmp_path):
    src = checkpoint("qwen2", "bf16", True)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 2)
    export(cli, out, hf)
    assert open(hf / "config.json", "rb").read() == open(os.path.join(src, "config.json"), "rb").read()


def test_export_of_a_converted_layout(cli, checkpoint, tmp_path):
    """A layout converted to bf16 exports as bf16 (= source.to(bf16)); --layout picks it."""
    src = checkpoint("llama", "fp32", False)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 2)
    convert(cli, src, out, 2, "--dtype", "bf16")
    r = export(cli, out, hf, rc=3)
    assert "fsdp2-ws2" in r.err and "fsdp2-ws2-bf16" in r.err and "--layout" in r.err, r
    assert not hf.exists()
    export(cli, out, hf, "--layout", "fsdp2-ws2-bf16")
    got = read_file_tensors(hf / "model.safetensors")
    for k, v in load_source(src).items():
        assert same_bits(got[k], v.to(torch.bfloat16)), k


def test_cli_refusals(cli, checkpoint, tmp_path):
    src = checkpoint("gpt2", "bf16", False)
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 3)
    r = export(cli, out, hf, "--max-shard-size", "5GiB", rc=2)
    assert "--max-shard-size" in r.err, r
    r = export(cli, out, hf, "--layout", "fsdp2-ws4", rc=3)
    assert "fsdp2-ws4" in r.err and "fsdp2-ws3" in r.err, r
    r = export(cli, tmp_path / "nowhere", hf, rc=3)
    assert "no such file or directory" in r.err, r
    # Near an output: what to pass instead (it said "no reshard.json" / "no such directory").
    r = export(cli, out / "fsdp2-ws3", hf, rc=3)
    assert f"a layout directory of {out}: pass that directory" in r.err, r
    r = export(cli, out / "fsdp2-ws3" / "rank-00000-of-00003.reshard", hf, rc=3)
    assert f"a rank file, not an output directory: pass the directory that holds reshard.json ({out})" in r.err, r
    assert not hf.exists()
    # An existing non-empty output is left alone without --force.
    hf.mkdir()
    (hf / "notes.txt").write_text("mine")
    r = export(cli, out, hf, rc=3)
    assert "--force" in r.err and "not empty" in r.err, r
    assert (hf / "notes.txt").read_text() == "mine"
    export(cli, out, hf, "--force")
    assert not (hf / "notes.txt").exists() and (hf / "model.safetensors").exists()
    # A corrupt rank file: refused while reading (checksum), nothing written.
    rank = out / "fsdp2-ws3" / "rank-00001-of-00003.reshard"
    data = bytearray(rank.read_bytes())
    data[4096 + 10] ^= 0xFF
    rank.write_bytes(bytes(data))
    hf3 = tmp_path / "hf3"
    r = export(cli, out, hf3, rc=3)
    assert "checksum mismatch" in r.err and "rank-00001-of-00003" in r.err, r
    assert not hf3.exists()
    assert not [p for p in tmp_path.iterdir() if "export-tmp" in p.name]


def test_help_shows_export(cli):
    r = cli("--help", rc=0)
    assert "export" in r.out
    r = cli("export", "--help", rc=0)
    for flag in ("--layout", "--max-shard-size", "--dtype", "--threads", "--force", "Example"):
        assert flag in r.out, r


def test_bin_source_with_tied_entries(cli, tmp_path):
    """A pytorch_model.bin source saves a tied pair as two entries on one storage; both names
    reach the rank files and the export (safetensors files hold no shared storage), and
    from_pretrained loads the export with nothing missing or unexpected, the pair tied."""
    from checkpoints import load_bin_source, make_bin_checkpoint

    src = make_bin_checkpoint(str(tmp_path / "src"), "qwen2", "bf16")
    out, hf = tmp_path / "out", tmp_path / "hf"
    convert(cli, src, out, 3)
    export(cli, out, hf)
    got = read_file_tensors(hf / "model.safetensors")
    want = load_bin_source(src)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert same_bits(got[k], v), k
    model, info = _auto_class("qwen2").from_pretrained(str(hf), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
