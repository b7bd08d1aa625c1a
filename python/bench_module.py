#!/usr/bin/env python3
"""Times the PyTorch module sdmha.torch.SparseQueryMultiheadAttention against sdmha's C++ calls
through the binding, and a training step against the same step done densely with torch ops.

    PYTHONPATH=build-py/python python3 python/bench_module.py [--threads 2] [--reps 5] [--json out.json]

1. `seed` 1 % (B=32, T=128, Eq=512, S=128, Ek=Ev=512, H=8, Dk=64, O=512, 5 stored values per
   row), float32: module forward + backward (autograd, a sparse COO query whose values require
   grad, key and value requiring grad) against the same C++ work called directly on NumPy arrays
   (project_context, forward and backward with a kept Workspace), the overhead of the torch layer.
2. `bow` 1 % (B=8, T=128, Eq=32768, S=256, Ek=Ev=512, H=8, Dk=64, O=512, 328 values per row),
   float32, a training step (forward, backward of a mean squared error, SGD update): the module,
   against the same layer written with dense torch ops on the densified query (matmuls and
   softmax, autograd), and against torch.sparse.mm for the query projection (dense elsewhere).

Both use --threads for sdmha's workers and for torch's intra-op threads. The variants compared
run in turns (one warm-up each, then --reps / --dense-reps rounds); prints the median and the
minimum in milliseconds.
"""

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

# Run as a script, this file's folder comes first on sys.path, and python/sdmha there is the
# source package without the compiled extension: the build's (PYTHONPATH) must win.
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == pathlib.Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np
import torch

import sdmha
from sdmha.torch import SparseQueryMultiheadAttention

WORKLOADS = {
    # B, T, Eq, S, E (key/value width), H, Dk, O, stored values per row
    "seed": (32, 128, 512, 128, 512, 8, 64, 512, 5),
    "bow": (8, 128, 32768, 256, 512, 8, 64, 512, 328),
}


def interleaved(functions, reps):
    """{name: (median ms, min ms)} of the functions run in turns, so that a change of the
    machine's load during the run hits every one alike."""
    for function in functions.values():
        function()  # warm-up: workspace sized, threads started, buffers recycled
    times = {name: [] for name in functions}
    for _ in range(reps):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def sparse_rows(rng, rows, features, per_row):
    columns = np.stack([np.sort(rng.choice(features, per_row, replace=False)) for _ in range(rows)])
    values = rng.standard_normal(rows * per_row).astype(np.float32)
    indptr = np.arange(rows + 1, dtype=np.int32) * per_row
    return indptr, columns.reshape(-1).astype(np.int32), values


def make_module(shape, threads):
    B, T, Eq, S, E, H, Dk, O, _ = shape
    torch.manual_seed(1)
    return SparseQueryMultiheadAttention(H, Dk, Eq, E, E, output_dim=O, num_threads=threads)


def bench_seed(args, results):
    shape = WORKLOADS["seed"]
    B, T, Eq, S, E, H, Dk, O, per_row = shape
    rng = np.random.default_rng(1)
    indptr, columns, values = sparse_rows(rng, B * T, Eq, per_row)
    key = rng.standard_normal((B, S, E), dtype=np.float32)
    value = rng.standard_normal((B, S, E), dtype=np.float32)
    d_output = rng.standard_normal((B, T, O), dtype=np.float32)
    module = make_module(shape, args.threads)

    # The C++ calls through the binding, on the module's own weights (shared memory).
    layer = module._bound().layer
    workspace = sdmha.Workspace("float32")
    query = sdmha.csr_query(B, T, Eq, indptr, columns, values)

    def binding_step():
        context = layer.project_context(key, value, args.threads, workspace=workspace)
        layer.forward(query, key, value, context=context, workspace=workspace, num_threads=args.threads)
        layer.backward(query, key, value, d_output, context=context, workspace=workspace, num_threads=args.threads)

    def binding_forward():
        layer.forward(query, key, value, workspace=workspace, num_threads=args.threads)

    key_t, value_t, d_output_t = (torch.from_numpy(a) for a in (key, value, d_output))
    values_t = torch.from_numpy(values)

    # Key, value and query values that require grad, made once (copying 16 MB of key and value
    # per step would be the bench's cost, not the module's); their gradients are dropped per step.
    key_leaf, value_leaf = key_t.clone().requires_grad_(), value_t.clone().requires_grad_()
    values_leaf = values_t.clone().requires_grad_()

    def module_step():
        # As in training: the query built from values that require grad (coalesced inside).
        module.zero_grad(set_to_none=True)
        key_leaf.grad = value_leaf.grad = values_leaf.grad = None
        output = module(_coo(indptr, columns, values_leaf, B, T, Eq), key_leaf, value_leaf)
        output.backward(d_output_t)

    coalesced = _coo(indptr, columns, values_t, B, T, Eq).coalesce()

    def module_step_coalesced():
        module.zero_grad(set_to_none=True)
        key_leaf.grad = value_leaf.grad = None
        module(coalesced, key_leaf, value_leaf).backward(d_output_t)

    def module_forward():
        with torch.no_grad():
            module(coalesced, key_t, value_t)

    def module_forward_building():
        with torch.no_grad():
            module(_coo(indptr, columns, values_t, B, T, Eq), key_t, value_t)

    timings = interleaved({
        "seed 1%: binding forward (C++ call)": binding_forward,
        "seed 1%: module forward, coalesced query (no_grad)": module_forward,
        "seed 1%: module forward, query built + coalesced (no_grad)": module_forward_building,
        "seed 1%: binding forward+backward (C++ calls)": binding_step,
        "seed 1%: module forward+backward, coalesced query": module_step_coalesced,
        "seed 1%: module forward+backward, query values require grad": module_step,
    }, args.reps)
    for name, timing in timings.items():
        report(results, name, timing)


