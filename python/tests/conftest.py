"""Shared helpers of the sdmha Python tests: random cases and a float64 torch reference of
Keras 3's MultiHeadAttention on the densified query (tests/data/goldens/README.md has the math).

Run from a build tree: PYTHONPATH=<build>/python python3 -m pytest -q python/tests
"""

import importlib.util
import math
import os
import pathlib

import numpy as np
import pytest
import torch

# Fails early, with the package's own import error, when PYTHONPATH lacks the build.
importlib.import_module("sdmha")

SOURCE_DIR = pathlib.Path(os.environ.get("SDMHA_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
GOLDENS = SOURCE_DIR / "tests" / "data" / "goldens"

# Two cores shared with other work: sdmha's workers and torch's intra-op threads stay at one
# each in the tests (the distributed test starts two processes).
torch.set_num_threads(1)


def load_export_tools():
    """tools/cli/sdmha_export.py (numpy only): safetensors/npz writers and the Keras/torch exporters."""
    spec = importlib.util.spec_from_file_location("sdmha_export",
                                                  SOURCE_DIR / "tools" / "cli" / "sdmha_export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def export_tools():
    return load_export_tools()


class Case:
    """A random problem: COO query (with duplicates and empty rows), key, value, weights."""

    def __init__(self, batch=2, steps=5, features=7, key_steps=4, key_width=6, value_width=5, heads=2,
                 key_dim=3, value_dim=None, output_dim=None, use_bias=True, nonzeros=None, duplicates=2,
                 dtype=torch.float64, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.batch, self.steps, self.features, self.key_steps = batch, steps, features, key_steps
        self.heads, self.key_dim = heads, key_dim
        self.value_dim = value_dim or key_dim
        self.output_dim = output_dim or features
        self.use_bias = use_bias
        nnz = nonzeros if nonzeros is not None else max(1, batch * steps * features // 4)
        flat = torch.randperm(batch * steps * features, generator=generator)[:nnz]
        if duplicates:
            flat = torch.cat([flat, flat[:duplicates]])  # repeated coordinates, summed by the layer
        self.indices = torch.stack([flat // (steps * features), (flat // features) % steps, flat % features])
        self.values = torch.randn(flat.numel(), generator=generator, dtype=torch.float64).to(dtype)
        self.key = torch.randn(batch, key_steps, key_width, generator=generator, dtype=torch.float64).to(dtype)
        self.value = torch.randn(batch, key_steps, value_width, generator=generator, dtype=torch.float64).to(dtype)
        hk, hv = heads * key_dim, heads * self.value_dim

        def rand(*shape):
            return (0.5 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)

        self.weights = {
            "query_kernel": rand(features, hk), "query_bias": rand(hk) if use_bias else None,
            "key_kernel": rand(key_width, hk), "key_bias": rand(hk) if use_bias else None,
            "value_kernel": rand(value_width, hv), "value_bias": rand(hv) if use_bias else None,
            "output_kernel": rand(hv, self.output_dim), "output_bias": rand(self.output_dim) if use_bias else None,
        }
        self.d_output = torch.randn(batch, steps, self.output_dim, generator=generator, dtype=torch.float64).to(dtype)

    def query(self, values=None):
        values = self.values if values is None else values
        return torch.sparse_coo_tensor(self.indices, values, (self.batch, self.steps, self.features))

    def dense_query(self, values=None):
        return self.query(values).to_dense()

    def module(self, **kwargs):
        from sdmha.torch import SparseQueryMultiheadAttention

        module = SparseQueryMultiheadAttention(
            self.heads, self.key_dim, self.features, self.key.shape[2], self.value.shape[2],
            value_dim=self.value_dim, output_dim=self.output_dim, use_bias=self.use_bias, dtype=self.dtype,
            num_threads=1, **kwargs)
        with torch.no_grad():
            for name, weight in self.weights.items():
                if weight is not None:
                    getattr(module, name).copy_(weight)
        return module

    def random_mask(self, seed=1, fully_blocked_row=True):
        generator = torch.Generator().manual_seed(seed)
        mask = torch.rand(self.batch, self.steps, self.key_steps, generator=generator) < 0.6
        if fully_blocked_row and self.steps > 1:
            mask[0, 1, :] = False
        return mask


def as_four(tensor):
    """(T, S) -> (1, 1, T, S), (B, T, S) -> (B, 1, T, S), (B, H, T, S) as it is (sdmha's reading)."""
    if tensor.dim() == 2:
        return tensor[None, None]
    if tensor.dim() == 3:
        return tensor[:, None]
    return tensor


def reference(query, key, value, weights, heads, attention_mask=None, use_causal_mask=False, key_padding_mask=None,
              dropout_multiplier=None, attention_bias=None, scale=None):
    """Keras' MultiHeadAttention on a dense query (B, T, Eq), in the dtype of its inputs.

    Returns (output (B, T, O), probabilities (B, H, T, S)). A row whose every key is blocked gets
    zero probabilities (Keras 3 / sdmha). dropout_multiplier (B, H, T, S) multiplies the
    probabilities after the softmax, as Keras' dropout does (keep / (1 - rate)). attention_mask
    (True = may attend) and attention_bias (added to the scaled scores; −inf blocks) are (T, S),
    (B, T, S) or (B, H, T, S) with B or H possibly 1."""
    batch, steps, _ = query.shape
    key_steps = key.shape[1]
    w = weights

    def project(x, kernel, bias):
        y = x @ kernel
        return y if bias is None else y + bias

    q = project(query, w["query_kernel"], w["query_bias"])
    k = project(key, w["key_kernel"], w["key_bias"])
    v = project(value, w["value_kernel"], w["value_bias"])
    key_dim = q.shape[-1] // heads
    value_dim = v.shape[-1] // heads
    q = q.view(batch, steps, heads, key_dim).transpose(1, 2)
    k = k.view(batch, key_steps, heads, key_dim).transpose(1, 2)
    v = v.view(batch, key_steps, heads, value_dim).transpose(1, 2)
    scores = (q / math.sqrt(key_dim) if scale is None else q * scale) @ k.transpose(-1, -2)
    allowed = torch.ones(batch, 1, steps, key_steps, dtype=torch.bool)
    if attention_mask is not None:
        allowed = allowed & as_four(attention_mask)
    if use_causal_mask:
        allowed = allowed & torch.ones(steps, key_steps, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if attention_bias is not None:
        bias = as_four(attention_bias)
        allowed = allowed & (bias != float("-inf"))
        scores = scores + torch.where(allowed, bias, torch.zeros((), dtype=bias.dtype))
    any_allowed = allowed.any(-1, keepdim=True)
    # Fully blocked rows: softmax of zeros, then multiplied by 0 (no NaN in values or gradients).
    fill = torch.where(any_allowed, torch.tensor(float("-inf"), dtype=scores.dtype),
                       torch.tensor(0.0, dtype=scores.dtype))
    probabilities = torch.softmax(torch.where(allowed, scores, fill), dim=-1) * any_allowed
    dropped = probabilities if dropout_multiplier is None else probabilities * dropout_multiplier
    heads_out = (dropped @ v).transpose(1, 2).reshape(batch, steps, heads * value_dim)
    return project(heads_out, w["output_kernel"], w["output_bias"]), probabilities


def assert_close(actual, expected, dtype, what=""):
    actual = torch.as_tensor(actual).to(torch.float64)
    expected = torch.as_tensor(expected).to(torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if dtype == torch.float64:
        tolerance = 1e-10 * (1 + expected.abs())
    else:
        tolerance = 5e-5 * (1 + expected.abs())
    error = (actual - expected).abs()
    worst = float((error / tolerance).max()) if error.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {float(error.max()):.3g} exceeds the tolerance ({worst:.2f}x)"


def free_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def numpy_of(tensor):
    return np.ascontiguousarray(tensor.detach().numpy())
