#!/usr/bin/python3
"""Writes tests/data/semantics/: golden cases of the attention's semantics options.

Every case is one safetensors file in the format of tests/data/goldens/README.md (a layer's
weights, its inputs, expected/output and expected/attention_scores), covering what those goldens
do not: attention_mask of every broadcast shape, attention_bias of every broadcast shape (with
-inf entries), a scale override, causal masks aligned top_left and bottom_right with T != S,
both fully_masked_rows policies on fully blocked rows, float64 and float32, Keras and PyTorch
layouts.

The expected tensors come from the float64 reference below, written from the math alone with
numpy (it imports nothing of sdmha): from exactly the numbers stored in the file (float32 cases:
from the float32 values, computed in float64, stored as float32). Only the safetensors writer of
tools/cli/sdmha_export.py is used.

    /usr/bin/python3 tools/testdata/make_semantics_goldens.py [OUTPUT_DIR]

The output is a function of the seeds below: rerunning it rewrites identical files.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cli"))
from sdmha_export import write_safetensors  # noqa: E402  (numpy-only safetensors writer)

# (B', H') of every broadcast shape a mask or a bias may have, with its stored rank.
SHAPES = {
    "ts": (None, None, 2),  # (T, S)
    "bts": ("B", None, 3),  # (B, T, S)
    "1ts": (1, None, 3),  # (1, T, S)
    "b1ts": ("B", 1, 4),  # (B, 1, T, S)
    "bhts": ("B", "H", 4),  # (B, H, T, S)
    "1hts": (1, "H", 4),  # (1, H, T, S)
    "11ts": (1, 1, 4),  # (1, 1, T, S)
}


def stored_shape(kind, B, H, T, S):
    b, h, rank = SHAPES[kind]
    b = B if b == "B" else 1
    h = H if h == "H" else 1
    if rank == 2:
        return (T, S)
    if rank == 3:
        return (b, T, S)
    return (b, h, T, S)


def as_bhts(array, B, H, T, S):
    """The stored mask or bias broadcast to (B, H, T, S)."""
    if array.ndim == 2:
        array = array[None, None]
    elif array.ndim == 3:
        array = array[:, None]
    return np.broadcast_to(array, (B, H, T, S))


def sparse_query(rng, B, T, E, density, empty_row=True):
    dense = rng.standard_normal((B, T, E)) * (rng.random((B, T, E)) < density)
    if empty_row:
        dense[0, T - 1, :] = 0.0  # a row with no stored values still attends (its query is bq)
    indices = np.argwhere(dense != 0).astype(np.int64)  # row-major order, no duplicates
    values = dense[dense != 0]
    return dense, indices, values


def reference(x, key, value, w, H, Dk, Dv, scale, mask, bias, causal, alignment, policy):
    """Keras 3 MultiHeadAttention in float64; returns (output, probabilities)."""
    B, T, _ = x.shape
    S = value.shape[1]
    q = (x @ w["Wq"] + w["bq"]).reshape(B, T, H, Dk)
    k = (key @ w["Wk"] + w["bk"]).reshape(B, S, H, Dk)
    v = (value @ w["Wv"] + w["bv"]).reshape(B, S, H, Dv)
    scores = scale * np.einsum("bthd,bshd->bhts", q, k)
    if bias is not None:
        scores = scores + as_bhts(bias.astype(np.float64), B, H, T, S)
    allowed = np.ones((B, H, T, S), dtype=bool)
    if mask is not None:
        allowed &= as_bhts(mask, B, H, T, S)
    if causal:
        t = np.arange(T)[:, None]
        s = np.arange(S)[None, :]
        allowed &= (s <= t) if alignment == "top_left" else (s <= t + S - T)
    scores = np.where(allowed, scores, -np.inf)
    maximum = scores.max(axis=-1, keepdims=True)
    blocked_row = maximum == -np.inf  # every key blocked (by the masks or a -inf bias)
    exps = np.exp(scores - np.where(blocked_row, 0.0, maximum))
    sums = exps.sum(axis=-1, keepdims=True)
    probs = np.where(blocked_row, 0.0, exps / np.where(blocked_row, 1.0, sums))
    if policy == "uniform":
        probs = np.where(blocked_row, 1.0 / S, probs)
    heads = np.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * Dv)
    return heads @ w["Wo"] + w["bo"], probs


def make_case(name, seed, layout="keras", dtype=np.float64, B=2, T=4, S=5, H=2, Dk=3, Dv=3,
              Eq=6, Ek=5, Ev=4, O=4, mask=None, bias=None, bias_dtype=None, has_key=True,
              causal=False, alignment="top_left", policy="zeros", scale=None, block_rows=()):
    """One case. mask / bias: a SHAPES key or None; block_rows: (b, h, t) rows to block fully,
    in the mask when there is one (True) and else with a -inf bias row."""
    rng = np.random.default_rng(seed)
    if layout == "torch":
        Eq = Ek = Ev = O = H * Dk
        Dv = Dk
    if not has_key:
        Ek = Ev
    x, indices, values = sparse_query(rng, B, T, Eq, 0.4)
    value = rng.standard_normal((B, S, Ev))
    key = rng.standard_normal((B, S, Ek)) if has_key else value

    def r(*shape):
        return rng.standard_normal(shape) * 0.5

    if layout == "keras":
        kq, kk, kv, ko = r(Eq, H, Dk), r(Ek, H, Dk), r(Ev, H, Dv), r(H, Dv, O)
        bq, bk, bv, bo = r(H, Dk), r(H, Dk), r(H, Dv), r(O)
        weights = {"query/kernel": kq, "query/bias": bq, "key/kernel": kk, "key/bias": bk,
                   "value/kernel": kv, "value/bias": bv, "attention_output/kernel": ko,
                   "attention_output/bias": bo}
    else:
        E = H * Dk
        in_w, in_b, out_w, out_b = r(3 * E, E), r(3 * E), r(E, E), r(E)
        weights = {"in_proj_weight": in_w, "in_proj_bias": in_b, "out_proj.weight": out_w,
                   "out_proj.bias": out_b}

    mask_array = None
    if mask is not None:
        mask_array = rng.random(stored_shape(mask, B, H, T, S)) < 0.75
    bias_array = None
    if bias is not None:
        bias_array = rng.standard_normal(stored_shape(bias, B, H, T, S))
        bias_array[rng.random(bias_array.shape) < 0.1] = -np.inf  # a -inf bias blocks
    for b, h, t in block_rows:
        if mask_array is not None:
            index = {2: (t,), 3: (b, t), 4: (b, h, t)}[mask_array.ndim]
            mask_array[index] = False
        else:
            index = {2: (t,), 3: (b, t), 4: (b, h, t)}[bias_array.ndim]
            bias_array[index] = -np.inf

    # Round every floating number to the case's dtype first: the reference sees what is stored.
    def stored(a, as_dtype=dtype):
        return np.asarray(a, dtype=as_dtype)

    weights = {n: stored(a) for n, a in weights.items()}
    values = stored(values)
    key, value = stored(key), stored(value)
    if bias_array is not None:
        bias_array = stored(bias_array, bias_dtype or dtype)
    x = np.zeros((B, T, Eq))
    x[tuple(indices.T)] = values.astype(np.float64)

    f = {n: a.astype(np.float64) for n, a in weights.items()}
    if layout == "keras":
        w = {"Wq": f["query/kernel"].reshape(Eq, H * Dk), "bq": f["query/bias"].reshape(-1),
             "Wk": f["key/kernel"].reshape(Ek, H * Dk), "bk": f["key/bias"].reshape(-1),
             "Wv": f["value/kernel"].reshape(Ev, H * Dv), "bv": f["value/bias"].reshape(-1),
             "Wo": f["attention_output/kernel"].reshape(H * Dv, O),
             "bo": f["attention_output/bias"]}
    else:
        E = H * Dk
        W, bias_in = f["in_proj_weight"], f["in_proj_bias"]
        w = {"Wq": W[:E].T, "Wk": W[E:2 * E].T, "Wv": W[2 * E:].T, "bq": bias_in[:E],
             "bk": bias_in[E:2 * E], "bv": bias_in[2 * E:], "Wo": f["out_proj.weight"].T,
             "bo": f["out_proj.bias"]}
    factor = scale if scale is not None else 1.0 / np.sqrt(Dk)
    output, probs = reference(x, key.astype(np.float64), value.astype(np.float64), w, H, Dk, Dv,
                              factor, mask_array, bias_array, causal, alignment, policy)

    tensors = dict(weights)
    tensors["query/indices"] = indices
    tensors["query/values"] = values
    tensors["query/dense_shape"] = np.array([B, T, Eq], dtype=np.int64)
    if has_key:
        tensors["key"] = key
    tensors["value"] = value
    if mask_array is not None:
        tensors["attention_mask"] = mask_array
    if bias_array is not None:
        tensors["attention_bias"] = bias_array
    tensors["expected/output"] = stored(output)
    tensors["expected/attention_scores"] = stored(probs)
    metadata = {"num_heads": str(H), "key_dim": str(Dk), "value_dim": str(Dv), "layout": layout,
                "use_causal_mask": "true" if causal else "false", "causal_alignment": alignment,
                "fully_masked_rows": policy}
    if scale is not None:
        metadata["scale"] = repr(float(scale))
    return name, tensors, metadata


def cases():
    kinds = list(SHAPES)
    # Every mask shape with a bias of another shape, so that both run through every shape.
    for i, kind in enumerate(kinds):
        bias_kind = kinds[(i + 3) % len(kinds)]
        layout = "torch" if kind in ("bhts", "11ts") else "keras"
        yield make_case(f"mask_{kind}_bias_{bias_kind}_{layout}_f64", 100 + i, layout=layout,
                        mask=kind, bias=bias_kind)
    yield make_case("bias_only_bhts_keras_f64", 200, bias="bhts", has_key=False)
    yield make_case("bias_f32_in_f64_keras", 201, mask="bts", bias="ts", bias_dtype=np.float32)
    yield make_case("scale_keras_f64", 202, mask="bts", bias="1hts", scale=0.7)
    yield make_case("scale_torch_f64", 203, layout="torch", bias="ts", scale=0.25)
    yield make_case("causal_top_left_t3_s5_keras_f64", 204, T=3, S=5, causal=True, bias="b1ts")
    yield make_case("causal_bottom_right_t3_s5_keras_f64", 205, T=3, S=5, causal=True,
                    alignment="bottom_right", mask="ts")
    # T > S bottom-right: rows t < T − S see no key at all (fully blocked).
    for policy in ("zeros", "uniform"):
        yield make_case(f"causal_bottom_right_t6_s4_{policy}_torch_f64", 206, layout="torch",
                        T=6, S=4, causal=True, alignment="bottom_right", bias="bts",
                        policy=policy)
        # Rows blocked by the mask in some (b, h) only, and by a -inf bias row.
        yield make_case(f"fully_masked_mask_{policy}_keras_f64", 207, mask="bhts", bias="ts",
                        policy=policy, block_rows=[(0, 1, 2), (1, 0, 0)])
        yield make_case(f"fully_masked_bias_{policy}_keras_f64", 208, bias="1hts", policy=policy,
                        block_rows=[(0, 1, 1)])
    yield make_case("mask_b1ts_bias_bhts_keras_f32", 209, dtype=np.float32, B=3, T=5, S=7, H=3,
                    Dk=4, Dv=5, Eq=9, Ek=6, Ev=8, O=7, mask="b1ts", bias="bhts", scale=0.4)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "..", "tests", "data",
                                                             "semantics")
    os.makedirs(out, exist_ok=True)
    for name, tensors, metadata in cases():
        path = os.path.join(out, name + ".safetensors")
        write_safetensors(path, tensors, metadata)
        print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
