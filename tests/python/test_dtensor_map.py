"""reshard's DTensor element map (reshard/format/dtensor.h) and the byte map built on it
(MapEntry's DTensor segments, reshard/plan/byte_map.h) against real torch 2.11.

Two sources of truth, both torch's own code:

* ``test_map_matches_real_dtensors`` runs ``dtensor_worker.py`` in 4 gloo processes
  (torchrun): ``distribute_tensor`` of an arange tensor with every combination of Replicate,
  Shard(0), Shard(1), _StridedShard(0, 2), _StridedShard(1, 2) on meshes 2x2, (4,), 1x4 and 4x1
  (uneven and empty shards included), and FSDP2 ``fully_shard`` over "dp_shard" of parameters
  that tensor parallelism already sharded on "tp" (a 2x2 mesh): torch itself records
  _StridedShard(0, 2) there. Each rank's ``to_local()`` (flattened) is the list of global
  elements it holds, in order; the map must give the same list and local shape.
* ``test_map_matches_torch_split_functions`` covers meshes that need more processes than this
  machine runs at once (2x3, 3x2, 2x2x2, 3x2x2): torch's per-placement split functions
  (``Shard._split_tensor``, ``_StridedShard._split_tensor``, with_padding=False) applied in
  mesh-dim order, as ``distribute_tensor`` does, and for FSDP2 over TP the TP split followed by
  FSDP2's own ``_chunk_with_empty`` of the TP-local tensor (``FSDPParam._init_sharded_param``),
  where fully_shard and the left-to-right reading of its placements differ (dp 3).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty, _get_dim_chunked_size
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dist_util import torchrun

_C = pytest.importorskip("reshard._C")


def placement_str(p) -> str:
    if isinstance(p, _StridedShard):
        return f"_S({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "R"


def coordinate(mesh_shape, rank):
    out = []
    for s in reversed(mesh_shape):
        out.append(rank % s)
        rank //= s
    return out[::-1]


def reshard_elements(shape, placements, mesh_shape, rank, fsdp_mesh_dim=-1):
    """(local shape, global elements in local order) by the element map and by the byte map."""
    runs = _C.dtensor_local_indices(list(shape), placements, list(mesh_shape), coordinate(mesh_shape, rank),
                                    fsdp_mesh_dim)
    local_shape = [sum(n for _, n in r) for r in runs]
    idx = [torch.tensor([i for s, n in r for i in range(s, s + n)], dtype=torch.int64) for r in runs]
    by_indices = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for d, ix in enumerate(idx):
        by_indices = by_indices.index_select(d, ix)
    got_shape, by_segments, _ = _C._testing.dtensor_entry_elements(list(shape), placements, list(mesh_shape), rank,
                                                                    fsdp_mesh_dim)
    assert list(got_shape) == local_shape
    assert list(by_segments) == by_indices.reshape(-1).tolist(), (shape, placements, mesh_shape, rank)
    return local_shape, list(by_segments)


def test_map_matches_real_dtensors(tmp_path):
    torchrun(4, "tests/python/dtensor_worker.py", "--result", tmp_path, timeout=240)
    kinds = set()
    for rank in range(4):
        cases = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert len(cases) > 300
        for c in cases:
            kinds.add(c["kind"])
            assert coordinate(c["mesh_shape"], rank) == c["coordinate"]
            got = reshard_elements(c["shape"], c["placements"], c["mesh_shape"], rank, c["fsdp_mesh_dim"])
            assert got == (c["local_shape"], c["elements"]), c
    strided = {c["placements"][0] for c in json.loads((tmp_path / "rank-0.json").read_text())
               if c["kind"] == "fully_shard:col"}
    assert strided == {"_S(0,2)"}  # torch itself chose _StridedShard for FSDP2 over TP
    assert "fully_shard:row" in kinds


def split(placement, t, k, i):
    """torch's own split of local tensor `t` over a mesh dim of size k, piece i."""
    if isinstance(placement, Replicate):
        return t
    pieces, _ = placement._split_tensor(t, k, with_padding=False, contiguous=True)
    return pieces[i]


