"""One rank of the demo: build the model empty from OUT, shard it with FSDP2, load this
rank's shard with reshard.load and check one forward pass. Run by torchrun."""

import argparse
import os
import resource

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import reshard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    model = reshard.empty_model(args.out)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    report = reshard.load(model, args.out)
    ids = torch.arange(16, device=device).reshape(1, 16)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    line = (f"rank {rank}/{world}: loaded {report.bytes / 1e6:.2f} MB from "
            f"{os.path.relpath(report.file, args.out)} in {report.seconds * 1e3:.1f} ms "
            f"({report.gbps:.2f} GB/s), peak RSS {rss_mb:.0f} MB, loss {loss:.4f}")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
