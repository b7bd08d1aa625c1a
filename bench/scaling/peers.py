#!/usr/bin/env python3
"""The peers of bench/scaling/run.sh: ONNX Runtime and PyTorch at several thread counts.

    peers.py --threads 1,2,4,8,16 [--workloads seed,bow,long] [--onnx-dir DIR] [--json FILE]
             [--repetitions N] [--budget SECONDS] [--steps forward,training]

- PyTorch (when `import torch` works): the layer as bench/peers/torch_peer.py writes it (its
  inputs, weights and forward: torch.sparse.mm for the query projection, batched matmuls for the
  rest), and the same layer on the densified query (a dense matmul for the query projection).
  Forward under no_grad, and the training step: forward, then autograd's backward to every weight
  given a fixed dL/doutput (the gradients dropped before each step, as an optimizer's zero_grad
  with set_to_none does).
- ONNX Runtime (when `import onnxruntime` works and --onnx-dir holds what
  bench/peers/onnx_peer.py --out DIR --densities all wrote): the Keras layer's `keras` and
  `matmul` graphs on the densified query, each checked once against onnx_peer.py's float64
  reference of batch element 0, then timed; the faster graph's median is the peer's figure.
  Forward only: an ONNX graph has no training step.

--steps forward leaves PyTorch's training step out (the bfloat16 comparison's peers: forward only).

Each case: one untimed call, then --repetitions timed calls; the median. --budget: seconds for
the whole script; once spent, what is left is skipped and listed as such in the JSON. Densities: seed 1 %, bow 1 %, long 5 % (bench/workloads.md). The random inputs are numpy's (the
peers' own), not sdmha's; the work is the same.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "..", "peers")
DENSITY = {"seed": 0.01, "bow": 0.01, "long": 0.05}


def median_ms(call, repetitions):
    call()  # untimed: allocations, thread pools, lazy initialisation
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Budget:
    def __init__(self, seconds):
        self.until = time.monotonic() + seconds
        self.skipped = []

    def allows(self, what):
        if time.monotonic() < self.until:
            return True
        self.skipped.append(what)
        print(f"  skipped (time budget spent): {what}", flush=True)
        return False


# ---- PyTorch ----

def torch_cases(torch, torch_peer, spec, rng):
    """The sparse and dense forward and training step of one workload, as callables."""
    name, B, T, Eq, S, E, H, Dk, O, _ = spec
    w = {"q": torch_peer.glorot(rng, Eq, H * Dk, Eq * H, Eq * Dk),
         "k": torch_peer.glorot(rng, E, H * Dk, E * H, E * Dk),
         "v": torch_peer.glorot(rng, E, H * Dk, E * H, E * Dk),
         "o": torch_peer.glorot(rng, H * Dk, O, H * Dk, H * O),
         "bq": torch.zeros(H * Dk), "bk": torch.zeros(H * Dk), "bv": torch.zeros(H * Dk),
         "bo": torch.zeros(O)}
    key = torch.from_numpy(rng.uniform(-1, 1, (B, S, E)).astype("float32"))
    value = torch.from_numpy(rng.uniform(-1, 1, (B, S, E)).astype("float32"))
    x = torch_peer.sparse_query(rng, B * T, Eq, DENSITY[name])
    x_dense = x.to_dense()
    d_output = torch.from_numpy(rng.standard_normal((B, T, O)).astype("float32"))
    dims = (B, T, S, H, Dk)

    def sparse():
        return torch_peer.forward(x, key, value, w, *dims)

    def dense():
        return dense_forward(torch, x_dense, key, value, w, dims)

    def training(forward):
        def step():
            for parameter in w.values():
                parameter.grad = None
            forward().backward(d_output)
        return step

    def no_grad(forward):
        def call():
            with torch.no_grad():
                forward()
        return call

    for parameter in w.values():
        parameter.requires_grad_(True)
    return {"forward_sparse": no_grad(sparse), "forward_dense": no_grad(dense),
            "training_sparse": training(sparse), "training_dense": training(dense)}


def dense_forward(torch, x_dense, key, value, w, dims):
    """torch_peer.forward with the query projection a dense matmul of the densified query."""
    B, T, S, H, Dk = dims
    q = torch.matmul(x_dense, w["q"]) + w["bq"]
    k = torch.matmul(key, w["k"]) + w["bk"]
    v = torch.matmul(value, w["v"]) + w["bv"]
    q = q.view(B, T, H, Dk).transpose(1, 2) * (1.0 / Dk ** 0.5)
    k = k.view(B, S, H, Dk).transpose(1, 2)
    v = v.view(B, S, H, Dk).transpose(1, 2)
    p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
    heads = torch.matmul(p, v).transpose(1, 2).reshape(B, T, H * Dk)
    return torch.matmul(heads, w["o"]) + w["bo"]


def run_torch(args, threads, budget):
    try:
        import numpy as np
        import torch
        sys.path.insert(0, PEERS)
        import torch_peer
    except ImportError as error:
        print(f"PyTorch peer skipped: {error}", flush=True)
        return {"skipped": str(error)}
    print(f"# PyTorch {torch.__version__}", flush=True)
    rows = []
    for spec in torch_peer.WORKLOADS:
        if spec[0] not in args.workloads:
            continue
        cases = torch_cases(torch, torch_peer, spec, np.random.default_rng(42))
        for count in threads:
            if not budget.allows(f"torch {spec[0]} {count} threads"):
                continue
            torch.set_num_threads(count)
            row = {"workload": spec[0], "density": DENSITY[spec[0]], "threads": count}
            for case, call in cases.items():
                if case.split("_")[0] in args.steps:
                    row[case + "_ms"] = median_ms(call, args.repetitions)
            rows.append(row)
            print(f"torch {spec[0]:5s} {count:3d} threads: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    return {"version": torch.__version__, "rows": rows}


# ---- ONNX Runtime ----

def onnx_session(ort, path, count):
    options = ort.SessionOptions()
    options.intra_op_num_threads = count
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def onnx_inputs(np, folder, entry, density):
    shape = lambda *dims: tuple(entry[d] for d in dims)
    query = np.fromfile(os.path.join(folder, f"query_{density:g}.bin"), np.float32)
    feeds = {"query": query.reshape(shape("B", "T", "Eq")),
             "key": np.fromfile(os.path.join(folder, "key.bin"), np.float32).reshape(shape("B", "S", "E")),
             "value": np.fromfile(os.path.join(folder, "value.bin"), np.float32).reshape(shape("B", "S", "E"))}
    reference = np.fromfile(os.path.join(folder, f"ref_{density:g}.f64.bin"), np.float64)
    return feeds, reference.reshape(-1, entry["T"], entry["O"])


def run_onnx(args, threads, budget):
    try:
        import numpy as np
        import onnxruntime as ort
    except ImportError as error:
        print(f"ONNX Runtime peer skipped: {error}", flush=True)
        return {"skipped": str(error)}
    shapes_path = os.path.join(args.onnx_dir or "", "shapes.json")
    if not args.onnx_dir or not os.path.exists(shapes_path):
        print(f"ONNX Runtime peer skipped: no {shapes_path} (bench/peers/onnx_peer.py did not run)",
              flush=True)
        return {"skipped": f"no {shapes_path}"}
    with open(shapes_path) as f:
        shapes = json.load(f)
    print(f"# ONNX Runtime {ort.__version__}", flush=True)
    rows, errors = [], []
    for entry in shapes["workloads"]:
        name = entry["name"]
        if name not in args.workloads:
            continue
        feeds, reference = onnx_inputs(np, os.path.join(args.onnx_dir, name), entry, DENSITY[name])
        for count in threads:
            if not budget.allows(f"onnxruntime {name} {count} threads"):
                continue
            row = {"workload": name, "density": DENSITY[name], "threads": count}
            for graph in ("keras", "matmul"):
                session = onnx_session(ort, os.path.join(args.onnx_dir, entry["graphs"][graph]["file"]), count)
                output = session.run(None, feeds)[0]
                got = output[: reference.shape[0]].astype(np.float64)
                error = float(np.abs(got - reference).max() / np.abs(reference).max())
                if error > 1e-3:
                    errors.append(f"{name} {graph}: relative error {error:.2e}")
                row[f"forward_{graph}_ms"] = median_ms(lambda: session.run(None, feeds), args.repetitions)
                row[f"{graph}_relative_error"] = error
                del session
            row["forward_ms"] = min(row["forward_keras_ms"], row["forward_matmul_ms"])
            rows.append(row)
            print(f"onnxruntime {name:5s} {count:3d} threads: keras {row['forward_keras_ms']:.2f}, "
                  f"matmul {row['forward_matmul_ms']:.2f} ms", flush=True)
    return {"version": ort.__version__, "rows": rows, "errors": errors}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--workloads", default="seed,bow,long")
    parser.add_argument("--onnx-dir")
    parser.add_argument("--json")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--steps", default="forward,training")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    args.steps = args.steps.split(",")
    threads = sorted({int(t) for t in args.threads.split(",")})
    budget = Budget(args.budget)
    result = {"threads": threads, "repetitions": args.repetitions, "statistic": "median",
              "onnxruntime": run_onnx(args, threads, budget),
              "torch": run_torch(args, threads, budget)}
    result["skipped"] = budget.skipped
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
