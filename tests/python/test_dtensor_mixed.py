"""DTensor jobs with plain parameters beside DTensors that fully_shard did not make
(tests/python/dtensor_mixed_worker.py, gloo, CPU): a Shard(0) DTensor counts as FSDP2's only
when fully_shard manages it. Each load is compared bit for bit against from_pretrained of the
same save_pretrained checkpoint (every parameter's full tensor, every buffer):

- 2 processes, tp=2: a Llama with only lm_head ColwiseParallel (the rest plain, nothing
  fully_shard'ed) loads from the checkpoint, saves (a DTensor layout) and loads from the save;
  so does a Marian with fc1 / fc2 tensor parallel (its sinusoidal embed_positions is never saved
  and is computed, its tied embeddings and final_logits_bias buffer restored). A checkpoint of
  another config is refused with a convert command that does not write into the checkpoint; a
  Partial placement is refused (load and save) naming the parameter and the mesh dim.
- 4 processes: expert parallel without FSDP over the experts (Shard(0) over a 1-D ep=2 mesh, the
  dense parameters fully_shard'ed over fsdp=4) loads from the checkpoint; with the experts
  (Replicate, Shard(0)) over efsdp=2 x ep=2 it also saves and loads from the save."""

import glob
import json
import os

from dist_util import HERE, torchrun
from dtensor_common import tiny_llama, tiny_mixtral

WORKER = os.path.join(HERE, "dtensor_mixed_worker.py")


def tiny_marian(d) -> None:
    import torch
    import transformers

    cfg = transformers.MarianConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                    decoder_ffn_dim=48, max_position_embeddings=32, pad_token_id=63,
                                    decoder_start_token_id=63)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(cfg)
    assert "model.encoder.embed_positions.weight" in (model._keys_to_ignore_on_save or ())
    model.save_pretrained(d)


def _records(result, mode, n):
    recs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(result, f"{mode}-rank-*.json")))]
    assert len(recs) == n
    return recs


def _round_trip(rec, name, mesh):
    got = rec[name]
    assert "error" not in got, (name, got)
    assert got["differ"] == [] and "Hugging Face checkpoint" in got["source"], (name, got)
    assert got["layout"].startswith(f"dtensor-{mesh}-live."), (name, got)
    saved = [k for k in got["saved_layouts"] if k.startswith("dtensor-")]
    assert len(saved) == 1 and saved[0].startswith(f"dtensor-{mesh}-saved."), (name, got)
    back = rec[name + "_saved"]
    assert "error" not in back, (name, back)
    assert back["differ"] == [] and back["source"].startswith(f"layout {saved[0]} "), (name, back)


def test_partly_tensor_parallel_loads_and_saves(tmp_path):
    llama, other, marian, result = (tmp_path / n for n in ("llama", "other", "marian", "result"))
    tiny_llama(llama)
    tiny_llama(other, intermediate_size=80)
    tiny_marian(marian)
    result.mkdir()
    torchrun(2, WORKER, "tp", llama, marian, other, result, timeout=300)
    for rec in _records(result, "tp", 2):
        _round_trip(rec, "head", "tp2")
        _round_trip(rec, "marian", "tp2")
        assert rec["submodule_job"] == "None", rec["submodule_job"]
        got = rec["submodule"]
        assert "error" not in got and got["differ"] == [], got
        assert got["layout"].startswith("fsdp2-ws2") and "Hugging Face checkpoint" in got["source"], got
        err = rec["other"]["error"]
        assert err.startswith("LayoutMismatchError") and "global shape" in err, err
        assert "reshard convert <checkpoint> -o OUT --mesh tp=2" in err and f"-o {other}" not in err, err
        for what in ("load", "save"):
            err = rec["partial"][what]
            assert err.startswith("UnsupportedError") and "parameter model.norm.weight: placement P(sum) on " \
                "mesh dim tp" in err and "Redistribute" in err and "Replicate" in err, (what, err)


def test_expert_parallel_without_fsdp_over_the_experts(tmp_path):
    mixtral, result = tmp_path / "mixtral", tmp_path / "result"
    tiny_mixtral(mixtral)
    result.mkdir()
    torchrun(4, WORKER, "ep", mixtral, result, timeout=300)
    for rec in _records(result, "ep", 4):
        got = rec["ep1d"]
        assert "error" not in got and got["differ"] == [], got
        assert got["layout"].startswith("dtensor-ep2-live.") and "fsdp2-ws4" in got["layout"], got
        _round_trip(rec, "ep2d", "efsdp2.ep2")
        assert "fsdp2-ws4" in rec["ep2d"]["saved_layouts"], rec["ep2d"]