def _coo(indptr, columns, values, batch, steps, features):
    """The CSR rows as a torch sparse COO query (B, T, Eq) over `values` (a tensor)."""
    rows = np.repeat(np.arange(batch * steps), np.diff(indptr))
    indices = torch.from_numpy(np.stack([rows // steps, rows % steps, columns.astype(np.int64)]))
    return torch.sparse_coo_tensor(indices, values, (batch, steps, features))


def dense_layer(x, key, value, w, shape, sparse=False):
    """Keras' MultiHeadAttention with torch ops; x dense (B, T, Eq), or sparse (B*T, Eq) COO."""
    B, T, Eq, S, E, H, Dk, O, _ = shape
    if sparse:
        q = torch.sparse.mm(x, w["query_kernel"]) + w["query_bias"]
    else:
        q = x.reshape(B * T, Eq) @ w["query_kernel"] + w["query_bias"]
    k = key @ w["key_kernel"] + w["key_bias"]
    v = value @ w["value_kernel"] + w["value_bias"]
    q = q.view(B, T, H, Dk).transpose(1, 2) * (1.0 / math.sqrt(Dk))
    k = k.view(B, S, H, Dk).transpose(1, 2)
    v = v.view(B, S, H, Dk).transpose(1, 2)
    p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
    heads = (p @ v).transpose(1, 2).reshape(B, T, H * Dk)
    return heads @ w["output_kernel"] + w["output_bias"]


def bench_bow(args, results):
    shape = WORKLOADS["bow"]
    B, T, Eq, S, E, H, Dk, O, per_row = shape
    rng = np.random.default_rng(2)
    indptr, columns, values = sparse_rows(rng, B * T, Eq, per_row)
    key = torch.from_numpy(rng.standard_normal((B, S, E), dtype=np.float32))
    value = torch.from_numpy(rng.standard_normal((B, S, E), dtype=np.float32))
    target = torch.from_numpy(rng.standard_normal((B, T, O), dtype=np.float32))
    query = _coo(indptr, columns, torch.from_numpy(values), B, T, Eq).coalesce()
    rate = 1e-3

    module = make_module(shape, args.threads)
    optimizer = torch.optim.SGD(module.parameters(), lr=rate)

    def module_step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(module(query, key, value), target)
        loss.backward()
        optimizer.step()

    # The same parameters as plain tensors for the torch versions.
    weights = {name: p.detach().clone().requires_grad_() for name, p in module.named_parameters()}
    dense_optimizer = torch.optim.SGD(weights.values(), lr=rate)
    dense_query = query.to_dense()
    sparse_2d = torch.sparse_coo_tensor(
        torch.stack([query.indices()[0] * T + query.indices()[1], query.indices()[2]]), query.values(),
        (B * T, Eq)).coalesce()

    # Same numbers: the module and the dense torch layer agree before timing.
    with torch.no_grad():
        difference = (module(query, key, value) - dense_layer(dense_query, key, value, weights, shape)).abs().max()
    assert float(difference) < 1e-3, f"module and dense torch disagree by {float(difference)}"

    def torch_step(sparse):
        def step():
            dense_optimizer.zero_grad(set_to_none=True)
            x = sparse_2d if sparse else dense_query
            loss = torch.nn.functional.mse_loss(dense_layer(x, key, value, weights, shape, sparse), target)
            loss.backward()
            dense_optimizer.step()
        return step

    timings = interleaved({
        "bow 1% train step: module (sdmha)": module_step,
        "bow 1% train step: dense torch (densified query)": torch_step(False),
        "bow 1% train step: torch.sparse.mm query projection": torch_step(True),
    }, args.dense_reps)
    for name, timing in timings.items():
        report(results, name, timing)


def report(results, name, timing):
    median, best = timing
    results[name] = {"median_ms": median, "min_ms": best}
    print(f"{name:58s} {median:10.2f} ms (min {best:.2f})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's intra-op threads (0: --threads)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of each seed figure")
    parser.add_argument("--dense-reps", type=int, default=5, help="timed repetitions of each bow step")
    parser.add_argument("--workloads", default="seed,bow")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads or args.threads)
    print(f"sdmha {sdmha.__version__}, torch {torch.__version__}, {args.threads} threads "
          f"(torch {torch.get_num_threads()}), "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average before "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    results = {}
    if "seed" in args.workloads:
        bench_seed(args, results)
    if "bow" in args.workloads:
        bench_bow(args, results)
    load = os.getloadavg()
    print("load average after " + ", ".join(f"{x:.2f}" for x in load)
          + " (other work on the machine slows every path: compare ratios, not times)")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"threads": args.threads, "torch": torch.__version__, "load_after": load, "results": results},
                      stream, indent=2)


if __name__ == "__main__":
    main()
