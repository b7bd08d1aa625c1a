#!/usr/bin/env python3
"""PyTorch peer for sdmha_bench: the same layer on the same workloads, the way a PyTorch user would
write it with a sparse query — torch.sparse.mm for the query projection, batched matmuls for the
rest (Keras math: scale 1/sqrt(key_dim), softmax, P·V, output projection).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python3 bench/peers/torch_peer.py [--threads 2] [--json FILE]

Needs Debian's python3-torch (1.13) and an optimised BLAS (libopenblas0-pthread; without it
Debian's torch falls back to the reference BLAS and is 5-10x slower):
    apt-get install python3-torch libopenblas0-pthread Shapes, densities and the row structure (the same number of
stored values per row at distinct uniformly random columns, N(0, 1) values) follow
WORKLOADS.md; the random numbers are numpy's, not sdmha_bench's, which does not change the work.
Prints one line per workload × density with the median forward time in ms over repetitions.
"""
import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

WORKLOADS = [
    # name, B, T, Eq, S, E (key/value width), H, Dk, O, densities
    ("seed", 32, 128, 512, 128, 512, 8, 64, 512, [0.01, 0.05, 0.10]),
    ("bow", 8, 128, 32768, 256, 512, 8, 64, 512, [0.001, 0.01]),
    ("long", 2, 2048, 512, 2048, 512, 8, 64, 512, [0.05]),
]


def sparse_query(rng, rows, features, density):
    per_row = max(1, int(round(density * features)))
    columns = np.stack([rng.choice(features, per_row, replace=False) for _ in range(rows)])
    row_index = np.repeat(np.arange(rows), per_row)
    values = rng.standard_normal(rows * per_row).astype(np.float32)
    indices = torch.from_numpy(np.stack([row_index, columns.reshape(-1)]).astype(np.int64))
    # Coalesced COO: in PyTorch 1.13 on this machine torch.sparse.mm is faster on COO than on CSR.
    return torch.sparse_coo_tensor(indices, torch.from_numpy(values), (rows, features)).coalesce()


def glorot(rng, rows, cols, fan_in, fan_out):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return torch.from_numpy(rng.uniform(-limit, limit, (rows, cols)).astype(np.float32))


def forward(x, key, value, w, B, T, S, H, Dk):
    # Query projection straight from the sparse query, then dense batched attention.
    q = torch.sparse.mm(x, w["q"]) + w["bq"]                      # (B·T, H·Dk)
    k = torch.matmul(key, w["k"]) + w["bk"]                        # (B, S, H·Dk)
    v = torch.matmul(value, w["v"]) + w["bv"]
    q = q.view(B, T, H, Dk).transpose(1, 2) * (1.0 / np.sqrt(Dk))  # (B, H, T, Dk)
    k = k.view(B, S, H, Dk).transpose(1, 2)
    v = v.view(B, S, H, Dk).transpose(1, 2)
    p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
    heads = torch.matmul(p, v).transpose(1, 2).reshape(B, T, H * Dk)
    return torch.matmul(heads, w["o"]) + w["bo"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(42)
    rows = []
    print(f"# PyTorch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}")
    with torch.no_grad():
        for name, B, T, Eq, S, E, H, Dk, O, densities in WORKLOADS:
            w = {"q": glorot(rng, Eq, H * Dk, Eq * H, Eq * Dk), "k": glorot(rng, E, H * Dk, E * H, E * Dk),
                 "v": glorot(rng, E, H * Dk, E * H, E * Dk), "o": glorot(rng, H * Dk, O, H * Dk, H * O),
                 "bq": torch.zeros(H * Dk), "bk": torch.zeros(H * Dk), "bv": torch.zeros(H * Dk),
                 "bo": torch.zeros(O)}
            key = torch.from_numpy(rng.uniform(-1, 1, (B, S, E)).astype(np.float32))
            value = torch.from_numpy(rng.uniform(-1, 1, (B, S, E)).astype(np.float32))
            for density in densities:
                x = sparse_query(rng, B * T, Eq, density)
                forward(x, key, value, w, B, T, S, H, Dk)  # warm-up
                times = []
                for _ in range(args.repetitions):
                    start = time.perf_counter()
                    forward(x, key, value, w, B, T, S, H, Dk)
                    times.append((time.perf_counter() - start) * 1e3)
                median = statistics.median(times)
                rows.append({"workload": name, "density": density, "threads": args.threads,
                             "torch_ms": median})
                print(f"{name:5s} density {density:<6g} threads {args.threads}: {median:9.2f} ms")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
