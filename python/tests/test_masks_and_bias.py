"""Masks and biases of every broadcast shape: the binding's views and bias gradient, the torch
module's three conventions (attention_mask, attention_bias, PyTorch's attn_mask) against the
float64 reference and torch.nn.MultiheadAttention, gradcheck of the bias, fresh dropout seeds."""

import numpy as np
import pytest
import torch

import sdmha
from conftest import Case, assert_close, numpy_of, reference
from sdmha.torch import SparseQueryMultiheadAttention, sparse_query_attention

B, T, S, H = 2, 5, 4, 2
SHAPES = {"TS": (T, S), "BTS": (B, T, S), "B1TS": (B, 1, T, S), "BHTS": (B, H, T, S), "1HTS": (1, H, T, S)}


def small_case(dtype=torch.float64, seed=0):
    return Case(batch=B, steps=T, key_steps=S, heads=H, dtype=dtype, seed=seed)


def random_mask(shape, seed=3):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=generator) < 0.6
    mask[..., 0] = True  # no fully blocked row, so that nn.MultiheadAttention gives no NaN
    return mask


def random_bias(shape, dtype, seed=4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


# ---- the binding ----------------------------------------------------------------------------------


def layer_and_query(case):
    name = sdmha.dtype_name(case.dtype)
    layer = sdmha.Layer(case.heads, case.key_dim, case.features, case.key.shape[2], case.value.shape[2],
                        output_dim=case.output_dim, dtype=name)
    for weight_name, weight in case.weights.items():
        layer.set_weight(weight_name, numpy_of(weight))
    query = sdmha.coo_query(case.batch, case.steps, case.features, numpy_of(case.indices.T.contiguous()),
                            numpy_of(case.values))
    return layer, query


@pytest.mark.parametrize("shape", SHAPES)
def test_binding_bias_gradient_comes_back_in_the_bias_shape(shape):
    case = small_case()
    layer, query = layer_and_query(case)
    key, value, d_output = numpy_of(case.key), numpy_of(case.value), numpy_of(case.d_output)
    bias = random_bias(SHAPES[shape], torch.float64)
    mask = random_mask(SHAPES[shape])
    output, _ = layer.forward(query, key, value, attention_bias=numpy_of(bias), attention_mask=numpy_of(mask),
                              num_threads=1)
    grads = layer.backward(query, key, value, d_output, attention_bias=numpy_of(bias),
                           attention_mask=numpy_of(mask), compute_bias_gradient=True, num_threads=1)
    assert grads["attention_bias"].shape == SHAPES[shape]

    ref_bias = bias.clone().requires_grad_()
    expected, _ = reference(case.dense_query(), case.key, case.value, case.weights, H, attention_mask=mask,
                            attention_bias=ref_bias)
    (expected * case.d_output).sum().backward()
    assert_close(output, expected, torch.float64, "output")
    assert_close(grads["attention_bias"], ref_bias.grad, torch.float64, "bias gradient")
    assert not grads["attention_bias"][~np.broadcast_to(numpy_of(mask), SHAPES[shape])].any(), \
        "0 at blocked positions"
    # Not asked for: not returned.
    assert "attention_bias" not in layer.backward(query, key, value, d_output, attention_bias=numpy_of(bias))


def test_binding_reads_strided_arrays_and_other_dtypes_converted():
    case = small_case(torch.float32)
    layer, query = layer_and_query(case)
    key, value = numpy_of(case.key), numpy_of(case.value)
    bias = np.random.default_rng(0).standard_normal((S, T)).T  # (T, S), not C-contiguous, float64
    mask = np.ones((T, 2 * S), bool)[:, ::2]
    output, _ = layer.forward(query, key, value, attention_bias=bias, attention_mask=mask, num_threads=1)
    expected, _ = layer.forward(query, key, value, attention_bias=np.ascontiguousarray(bias, np.float32),
                                num_threads=1)
    np.testing.assert_array_equal(output, expected)


def test_binding_semantics_options():
    case = small_case()
    layer, query = layer_and_query(case)
    key, value = numpy_of(case.key), numpy_of(case.value)
    output, _ = layer.forward(query, key, value, scale=0.25, num_threads=1)
    expected, _ = reference(case.dense_query(), case.key, case.value, case.weights, H, scale=0.25)
    assert_close(output, expected, torch.float64, "scale")
    blocked = np.zeros((T, S), bool)
    uniform, scores = layer.forward(query, key, value, attention_mask=blocked, fully_masked_rows="uniform",
                                    return_attention_scores=True, num_threads=1)
    np.testing.assert_allclose(scores, 1.0 / S)
    wide_key, wide_value = np.concatenate([key, key], axis=1), np.concatenate([value, value], axis=1)
    _, scores = layer.forward(query, wide_key, wide_value, use_causal_mask=True, causal_alignment="bottom_right",
                              return_attention_scores=True, num_threads=1)
    allowed = np.arange(2 * S)[None, :] <= np.arange(T)[:, None] + 2 * S - T
    assert (scores[..., ~allowed] == 0).all() and (scores[..., allowed] > 0).all()
    with pytest.raises(sdmha.ConfigError, match="causal_alignment"):
        layer.forward(query, key, value, causal_alignment="middle")
    with pytest.raises(sdmha.ConfigError, match="fully_masked_rows"):
        layer.forward(query, key, value, fully_masked_rows="nan")


def test_binding_mask_and_bias_errors():
    case = small_case()
    layer, query = layer_and_query(case)
    key, value = numpy_of(case.key), numpy_of(case.value)
    with pytest.raises(sdmha.ShapeError, match=r"attention_mask is \(2, 5, 6\)"):
        layer.forward(query, key, value, attention_mask=np.ones((2, 5, 6), bool))
    with pytest.raises(sdmha.ShapeError, match=r"attention_bias is \(3, 2, 5, 4\)"):
        layer.forward(query, key, value, attention_bias=np.zeros((3, 2, 5, 4)))
    with pytest.raises(sdmha.ShapeError, match="attention_bias has shape"):
        layer.forward(query, key, value, attention_bias=np.zeros((1, 1, 2, 5, 4)))
    with pytest.raises(TypeError, match="attention_mask has dtype float64; expected bool"):
        layer.forward(query, key, value, attention_mask=np.ones((T, S)))


# ---- the torch module -----------------------------------------------------------------------------


def module_and_inputs(case):
    values = case.values.clone().requires_grad_()
    key = case.key.clone().requires_grad_()
    value = case.value.clone().requires_grad_()
    return case.module(), case.query(values), values, key, value


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_module_mask_and_bias_of_every_shape_match_the_reference(shape, dtype):
    case = small_case(dtype)
    module, query, values, key, value = module_and_inputs(case)
    mask = random_mask(SHAPES[shape])
    bias = random_bias(SHAPES[shape], dtype).requires_grad_()
    output = module(query, key, value, attention_mask=mask, attention_bias=bias)
    (output * case.d_output).sum().backward()

    ref_values, ref_key = case.values.clone().requires_grad_(), case.key.clone().requires_grad_()
    ref_bias = bias.detach().clone().requires_grad_()
    expected, _ = reference(case.dense_query(ref_values), ref_key, case.value, case.weights, H,
                            attention_mask=mask, attention_bias=ref_bias)
    (expected * case.d_output).sum().backward()
    assert_close(output, expected, dtype, "output")
    assert_close(bias.grad, ref_bias.grad, dtype, "bias gradient")
    assert_close(values.grad, ref_values.grad, dtype, "query values gradient")
    assert_close(key.grad, ref_key.grad, dtype, "key gradient")


def test_module_minus_inf_bias_blocks_and_float_masks_of_other_dtypes_are_converted():
    case = small_case()
    module, query, _, key, value = module_and_inputs(case)
    mask = random_mask((B, T, S))
    bias = torch.where(mask, torch.zeros(()), torch.tensor(float("-inf")))
    by_bias = module(query, key, value, attention_bias=bias.float())  # float32 bias, float64 module
    by_mask = module(query, key, value, attention_mask=mask)
    assert_close(by_bias, by_mask, torch.float64, "-inf bias = blocked")
    with pytest.raises(TypeError, match="same argument"):
        module(query, key, value, attention_bias=bias, attn_bias=bias)
    with pytest.raises(TypeError, match="attention_bias has dtype torch.bool"):
        module(query, key, value, attention_bias=mask)


@pytest.mark.parametrize("shape", ["TS", "BHTS"])
def test_gradcheck_bias_float64(shape):
    case = Case(batch=2, steps=3, features=5, key_steps=3, key_width=4, value_width=3, heads=2, key_dim=2,
                seed=2)
    bias = random_bias((2, 2, 3, 3) if shape == "BHTS" else (3, 3), torch.float64).requires_grad_()
    values = case.values.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in case.weights.values()]

    def function(bias, values, *weights):
        return sparse_query_attention(case.query(values), case.key, case.value, *weights, num_heads=case.heads,
                                      attention_bias=bias, num_threads=1)

    assert torch.autograd.gradcheck(function, (bias, values, *weights), eps=1e-6, atol=1e-7)