MESHES = [(2, 3), (3, 2), (2, 2, 2), (3, 2, 2), (1, 5)]
SHAPES = [(7, 5), (4, 9), (2, 2), (0, 3)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_map_matches_torch_split_functions(mesh_shape):
    choices = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
    world = torch.Size(mesh_shape).numel()
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        names = [placement_str(p) for p in placements]
        for shape in SHAPES:
            g = torch.arange(torch.Size(shape).numel()).reshape(shape)
            for rank in range(world):
                local = g
                for m, (p, i) in enumerate(zip(placements, coordinate(mesh_shape, rank))):
                    local = split(p, local, mesh_shape[m], i)
                assert reshard_elements(shape, names, mesh_shape, rank) == (
                    list(local.shape), local.reshape(-1).tolist()), (mesh_shape, names, shape, rank)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (4, 2), (2, 3), (3, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_fully_shard_over_tp_follows_fsdp2(mesh_shape):
    """FSDP2 over TP: the TP placements (on mesh dims 1..) applied first, then FSDP2's
    _chunk_with_empty of the TP-local tensor on dim 0 over mesh dim 0 (its shape as
    FSDPParam.sharded_size: _get_dim_chunked_size); torch records
    _StridedShard(0, shards of dim 0 by TP) on mesh dim 0."""
    tp_dims = len(mesh_shape) - 1
    mismatches_left_to_right = 0
    for tp in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=tp_dims):
        sf = 1
        for m, p in enumerate(tp):
            if isinstance(p, Shard) and p.dim == 0:
                sf *= mesh_shape[m + 1]
        dp = _StridedShard(0, split_factor=sf) if sf > 1 else Shard(0)
        names = [placement_str(p) for p in (dp, *tp)]
        for n in range(0, 14):
            shape = (n, 4)
            g = torch.arange(n * 4).reshape(shape)
            for rank in range(torch.Size(mesh_shape).numel()):
                c = coordinate(mesh_shape, rank)
                local = g
                for m, p in enumerate(tp):
                    local = split(p, local, mesh_shape[m + 1], c[m + 1])
                tp_local = local
                local = _chunk_with_empty(tp_local, mesh_shape[0], dim=0)[c[0]]
                # FSDPParam.sharded_size: an empty chunk keeps the other dims' sizes
                want = (list(_get_dim_chunked_size(local, tp_local.size(), 0)), local.reshape(-1).tolist())
                assert reshard_elements(shape, names, mesh_shape, rank, fsdp_mesh_dim=0) == want
                mismatches_left_to_right += reshard_elements(shape, names, mesh_shape, rank)[1] != want[1]
    # In elements, dp 2 agrees with the left-to-right reading always; dp 3 and 4 do not for
    # some shapes (7 rows on 3x2, 9 rows on 4x2). (Shapes of empty locals differ even on dp 2.)
    if mesh_shape[0] == 2:
        assert mismatches_left_to_right == 0
    if mesh_shape in [(3, 2), (4, 2)]:
        assert mismatches_left_to_right > 0


def test_shard1_of_a_big_tensor_is_one_segment():
    _, _, segments = _C._testing.dtensor_entry_elements([6, 4], ["S(1)"], [2], 1, -1)
    assert segments == 1
    runs = _C.dtensor_local_indices([128256, 4096], ["R", "S(1)"], [2, 8], [1, 3])
    assert runs == [[(0, 128256)], [(1536, 512)]]


PLAN = {
    "format": "reshard.parallel-plan", "format_version": 1, "name": "toy_tp", "fsdp": {"mesh_dim": "dp_shard"},
    "rules": [
        {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(1)"}},
        {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(1)"}},
        {"pattern": "model.layers.*.self_attn.*_proj.weight", "placements": {"tp": "S(0)"}},
        {"pattern": "model.layers.*.mlp.down_proj.weight", "placements": {"tp": "S(1)"}},
    ],
}
TP = {"model.embed_tokens.weight": Shard(1), "model.layers.0.self_attn.o_proj.weight": Shard(1),
      "model.layers.0.self_attn.q_proj.weight": Shard(0), "model.layers.1.self_attn.k_proj.weight": Shard(0),
      "model.layers.0.mlp.down_proj.weight": Shard(1)}


@pytest.mark.parametrize("mesh_shape,extra", [((2, 2), ()), ((3, 2), ()), ((3, 2), ("--dtype", "fp32", "--compress", "zstd"))],
                         ids=["2x2", "3x2", "3x2-fp32-zstd"])
def test_convert_writes_what_fully_shard_over_tp_holds(tmp_path, cli, mesh_shape, extra):
    """`reshard convert --mesh dp_shard=D,tp=T --plan`: each rank file's entries are the local
    tensors FSDP2 over TP holds (TP split by torch's Shard._split_tensor, then FSDP2's
    _chunk_with_empty), read back through the C++ reader; verify --source and export agree."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    src = {"model.embed_tokens.weight": torch.randn(11, 6, generator=g).to(torch.bfloat16),
           "model.layers.0.self_attn.q_proj.weight": torch.randn(7, 6, generator=g),
           "model.layers.1.self_attn.k_proj.weight": torch.randn(3, 6, generator=g),
           "model.layers.0.self_attn.o_proj.weight": torch.randn(6, 7, generator=g),
           "model.layers.0.mlp.down_proj.weight": torch.randn(5, 10, generator=g).to(torch.float16),
           "model.norm.weight": torch.randn(6, generator=g),
           "scalar": torch.tensor(3.0)}
    (tmp_path / "src").mkdir()
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    (tmp_path / "toy_tp.json").write_text(json.dumps(PLAN))
    out = tmp_path / "out"
    dp, tp = mesh_shape
    cli("convert", tmp_path / "src", "-o", out, "--mesh", f"dp_shard={dp},tp={tp}", "--plan",
        tmp_path / "toy_tp.json", "--json", *extra, rc=0, env={"RESHARD_MODEL_CAPTURE": "0"})
    dtype = torch.float32 if "fp32" in extra else None
    manifest = json.loads((out / "reshard.json").read_text())
    (key, layout), = manifest["layouts"].items()
    assert key.startswith(f"dtensor-dp_shard{dp}.tp{tp}-toy_tp.") and layout["kind"] == "dtensor"
    for rank in range(dp * tp):
        c = coordinate(mesh_shape, rank)
        f = _C.RankFile.open(str(out / key / f"rank-{rank:05d}-of-{dp * tp:05d}.reshard"))
        header = json.loads(f.header_json())
        assert header["coordinate"] == c == f.coordinate
        assert f.mesh == (["dp_shard", "tp"], [dp, tp]) and f.kind == "dtensor"
        assert {t.name: t.placements for t in f.tensors} == {e["name"]: e["placements"] for e in header["tensors"]}
        entries = {e["name"]: e for e in header["tensors"]}
        host, targets = {}, []
        for name, e in entries.items():
            host[name] = torch.empty(e["local_shape"], dtype=dtype or src[name].dtype)
            targets.append(_C.LoadTarget(name, host[name].data_ptr(), e["nbytes"], False))
        f.load(targets, device=0, threads=1)
        for name, t in src.items():
            if t.dim() == 0:
                want, placements = t, ["R", "R"]
            else:
                tp_p = TP.get(name, Replicate())
                local = split(tp_p, t, tp, c[1])
                chunk = _chunk_with_empty(local, dp, dim=0)[c[0]]
                want = chunk.reshape(_get_dim_chunked_size(chunk, local.size(), 0))
                sf = tp if tp_p == Shard(0) else 1
                placements = [placement_str(_StridedShard(0, split_factor=sf) if sf > 1 else Shard(0)),
                              placement_str(tp_p)]
            assert entries[name]["placements"] == placements, name
            want = want.to(dtype or want.dtype)
            assert list(host[name].shape) == list(want.shape), (name, rank)
            assert torch.equal(host[name], want), (name, rank)
    # A reader of FSDP2 files only (the pure-Python reference reader) refuses at the kind, as
    # formats/rank-file.md says readers written before DTensor layouts do.
    import reference_reader
    with pytest.raises(reference_reader.FormatError, match="layout.kind"):
        reference_reader.RankFile.open(str(out / key / f"rank-00000-of-{dp * tp:05d}.reshard"))
    cli("verify", out, "--source", tmp_path / "src", rc=0)
    cli("export", out, "-o", tmp_path / "exp", rc=0)
    back = {}
    for p in (tmp_path / "exp").glob("*.safetensors"):
        back.update(load_file(str(p)))
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        t = t.to(dtype or t.dtype)
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_an_alias_never_gives_a_tensor_another_ones_placements(monkeypatch):
    """placed_tensors lists each tensor also under its name with / without the base model
    prefix (as checkpoints spell it); where that alias is another tensor's own name (a model
    holding both `model.w` and `w`), the other tensor keeps its own placements."""
    from reshard import load_dtensor

    own = {"model.w": (["S(0)", "R"], 0), "w": (["R", "S(1)"], None)}
    monkeypatch.setattr(load_dtensor, "live_placements", lambda job, name, p: own[name])
    job = load_dtensor.DTensorJob(names=("dp", "tp"), shape=(2, 2), coordinate=(0, 0), rank=0, fsdp_dims={})
    params = {"model.w": torch.zeros(4, 4), "w": torch.zeros(4, 4)}
    tensors, placed = load_dtensor.placed_tensors(job, params, [("model.b", 1)], prefix="model")
    by_name = {t[0]: t for t in tensors}
    assert len(by_name) == len(tensors)  # each name once
    assert by_name["w"][3] == ["R", "S(1)"] and by_name["w"][4] == -1
    assert by_name["model.w"][3] == ["S(0)", "R"] and by_name["model.w"][4] == 0
    # an alias that is nobody's own name is still listed (the buffer as the checkpoint spells it)
    assert by_name["b"][2] is True and by_name["model.b"][2] is True
    assert placed == {"model.w": (["S(0)", "R"], 0), "w": (["R", "S(1)"], -1), "model.b": (["R", "R"], -1)}


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 3), (4, 1)], ids=lambda m: "x".join(map(str, m)))
def test_experts_fully_shard_on_dim1_follows_fsdp2(mesh_shape):
    """torchtitan's experts when efsdp x ep > experts: Shard(0) over ep (mesh dim 1), then
    fully_shard(shard_placement_fn=lambda p: Shard(1)) over efsdp (mesh dim 0): FSDP2's
    _chunk_with_empty of the ep-local tensor on dim 1 (FSDPParam._init_sharded_param; FSDP2
    needs it even). torch records [S(1), S(0)] (dim 1 is not cut by ep: no _StridedShard); a
    plan rule with "fsdp_dim": 1 gives exactly that, and the map the elements FSDP2 holds."""
    efsdp, ep = mesh_shape
    plan = {"format": "reshard.parallel-plan", "format_version": 1, "name": "moe", "fsdp": {"mesh_dim": "efsdp"},
            "rules": [{"pattern": "w", "placements": {"ep": "S(0)"}, "fsdp_dim": 1}]}
    for experts in (1, 2, 3, 4, 6):
        if experts % ep:
            continue
        shape = (experts, 2 * efsdp * 3, 5)  # dim 1 a multiple of efsdp: FSDP2's Shard(1) is even only
        g = torch.arange(torch.Size(shape).numel()).reshape(shape)
        key, _, _, canonical = _C.plan_of_placements(
            "moe", ["efsdp", "ep"], list(mesh_shape), [("w", 3, False, ["S(1)", "S(0)"], 0)])
        got_plan = json.loads(canonical)
        assert got_plan["fsdp"] == {"dim": 0, "mesh_dim": "efsdp"}, got_plan
        assert got_plan["rules"] == [dict(plan["rules"][0], placements={"ep": "S(0)"})], got_plan
        for rank in range(efsdp * ep):
            c = coordinate(mesh_shape, rank)
            ep_local = split(Shard(0), g, ep, c[1])
            local = _chunk_with_empty(ep_local, efsdp, dim=1)[c[0]]
            assert reshard_elements(shape, ["S(1)", "S(0)"], mesh_shape, rank, fsdp_mesh_dim=0) == (
                list(local.shape), local.reshape(-1).tolist()), (mesh_shape, experts, rank)


def test_convert_writes_what_experts_fully_shard_on_dim1_hold(tmp_path, cli):
    """`reshard convert --mesh efsdp=2,ep=2 --plan` with the experts' rules "fsdp_dim": 1 (the
    plan python -m reshard.ep writes when efsdp x ep > experts), the other tensors on the plan's
    fsdp.dim 0 (1-D ones included): each rank file holds what FSDP2 holds (ep's Shard(0), then
    _chunk_with_empty on dim 1 over efsdp); verify --source and export give the checkpoint back."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    src = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 8, 6, generator=g).to(torch.bfloat16),
           "model.layers.0.mlp.experts.down_proj": torch.randn(2, 6, 4, generator=g),
           "model.layers.0.mlp.gate.weight": torch.randn(2, 6, generator=g),
           "model.norm.weight": torch.randn(7, generator=g)}
    (tmp_path / "src").mkdir()
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    experts = ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]
    plan = {"format": "reshard.parallel-plan", "format_version": 1, "name": "moe_ep", "fsdp": {"mesh_dim": "efsdp"},
            "rules": [{"pattern": p, "placements": {"ep": "S(0)"}, "fsdp_dim": 1} for p in experts]}
    (tmp_path / "moe_ep.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    cli("convert", tmp_path / "src", "-o", out, "--mesh", "efsdp=2,ep=2", "--plan", tmp_path / "moe_ep.json",
        rc=0, env={"RESHARD_MODEL_CAPTURE": "0"})
    (key, _), = json.loads((out / "reshard.json").read_text())["layouts"].items()
    for rank in range(4):
        c = coordinate((2, 2), rank)
        f = _C.RankFile.open(str(out / key / f"rank-{rank:05d}-of-00004.reshard"))
        entries = {t.name: t for t in f.tensors}
        host, targets = {}, []
        for name, e in entries.items():
            host[name] = torch.empty(e.local_shape, dtype=src[name].dtype)
            targets.append(_C.LoadTarget(name, host[name].data_ptr(), e.nbytes, False))
        f.load(targets, device=0, threads=1)
        for name, t in src.items():
            if "experts" in name:
                want, placements = _chunk_with_empty(split(Shard(0), t, 2, c[1]), 2, dim=1)[c[0]], ["S(1)", "S(0)"]
            else:
                want, placements = _chunk_with_empty(t, 2, dim=0)[c[0]], ["S(0)", "R"]
            assert entries[name].placements == placements and entries[name].fsdp_mesh_dim == 0, name
            assert torch.equal(host[name], want), (name, rank)
    cli("verify", out, "--source", tmp_path / "src", rc=0)
    cli("export", out, "-o", tmp_path / "exp", rc=0)
    back = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    # Without the rules' fsdp_dim but fsdp.dim 1 for all: the 1-D norm cannot take it, named.
    bad = dict(plan, fsdp={"mesh_dim": "efsdp", "dim": 1}, rules=[{"pattern": p, "placements": {"ep": "S(0)"}}
                                                                 for p in experts])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = cli("convert", tmp_path / "src", "-o", tmp_path / "bad", "--mesh", "efsdp=2,ep=2", "--plan",
            tmp_path / "bad.json", rc=None, env={"RESHARD_MODEL_CAPTURE": "0"})
    assert r.rc != 0 and "model.norm.weight" in r.text and "fsdp_dim" in r.text, r.text
