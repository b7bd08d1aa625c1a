#!/usr/bin/env python3
"""ONNX Runtime peer for sdmha_bench, step 1 of 2: writes the graphs and inputs that onnx_peer.mjs times.

A user without sdmha densifies the sparse query and deploys the Keras MultiHeadAttention layer as an
ONNX graph. For each workload of WORKLOADS.md this script writes three float32 graphs of that layer,
with random Glorot-style weights and random (non-zero) biases baked in as initializers, inputs
query (B, T, Eq) dense, key (B, S, E), value (B, S, E), output (B, T, O):

  keras.onnx   the Keras math with plain ops: Q = query·Wq + bq (MatMul + Add), likewise K and V,
               Reshape to (B, ·, H, Dk), Q·(1/sqrt(Dk)) (Keras scales the query), Transpose to
               (B, H, ·, Dk), Kᵀ, scores = Q·Kᵀ, Softmax(axis=-1), P·V, Transpose and Reshape back,
               output projection (MatMul + Add). 21 nodes.
  matmul.onnx  the same with as few ops as MatMul allows: the scale folded into Wq and bq, K
               transposed straight to (B, H, Dk, S) by one Transpose. 19 nodes.
  mha.onnx     ONNX Runtime's contrib op com.microsoft.MultiHeadAttention (opset com.microsoft 1)
               fed with the projected Q (B, T, H·Dk), K (B, S, H·Dk), V (B, S, H·Dv) (MatMul + Add
               each), num_heads = H, scale = 1/sqrt(Dk); output projection after it. 9 nodes.

Besides the graphs it writes, per workload, key.bin, value.bin and the densified sparse query
query_<density>.bin (raw little-endian float32, C order) and ref_<density>.f64.bin: the output
of batch element 0 computed in float64 with numpy from the same (float32) weights and inputs, which
onnx_peer.mjs compares every timed graph against; and a small "check" case (B=2, T=5, Eq=24, S=7,
E=20, H=3, Dk=8, O=12) with the float64 reference of the whole batch (itself checked here against a
plain loop over batch elements and heads). All is described in shapes.json.

    apt-get install -y python3-onnx            # Debian 12: onnx 1.12, numpy 1.24
    /usr/bin/python3 bench/peers/onnx_peer.py [--out /tmp/sdmha_onnx] [--densities first|all]

The sparse query follows WORKLOADS.md: the same number of stored values in every row
(round(density·Eq), at least one) at distinct uniformly random columns, values ~ N(0, 1); the
random numbers are numpy's (seed 42), not sdmha_bench's, which does not change the work. A dense
peer does the same work at every density, so by default only the lowest density of each workload
is written (--densities all writes them all: bow's query is 134 MB a density).
"""
import argparse
import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WORKLOADS = [
    # name, B, T, Eq, S, E (key/value width), H, Dk, O, densities
    ("seed", 32, 128, 512, 128, 512, 8, 64, 512, [0.01, 0.05, 0.10]),
    ("bow", 8, 128, 32768, 256, 512, 8, 64, 512, [0.001, 0.01]),
    ("long", 2, 2048, 512, 2048, 512, 8, 64, 512, [0.05]),
]
CHECK = ("check", 2, 5, 24, 7, 20, 3, 8, 12, [0.25])
GRAPHS = ("keras", "matmul", "mha")
OPSET = 17        # ai.onnx; onnx 1.12 knows up to 17, ONNX Runtime 1.30 runs it
MS_OPSET = 1      # com.microsoft, for MultiHeadAttention


def sparse_query_dense(rng, rows, features, density):
    """The sparse query of WORKLOADS.md, densified: (rows, features) float32."""
    per_row = max(1, int(round(density * features)))
    dense = np.zeros((rows, features), np.float32)
    for r in range(rows):
        columns = rng.choice(features, per_row, replace=False)
        dense[r, columns] = rng.standard_normal(per_row).astype(np.float32)
    return dense


def glorot(rng, rows, cols, fan_in, fan_out):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, (rows, cols)).astype(np.float32)


def make_weights(rng, Eq, E, H, Dk, O):
    # Keras' EinsumDense kernels are (Eq, H, Dk) and (H, Dv, O); Glorot fans as Keras computes
    # them for those shapes (as torch_peer.py does), stored flattened to 2-D for MatMul.
    # Keras' biases start at zero; random ones here so that a wrongly wired bias shows.
    return {
        "Wq": glorot(rng, Eq, H * Dk, Eq * H, Eq * Dk),
        "Wk": glorot(rng, E, H * Dk, E * H, E * Dk),
        "Wv": glorot(rng, E, H * Dk, E * H, E * Dk),
        "Wo": glorot(rng, H * Dk, O, H * Dk, H * O),
        "bq": rng.uniform(-0.1, 0.1, H * Dk).astype(np.float32),
        "bk": rng.uniform(-0.1, 0.1, H * Dk).astype(np.float32),
        "bv": rng.uniform(-0.1, 0.1, H * Dk).astype(np.float32),
        "bo": rng.uniform(-0.1, 0.1, O).astype(np.float32),
    }