def torch_mha_and_module(heads=H, embed=6, kdim=None, seed=5):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(embed, heads, batch_first=True, kdim=kdim, vdim=kdim, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    module = SparseQueryMultiheadAttention(heads, embed // heads, embed, kdim or embed, kdim or embed,
                                           dtype=torch.float64, num_threads=1)
    weight = mha.in_proj_weight if kdim is None else None
    q_weight, k_weight, v_weight = weight.split(embed) if weight is not None else (
        mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    q_bias, k_bias, v_bias = mha.in_proj_bias.split(embed)
    with torch.no_grad():
        for name, tensor in (("query_kernel", q_weight.T), ("key_kernel", k_weight.T), ("value_kernel", v_weight.T),
                             ("query_bias", q_bias), ("key_bias", k_bias), ("value_bias", v_bias),
                             ("output_kernel", mha.out_proj.weight.T), ("output_bias", mha.out_proj.bias)):
            getattr(module, name).copy_(tensor)
    return mha, module


def torch_inputs(embed=6, seed=6):
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(B, T, embed, generator=generator, dtype=torch.float64)
    dense = dense * (torch.rand(B, T, embed, generator=generator) < 0.5)
    key = torch.randn(B, S, embed, generator=generator, dtype=torch.float64)
    value = torch.randn(B, S, embed, generator=generator, dtype=torch.float64)
    return dense, key, value


def torch_attn_masks():
    """PyTorch-convention attn_masks: name -> (mask for sdmha, mask for nn.MultiheadAttention)."""
    blocked_2d = ~random_mask((T, S), seed=7)
    blocked_3d = ~random_mask((B * H, T, S), seed=8)
    bias_2d = random_bias((T, S), torch.float64, seed=9)
    bias_3d = random_bias((B * H, T, S), torch.float64, seed=10)
    large = torch.where(blocked_3d, torch.tensor(-1e9, dtype=torch.float64), bias_3d)
    return {
        "bool (L, S)": blocked_2d,
        "bool (N*H, L, S)": blocked_3d,
        "float (L, S)": bias_2d,
        "float (N*H, L, S)": bias_3d,
        "float -inf (L, S)": bias_2d.masked_fill(blocked_2d, float("-inf")),
        "float -1e9 (N*H, L, S)": large,
        "float finfo.min (L, S)": bias_2d.masked_fill(blocked_2d, torch.finfo(torch.float64).min),
    }


@pytest.mark.parametrize("name", list(torch_attn_masks()))
@pytest.mark.parametrize("padding", [False, True])
def test_torch_attn_mask_conventions_equal_nn_multihead_attention(name, padding):
    attn_mask = torch_attn_masks()[name]
    mha, module = torch_mha_and_module()
    dense, key, value = torch_inputs()
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.zeros(B, S, dtype=torch.bool)
        key_padding_mask[1, -1] = True
    sparse = dense.to_sparse().coalesce()
    needs_grad = attn_mask.is_floating_point()
    sdmha_mask = attn_mask.clone().requires_grad_(needs_grad)
    torch_mask = attn_mask.clone().requires_grad_(needs_grad)
    output = module(sparse, key, value, attn_mask=sdmha_mask, key_padding_mask=key_padding_mask)
    expected, _ = mha(dense, key, value, attn_mask=torch_mask, key_padding_mask=key_padding_mask)
    assert_close(output, expected, torch.float64, name)
    if needs_grad:
        d_output = torch.randn_like(expected)
        (output * d_output).sum().backward()
        (expected * d_output).sum().backward()
        assert_close(sdmha_mask.grad, torch_mask.grad, torch.float64, f"{name}: attn_mask gradient")


def test_masks_of_the_three_conventions_combine():
    case = small_case()
    module, query, _, key, value = module_and_inputs(case)
    keras_mask = random_mask((B, T, S), seed=11)
    torch_blocked = ~random_mask((B * H, T, S), seed=12)
    bias = random_bias((T, S), torch.float64, seed=13)
    torch_bias = random_bias((1, H, T, S), torch.float64, seed=14)
    output = module(query, key, value, attention_mask=keras_mask, attn_mask=torch_blocked, attention_bias=bias)
    allowed = keras_mask[:, None] & ~torch_blocked.view(B, H, T, S)
    expected, _ = reference(case.dense_query(), case.key, case.value, case.weights, H, attention_mask=allowed,
                            attention_bias=bias)
    assert_close(output, expected, torch.float64, "bool masks ANDed")
    output = module(query, key, value, attn_mask=torch_bias, attention_bias=bias)
    expected, _ = reference(case.dense_query(), case.key, case.value, case.weights, H,
                            attention_bias=bias + torch_bias)
    assert_close(output, expected, torch.float64, "biases summed")


def test_torch_attn_mask_bad_shapes_are_named():
    case = small_case()
    module, query, _, key, value = module_and_inputs(case)
    with pytest.raises(sdmha.ShapeError, match=r"attn_mask has shape \(3, 5, 4\).*N\*H = 2\*2 = 4"):
        module(query, key, value, attn_mask=torch.zeros(3, T, S, dtype=torch.bool))
    with pytest.raises(sdmha.ShapeError, match=r"attn_mask has shape \(4,\)"):
        module(query, key, value, attn_mask=torch.zeros(4))
    with pytest.raises(sdmha.ShapeError, match="attention_mask"):
        module(query, key, value, attention_mask=torch.ones(3, 1, T, S, dtype=torch.bool))


def test_dropout_draws_a_fresh_seed_per_training_call_reproducible_under_manual_seed():
    case = small_case()
    module = case.module(dropout=0.5)
    module.train()
    query = case.query()
    torch.manual_seed(21)
    first = module(query, case.key, case.value)
    second = module(query, case.key, case.value)
    assert not torch.equal(first, second), "two consecutive training calls drop different entries"
    torch.manual_seed(21)
    assert torch.equal(module(query, case.key, case.value), first)
    assert torch.equal(module(query, case.key, case.value), second)
    module.eval()
    assert torch.equal(module(query, case.key, case.value), module(query, case.key, case.value))
