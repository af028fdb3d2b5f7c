"""Writes the built-in default checkpoint: a small Llama-style model (about 31 M parameters,
bf16) saved by transformers' own save_pretrained, sharded into several safetensors files.
Deterministic (seed 0); does nothing if DIR already holds it."""

import argparse
import json
import os

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir")
    args = ap.parse_args()
    marker = os.path.join(args.dir, "model.safetensors.index.json")
    if os.path.exists(marker):
        print(f"{args.dir}: default checkpoint already present")
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = args.dir + ".tmp"
    model.save_pretrained(tmp, max_shard_size="20MB")
    os.replace(tmp, args.dir)
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(args.dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    print(f"{args.dir}: Llama-style checkpoint, {n / 1e6:.1f} M parameters (bf16), {len(files)} files")


if __name__ == "__main__":
    main()
