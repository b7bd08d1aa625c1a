#!/usr/bin/env python3
"""Regenerates tests/data/gradient_goldens/: every gradient of the Keras-layout golden cases of
tests/data/goldens/, computed by PyTorch's autograd in float64, for a fixed d_output.

    /usr/bin/python3 tools/testdata/make_gradient_goldens.py     # Debian's python3-torch and python3-numpy

For each case the layer is written again in PyTorch with Keras 3's math (the golden README's
formulas; a fully blocked query row gets zero probabilities), its output is checked against the
case's own `expected/output` (within 1e-12·(1 + |expected|), 1e-6 for float32 cases, whose output
is stored rounded to float32: this forward is the one the goldens were made with), then loss = Σ d_output ⊙ output is differentiated. The file
`<case>.safetensors` holds `d_output` and `expected/grad/<name>` for `query/values` (in the
case's COO order), every kernel and bias in the Keras layout, `key` (absent when the case has no
key: its key is its value) and `value` (then the sum of both paths). float32 cases are
differentiated from their float32 numbers in float64 and stored in float32, like their outputs.
The C++ test is tests/semantics/test_goldens.cpp (GradientGoldens). The torch-layout case is left out: its
gradients would only repeat a Keras case's through the weight mapping, which the forward goldens
already cover.
"""
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cli"))
from sdmha_export import read_safetensors, write_safetensors  # noqa: E402

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
SOURCE = REPOSITORY / "tests" / "data" / "goldens"
TARGET = REPOSITORY / "tests" / "data" / "gradient_goldens"
D_OUTPUT_SEED = 20261201

WEIGHTS = ["query/kernel", "query/bias", "key/kernel", "key/bias", "value/kernel", "value/bias",
           "attention_output/kernel", "attention_output/bias"]


def forward(t, metadata, causal):
    """Keras 3's MultiHeadAttention on the densified sparse query, from the tensors `t`."""
    batch, steps, features = (int(n) for n in t["query/dense_shape"])
    indices = t["query/indices"]
    # accumulate: duplicate coordinates sum, as in SparseQuery::from_coo (the goldens have none).
    query = torch.zeros(batch, steps, features, dtype=torch.float64).index_put(
        (indices[:, 0], indices[:, 1], indices[:, 2]), t["query/values"], accumulate=True)
    key = t["key"] if "key" in t else t["value"]
    value = t["value"]
    q = torch.einsum("bte,ehd->bthd", query, t["query/kernel"]) + t["query/bias"]
    k = torch.einsum("bse,ehd->bshd", key, t["key/kernel"]) + t["key/bias"]
    v = torch.einsum("bse,ehd->bshd", value, t["value/kernel"]) + t["value/bias"]
    key_dim = int(metadata["key_dim"])
    scores = torch.einsum("bthd,bshd->bhts", q / np.sqrt(key_dim), k)
    key_steps = scores.shape[-1]
    allowed = torch.ones(batch, steps, key_steps, dtype=torch.bool)
    if "attention_mask" in t:
        allowed = allowed & t["attention_mask"]
    if causal:
        allowed = allowed & torch.ones(steps, key_steps, dtype=torch.bool).tril()
    allowed = allowed[:, None, :, :]
    any_allowed = allowed.any(dim=-1, keepdim=True)
    # Blocked pairs −∞; a row with nothing allowed is filled with 0 instead (finite, so that no NaN
    # enters the graph) and its probabilities are multiplied by 0.
    filled = torch.where(allowed, scores, torch.where(any_allowed, -torch.inf, 0.0))
    probabilities = torch.softmax(filled, dim=-1) * any_allowed
    heads = torch.einsum("bhts,bshd->bthd", probabilities, v)
    return torch.einsum("bthd,hdo->bto", heads, t["attention_output/kernel"]) + t[
        "attention_output/bias"]


def make(path):
    arrays, metadata = read_safetensors(path)
    if metadata.get("layout") != "keras":
        return None
    causal = metadata.get("use_causal_mask") == "true"
    stored_dtype = arrays["value"].dtype
    t = {}
    for name, array in arrays.items():
        if array.dtype.kind == "f":
            t[name] = torch.tensor(array.astype(np.float64), requires_grad=not name.startswith("expected/"))
        else:
            t[name] = torch.tensor(array)
    output = forward(t, metadata, causal)
    expected = torch.tensor(arrays["expected/output"].astype(np.float64))
    error = ((output - expected).abs() / (1 + expected.abs())).max().item()
    # float32 cases store their output rounded to float32: 2^-24 ≈ 6e-8 relative.
    if not error <= (1e-12 if stored_dtype == np.float64 else 1e-6):
        raise SystemExit(f"{path.name}: the PyTorch forward is off the golden output by {error:.3g}")
    generator = np.random.default_rng(D_OUTPUT_SEED)
    d_output = generator.uniform(-1.0, 1.0, size=tuple(output.shape)).astype(stored_dtype)
    (output * torch.tensor(d_output.astype(np.float64))).sum().backward()
    names = ["query/values"] + WEIGHTS + (["key"] if "key" in t else []) + ["value"]
    result = {"d_output": d_output}
    for name in names:
        result["expected/grad/" + name] = t[name].grad.numpy().astype(stored_dtype)
    write_safetensors(TARGET / path.name, result,
                      {"source": f"tests/data/goldens/{path.name}", "d_output_seed": str(D_OUTPUT_SEED),
                       "torch": torch.__version__, "forward_error": f"{error:.3g}"})
    (TARGET / path.name).chmod(0o644)
    return error


def main():
    TARGET.mkdir(parents=True, exist_ok=True)
    for path in sorted(SOURCE.glob("*.safetensors")):
        error = make(path)
        print(f"{path.name}: " + ("skipped (not the Keras layout)" if error is None
                                  else f"written; forward within {error:.3g} of the golden output"))


if __name__ == "__main__":
    main()
