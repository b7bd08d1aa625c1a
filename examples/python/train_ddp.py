#!/usr/bin/env python3
"""Data-parallel training of sdmha.torch.SparseQueryMultiheadAttention with
torch.nn.parallel.DistributedDataParallel (gloo, CPU).

Each step every process draws the same global batch of sparse queries (a regression task: the
target is a fixed random function of the query), takes its own slice of it, and DDP averages the
gradients: after N steps every process holds the weights that one process would hold after N steps
on the whole batch (python/tests/test_distributed.py checks exactly that).

One machine, two processes (spawned here, MASTER_ADDR=127.0.0.1 and a free port):

    PYTHONPATH=build-py/python python3 examples/python/train_ddp.py --spawn 2 --steps 20

Several machines, with torchrun (2 machines x 2 processes; run on each, --node_rank 0 and 1):

    PYTHONPATH=<build>/python torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 \
        --master_addr <address of node 0> --master_port 29500 examples/python/train_ddp.py --steps 20

(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; Debian's python3-torch has it as
`python3 -m torch.distributed.run`.)
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from sdmha.torch import SparseQueryMultiheadAttention

# The problem: small enough for a test, sparse like a bag of words.
SHAPE = dict(batch=8, steps=6, features=64, key_steps=5, width=12, heads=2, key_dim=4)


def build_model(seed=0, dtype=torch.float64, num_threads=1):
    torch.manual_seed(seed)
    s = SHAPE
    return SparseQueryMultiheadAttention(s["heads"], s["key_dim"], s["features"], s["width"], s["width"],
                                         output_dim=s["width"], dtype=dtype, num_threads=num_threads)


def global_batch(step, seed=0, dtype=torch.float64):
    """The step's whole batch (the same on every process): sparse query, key, value, target."""
    s = SHAPE
    generator = torch.Generator().manual_seed(seed * 100003 + step)
    dense = torch.randn(s["batch"], s["steps"], s["features"], generator=generator, dtype=torch.float64)
    dense = dense * (torch.rand(dense.shape, generator=generator) < 0.1)
    key = torch.randn(s["batch"], s["key_steps"], s["width"], generator=generator, dtype=torch.float64)
    value = torch.randn(s["batch"], s["key_steps"], s["width"], generator=generator, dtype=torch.float64)
    mixing = torch.randn(s["features"], s["width"], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    target = torch.tanh(dense @ mixing / 4) + value.mean(1, keepdim=True)
    return dense.to(dtype), key.to(dtype), value.to(dtype), target.to(dtype)


def local_slice(tensors, rank, world_size):
    """This process's share of the batch, the query made sparse (COO)."""
    dense, key, value, target = tensors
    per_rank = dense.shape[0] // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return dense[part].to_sparse(), key[part], value[part], target[part]


def train(model, steps, rank=0, world_size=1, lr=0.1, seed=0, log=False):
    """SGD on the mean squared error; with world_size > 1 `model` is the DDP wrapper."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        query, key, value, target = local_slice(global_batch(step, seed, dtype), rank, world_size)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(query, key, value), target)
        loss.backward()
        optimizer.step()
        if log and rank == 0:
            print(f"step {step:3d}  loss (rank 0's slice) {loss.item():.5f}", flush=True)
    return model


def worker(rank, world_size, port, steps, result_path, seed, log):
    """One process of a local run (torch.multiprocessing.spawn's target)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = DistributedDataParallel(build_model(seed))
        train(model, steps, rank, world_size, seed=seed, log=log)
        if result_path and rank == 0:
            torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, result_path)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spawn", type=int, default=0,
                        help="start this many local processes (otherwise: one process of a torchrun job)")
    parser.add_argument("--save", default="", help="rank 0 saves the final state_dict here")
    args = parser.parse_args()
    if args.spawn:
        mp.spawn(worker, args=(args.spawn, free_port(), args.steps, args.save, args.seed, True), nprocs=args.spawn)
        return
    # Under torchrun: rank, world size and the rendezvous come from the environment.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if SHAPE["batch"] % world_size:
            raise SystemExit(f"the batch of {SHAPE['batch']} does not split over {world_size} processes")
        model = DistributedDataParallel(build_model(args.seed))
        train(model, args.steps, rank, world_size, seed=args.seed, log=True)
        if args.save and rank == 0:
            torch.save(model.module.state_dict(), args.save)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
