"""What the DTensor tests share: the tiny Llama (and the expert-parallel tests' tiny Mixtral) they convert (an odd vocabulary: uneven TP and
FSDP shards of the embeddings and the head), the hand-written tensor-parallel plan applied with
torch's styles, and the plan file (formats/parallel-plan.md) that says what it places."""

from __future__ import annotations

import torch
import transformers
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import reshard

_DECODER_RULES = [
    {"pattern": "model.layers.*.self_attn.o_proj.weight", "placements": {"tp": "S(1)"}},
    {"pattern": "model.layers.*.self_attn.*_proj.weight", "placements": {"tp": "S(0)"}},
    {"pattern": "model.layers.*.mlp.gate_proj.weight", "placements": {"tp": "S(0)"}},
    {"pattern": "model.layers.*.mlp.up_proj.weight", "placements": {"tp": "S(0)"}},
    {"pattern": "model.layers.*.mlp.down_proj.weight", "placements": {"tp": "S(1)"}},
]


def llama_plan(name: str, row_embeddings: bool = False) -> dict:
    """The plan of apply_llama_tp: embeddings column-wise (S(1); `row_embeddings`: row-wise, S(0),
    vocab-sharded), q/k/v/gate/up S(0), o/down S(1), the head S(0); norms R."""
    embed = {"pattern": "model.embed_tokens.weight", "placements": {"tp": "S(0)" if row_embeddings else "S(1)"}}
    return {"format": "reshard.parallel-plan", "format_version": 1, "name": name,
            "rules": [embed, *_DECODER_RULES, {"pattern": "lm_head.weight", "placements": {"tp": "S(0)"}}]}


def apply_llama_tp(model, tp, row_embeddings: bool = False) -> None:
    """torch's styles as llama_plan places them. `row_embeddings`: the embeddings row-wise with
    replicated input and the head's output gathered (a forward runs); else both column-wise
    (the placements to load, not a runnable forward)."""
    if row_embeddings:
        top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
               "lm_head": ColwiseParallel(output_layouts=Replicate())}
    else:
        top = {"model.embed_tokens": ColwiseParallel(), "lm_head": ColwiseParallel()}
    parallelize_module(model, tp, top)
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})


def tiny_llama(d, seed: int = 0, **config) -> None:
    """A tiny untied Llama written by save_pretrained in bf16 into `d` (weights drawn from
    `seed`); `config` overrides LlamaConfig's fields (e.g. num_key_value_heads=4 for whole
    heads at tp=4)."""
    cfg = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(config)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16).save_pretrained(d)


def tiny_mixtral(d, **config) -> None:
    """The tiny Mixtral of the expert-parallel tests (4 experts, 2 per token, vocab 37: uneven
    dense shards), written by save_pretrained in bf16 into `d` (seed 0) in the hub layout
    (per-expert w1/w2/w3); `config` overrides MixtralConfig's fields."""
    cfg = dict(vocab_size=37, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               tie_word_embeddings=False)
    cfg.update(config)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg)).to(torch.bfloat16).save_pretrained(d)


def bits(t):
    """A tensor's bytes, for bit-for-bit comparison."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(model, ref) -> list:
    """Names whose full tensor (parameters; full_tensor() of DTensors) or value (buffers) is
    not bit-equal to `ref`'s (from_pretrained's), by the model's clean names."""
    from torch.distributed.tensor import DTensor

    from reshard.model import clean_name

    want, want_b = dict(ref.named_parameters()), dict(ref.named_buffers())
    differ = []
    for name, p in model.named_parameters():
        name = clean_name(name)
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if full.shape != want[name].shape or not torch.equal(bits(full), bits(want[name])):
            differ.append(name)
    for name, b in model.named_buffers():
        name = clean_name(name)
        if b.dtype != want_b[name].dtype or not torch.equal(bits(b), bits(want_b[name])):
            differ.append("buffer " + name)
    return differ


def full(t):
    """A parameter's or a state tensor's whole value, detached (a DTensor's full_tensor())."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def train_step(model, opt, ids) -> float:
    """One optimizer step of the causal-LM loss on `ids`; returns the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(full(loss))


def refused(fn) -> str:
    """The ReshardError `fn()` raises, as "Type: message"; "not refused" when it returns."""
    try:
        fn()
    except reshard.ReshardError as e:
        return f"{type(e).__name__}: {e}"
    return "not refused"

