"""`reshard convert` speed on pytorch_model.bin (torch zip) sources beside the same tensors in
safetensors, in one run (warm page cache, world size 8, raw).

The checkpoint (Llama-shaped bf16, random data) is written in both formats by a child process
(so this process imports no torch); then each format is converted --reps times after one
discarded warm-up, timing the child's wall clock and reading its own peak RSS through a small
wrapper process (common.time_child). GB = 1e9 tensor bytes. Prints a table; --json-out writes JSON."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from common import time_child

GEN = r'''
import json, os, sys, torch
from safetensors.torch import save_file
root, size_gb = sys.argv[1], float(sys.argv[2])
hidden, inter, vocab = 2048, 5632, 32000
layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
layers = max(1, int((size_gb * 1e9 / 2 - 2 * vocab * hidden) // layer))
torch.manual_seed(0)
names = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
for i in range(layers):
    p = f"model.layers.{i}."
    for n in ("q", "k", "v", "o"):
        names[p + f"self_attn.{n}_proj.weight"] = (hidden, hidden)
    names[p + "mlp.gate_proj.weight"] = (inter, hidden)
    names[p + "mlp.up_proj.weight"] = (inter, hidden)
    names[p + "mlp.down_proj.weight"] = (hidden, inter)
    names[p + "input_layernorm.weight"] = (hidden,)
    names[p + "post_attention_layernorm.weight"] = (hidden,)
keys = sorted(names)
files = 4
groups = [keys[i::files] for i in range(files)]
for fmt in ("st", "bin"):
    os.makedirs(os.path.join(root, fmt), exist_ok=True)
wm_st, wm_bin = {}, {}
for g, group in enumerate(groups):
    sd = {k: (0.02 * torch.randn(names[k])).to(torch.bfloat16) for k in group}
    st = f"model-{g + 1:05d}-of-{files:05d}.safetensors"
    bn = f"pytorch_model-{g + 1:05d}-of-{files:05d}.bin"
    save_file(sd, os.path.join(root, "st", st))
    torch.save(sd, os.path.join(root, "bin", bn))
    wm_st.update({k: st for k in group}); wm_bin.update({k: bn for k in group})
    del sd
json.dump({"metadata": {}, "weight_map": wm_st}, open(os.path.join(root, "st", "model.safetensors.index.json"), "w"))
json.dump({"metadata": {}, "weight_map": wm_bin}, open(os.path.join(root, "bin", "pytorch_model.bin.index.json"), "w"))
print(sum(2 * torch.Size(s).numel() for s in names.values()))
'''


def run(cmd):
    """Wall seconds and the child's own peak RSS in MiB (common.time_child)."""
    seconds, usage, rc, _, err = time_child(cmd)
    if rc != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{err}")
    return seconds, usage["rss_kib"] / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--workdir", default=".work/bench-bin")
    ap.add_argument("--reshard", default="build/reshard")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    root = os.path.abspath(args.workdir)
    marker = os.path.join(root, f"made-{args.size_gb:g}")
    if not os.path.exists(marker):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        out = subprocess.run([args.python, "-c", GEN, root, str(args.size_gb)], check=True,
                             capture_output=True, text=True).stdout
        open(marker, "w").write(out.strip())
    nbytes = int(open(marker).read())
    results = {}
    for fmt in ("st", "bin"):
        src, out = os.path.join(root, fmt), os.path.join(root, f"out-{fmt}")
        cmd = [args.reshard, "convert", src, "-o", out, "--world-size", str(args.world_size)]
        times, rss = [], []
        for rep in range(args.reps + 1):  # first run warms the page cache, discarded
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            s, r = run(cmd)
            if rep:
                times.append(s)
                rss.append(r)
        subprocess.run([args.reshard, "verify", out, "--source", src], check=True,
                       stdout=subprocess.DEVNULL)
        med = statistics.median(times)
        results[fmt] = {"seconds": times, "median_s": med, "gbps": nbytes / med / 1e9,
                        "gbps_range": [nbytes / max(times) / 1e9, nbytes / min(times) / 1e9],
                        "peak_rss_mib": max(rss)}
    print(f"{nbytes / 1e9:.3f} GB of tensors, world size {args.world_size}, warm, median of {args.reps}:")
    for fmt, r in results.items():
        name = "safetensors" if fmt == "st" else "pytorch_model.bin"
        print(f"  {name:18s} {r['median_s']:.2f} s  {r['gbps']:.2f} GB/s "
              f"[{r['gbps_range'][0]:.2f}-{r['gbps_range'][1]:.2f}]  peak RSS {r['peak_rss_mib']:.1f} MiB")
    print(f"  bin / safetensors speed: {results['bin']['gbps'] / results['st']['gbps']:.2f}")
    if args.json_out:
        json.dump({"bytes": nbytes, "results": results}, open(args.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
