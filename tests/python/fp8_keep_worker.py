"""One rank (CUDA/NCCL) of the FP8 keep-policy load test (test_fp8.py, marked gpu): builds the
FP8 model as from_pretrained does on a GPU (transformers' own FineGrainedFP8HfQuantizer with
dequantize off: FP8Linear / FP8Experts holding each float8_e4m3fn weight and its float32
weight_scale_inv), empty on the meta device; FSDP2 over the decoder layers and the root;
reshard.load of the keep-policy rank files; every parameter's full_tensor() and buffer equal
to from_pretrained(device_map="cuda") bit for bit."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import reshard
from reshard.conversion import quantizer_for
from dist_util import worker_main


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--manifest", required=True)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (world,))

    model = reshard.empty_model(args.src)
    quantizer_for(model.config, "keep")._process_model_before_weight_loading(model)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if type(m).__name__ in no_split:
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda")
    reshard.load(model, args.out)

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(args.src, device_map="cuda")
    ref_params = dict(ref.named_parameters())
    n_fp8 = 0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        want = ref_params[name]
        assert full.dtype == want.dtype and full.shape == want.shape, (name, full.dtype, want.dtype)
        assert torch.equal(bits(full), bits(want)), f"parameter {name} differs from from_pretrained"
        n_fp8 += want.dtype == torch.float8_e4m3fn
    assert n_fp8 > 0 and len(ref_params) == len(dict(model.named_parameters()))
    print(f"rank {rank}: OK, {len(ref_params)} parameters ({n_fp8} FP8) equal to from_pretrained")
    dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(main)