def reference(query, key, value, w, H, Dk):
    """The Keras layer in float64 numpy: query (B, T, Eq), key/value (B, S, E) -> (B, T, O)."""
    f = lambda a: np.asarray(a, np.float64)
    B, T, _ = query.shape
    S = key.shape[1]
    q = (f(query) @ f(w["Wq"]) + f(w["bq"])).reshape(B, T, H, Dk) * (1.0 / np.sqrt(Dk))
    k = (f(key) @ f(w["Wk"]) + f(w["bk"])).reshape(B, S, H, Dk)
    v = (f(value) @ f(w["Wv"]) + f(w["bv"])).reshape(B, S, H, Dk)
    scores = np.einsum("bthd,bshd->bhts", q, k)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    heads = np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, H * Dk)
    return heads @ f(w["Wo"]) + f(w["bo"])


def reference_loops(query, key, value, w, H, Dk):
    """The same layer written as loops over batch elements and heads, to check reference()."""
    f = lambda a: np.asarray(a, np.float64)
    out = []
    for b in range(query.shape[0]):
        q = f(query[b]) @ f(w["Wq"]) + f(w["bq"])
        k = f(key[b]) @ f(w["Wk"]) + f(w["bk"])
        v = f(value[b]) @ f(w["Wv"]) + f(w["bv"])
        heads = []
        for h in range(H):
            cols = slice(h * Dk, (h + 1) * Dk)
            s = (q[:, cols] / np.sqrt(Dk)) @ k[:, cols].T
            p = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((p / p.sum(axis=1, keepdims=True)) @ v[:, cols])
        out.append(np.concatenate(heads, axis=1) @ f(w["Wo"]) + f(w["bo"]))
    return np.stack(out)


def const_i64(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def build_graph(kind, B, T, Eq, S, E, H, Dk, O, w):
    scale = np.float32(1.0 / np.sqrt(Dk))
    inits = [numpy_helper.from_array(w[n], n) for n in ("Wk", "Wv", "Wo", "bk", "bv", "bo")]
    nodes = []
    node = lambda op, ins, outs, **kw: nodes.append(helper.make_node(op, ins, outs, **kw))
    if kind == "matmul":
        inits += [numpy_helper.from_array(w["Wq"] * scale, "Wq"), numpy_helper.from_array(w["bq"] * scale, "bq")]
    else:
        inits += [numpy_helper.from_array(w["Wq"], "Wq"), numpy_helper.from_array(w["bq"], "bq")]
    # Reshape targets: 0 copies the input's dimension, so one constant serves T and S.
    inits += [const_i64("split_heads", [0, 0, H, Dk]), const_i64("merge_heads", [0, 0, H * Dk])]

    for x, W, b in (("query", "Wq", "bq"), ("key", "Wk", "bk"), ("value", "Wv", "bv")):
        node("MatMul", [x, W], [x + "_mm"])
        node("Add", [x + "_mm", b], [x + "_proj"])          # (B, ·, H·Dk)

    if kind == "mha":
        node("MultiHeadAttention", ["query_proj", "key_proj", "value_proj"], ["heads"],
             domain="com.microsoft", num_heads=H, scale=float(scale))
    else:
        for x in ("query", "key", "value"):
            node("Reshape", [x + "_proj", "split_heads"], [x + "_4d"])   # (B, ·, H, Dk)
        if kind == "keras":
            inits.append(numpy_helper.from_array(np.array(scale, np.float32), "scale"))
            node("Mul", ["query_4d", "scale"], ["query_scaled"])
            node("Transpose", ["query_scaled"], ["q"], perm=[0, 2, 1, 3])   # (B, H, T, Dk)
            node("Transpose", ["key_4d"], ["k"], perm=[0, 2, 1, 3])         # (B, H, S, Dk)
            node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2])            # (B, H, Dk, S)
        else:
            node("Transpose", ["query_4d"], ["q"], perm=[0, 2, 1, 3])
            node("Transpose", ["key_4d"], ["k_t"], perm=[0, 2, 3, 1])
        node("Transpose", ["value_4d"], ["v"], perm=[0, 2, 1, 3])           # (B, H, S, Dv)
        node("MatMul", ["q", "k_t"], ["scores"])                             # (B, H, T, S)
        node("Softmax", ["scores"], ["probs"], axis=-1)
        node("MatMul", ["probs", "v"], ["context"])                          # (B, H, T, Dv)
        node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3])     # (B, T, H, Dv)
        node("Reshape", ["context_t", "merge_heads"], ["heads"])             # (B, T, H·Dv)
    node("MatMul", ["heads", "Wo"], ["out_mm"])
    node("Add", ["out_mm", "bo"], ["output"])                                # (B, T, O)

    used = {i for n in nodes for i in n.input}
    inits = [t for t in inits if t.name in used]
    graph = helper.make_graph(
        nodes, f"keras_mha_{kind}",
        [helper.make_tensor_value_info("query", TensorProto.FLOAT, [B, T, Eq]),
         helper.make_tensor_value_info("key", TensorProto.FLOAT, [B, S, E]),
         helper.make_tensor_value_info("value", TensorProto.FLOAT, [B, S, E])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [B, T, O])],
        initializer=inits)
    opsets = [helper.make_opsetid("", OPSET)]
    if kind == "mha":
        opsets.append(helper.make_opsetid("com.microsoft", MS_OPSET))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="sdmha onnx_peer.py")
    if kind != "mha":   # the checker does not know com.microsoft ops
        onnx.checker.check_model(model)
    return model


def write_workload(out, spec, rng, all_densities, reference_batches):
    name, B, T, Eq, S, E, H, Dk, O, densities = spec
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    w = make_weights(rng, Eq, E, H, Dk, O)
    key = rng.uniform(-1, 1, (B, S, E)).astype(np.float32)
    value = rng.uniform(-1, 1, (B, S, E)).astype(np.float32)
    key.tofile(os.path.join(folder, "key.bin"))
    value.tofile(os.path.join(folder, "value.bin"))
    entry = {"name": name, "B": B, "T": T, "Eq": Eq, "S": S, "E": E, "H": H, "Dk": Dk, "O": O,
             "densities": [], "graphs": {}, "key": f"{name}/key.bin", "value": f"{name}/value.bin",
             "reference_batches": reference_batches}
    for kind in GRAPHS:
        path = os.path.join(folder, f"{kind}.onnx")
        onnx.save(build_graph(kind, B, T, Eq, S, E, H, Dk, O, w), path)
        entry["graphs"][kind] = {"file": f"{name}/{kind}.onnx", "bytes": os.path.getsize(path)}
    for density in (densities if all_densities else densities[:1]):
        query = sparse_query_dense(rng, B * T, Eq, density).reshape(B, T, Eq)
        query.tofile(os.path.join(folder, f"query_{density:g}.bin"))
        ref = reference(query[:reference_batches], key[:reference_batches], value[:reference_batches], w, H, Dk)
        if name == "check":
            loops = reference_loops(query, key, value, w, H, Dk)
            error = np.abs(ref - loops).max() / np.abs(loops).max()
            assert error < 1e-12, f"reference() and reference_loops() differ by {error:g}"
        ref.tofile(os.path.join(folder, f"ref_{density:g}.f64.bin"))
        entry["densities"].append({"density": density, "query": f"{name}/query_{density:g}.bin",
                                   "reference": f"{name}/ref_{density:g}.f64.bin"})
        print(f"{name:5s} density {density:<6g}: wrote query {query.nbytes / 1e6:.0f} MB, "
              f"reference of {reference_batches} batch element(s)", flush=True)
    print(f"{name:5s} graphs: " + ", ".join(f"{k} {v['bytes'] / 1e6:.1f} MB" for k, v in entry["graphs"].items()),
          flush=True)
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/sdmha_onnx")
    parser.add_argument("--densities", choices=["first", "all"], default="first")
    parser.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS),
                        help="comma-separated subset of " + ",".join(w[0] for w in WORKLOADS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(42)
    wanted = args.workloads.split(",")
    print(f"# onnx {onnx.__version__}, numpy {np.__version__}, opset {OPSET} + com.microsoft {MS_OPSET}, "
          f"writing to {args.out}", flush=True)
    shapes = {"onnx": onnx.__version__, "opset": OPSET, "seed": 42, "graphs": list(GRAPHS),
              "check": write_workload(args.out, CHECK, rng, True, CHECK[1]),
              "workloads": [write_workload(args.out, spec, rng, args.densities == "all", 1)
                            for spec in WORKLOADS if spec[0] in wanted]}
    with open(os.path.join(args.out, "shapes.json"), "w") as f:
        json.dump(shapes, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'shapes.json')}")


if __name__ == "__main__":
    main()
