"""tools/cli/sdmha_export.py on PyTorch's masks: a float attn_mask becomes an additive attention_bias
(-inf, -1e9 and finfo.min kept as values), a bool one an inverted attention_mask, (N*H, L, S) is
read as (N, H, L, S), key_padding_mask is ANDed; the inputs file carries both tensors; the result,
fed to sdmha, equals torch.nn.MultiheadAttention with the original masks."""

import numpy as np
import pytest
import torch

import sdmha
from conftest import assert_close
from sdmha.torch import SparseQueryMultiheadAttention

B, T, S, H, E = 2, 5, 4, 2, 6


def mha_and_module(tmp_path, export_tools):
    torch.manual_seed(17)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    path = tmp_path / "mha.safetensors"
    export_tools.export_torch(mha, str(path))
    module = SparseQueryMultiheadAttention.from_torch(path, dtype=torch.float64, num_threads=1)
    return mha, module


def inputs(seed=18):
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(B, T, E, generator=generator, dtype=torch.float64)
    dense = dense * (torch.rand(B, T, E, generator=generator) < 0.5)
    key = torch.randn(B, S, E, generator=generator, dtype=torch.float64)
    value = torch.randn(B, S, E, generator=generator, dtype=torch.float64)
    return dense, key, value


def blocked(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=generator) < 0.4
    mask[..., 0] = False  # every row sees key 0: nn.MultiheadAttention gives NaN for a blocked row
    return mask


def bias(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def attn_masks():
    return {
        "bool (L, S)": (blocked((T, S), 1), (T, S), None),
        "bool (N*H, L, S)": (blocked((B * H, T, S), 2), (B, H, T, S), None),
        "float (L, S)": (bias((T, S), 3), None, (T, S)),
        "float (N*H, L, S)": (bias((B * H, T, S), 4), None, (B, H, T, S)),
        "float -inf (L, S)": (bias((T, S), 5).masked_fill(blocked((T, S), 6), float("-inf")), None, (T, S)),
        "float -1e9 (N*H, L, S)": (bias((B * H, T, S), 7).masked_fill(blocked((B * H, T, S), 8), -1e9), None,
                                   (B, H, T, S)),
        "float32 finfo.min (L, S)": (bias((T, S), 9).float().masked_fill(blocked((T, S), 10),
                                                                         torch.finfo(torch.float32).min),
                                     None, (T, S)),
    }


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("name", list(attn_masks()))
def test_attention_inputs_from_torch_equal_nn_multihead_attention(tmp_path, export_tools, name, padding):
    attn_mask, mask_shape, bias_shape = attn_masks()[name]
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.zeros(B, S, dtype=torch.bool)
        key_padding_mask[0, -1] = True
        if mask_shape == (T, S):
            mask_shape = (B, T, S)
        elif mask_shape is None:
            mask_shape = (B, T, S)
    converted = export_tools.attention_inputs_from_torch(B, T, S, attn_mask, key_padding_mask, num_heads=H)
    mask, bias_values = converted["attention_mask"], converted["attention_bias"]
    assert (None if mask is None else mask.shape) == mask_shape
    assert (None if bias_values is None else bias_values.shape) == bias_shape
    if bias_values is not None:  # kept as values: -inf, -1e9 and finfo.min alike
        np.testing.assert_array_equal(bias_values, attn_mask.numpy().reshape(bias_shape))
        assert bias_values.dtype == attn_mask.numpy().dtype

    mha, module = mha_and_module(tmp_path, export_tools)
    dense, key, value = inputs()
    # Through the inputs file, as sdmha-run would read it.
    path = tmp_path / "inputs.safetensors"
    export_tools.write_inputs(str(path), export_tools.sparse_query_tensors(dense.numpy()), value.numpy(),
                              key=key.numpy(), **converted)
    tensors, _ = export_tools.read_safetensors(str(path))
    file_mask = tensors.get("attention_mask")
    file_bias = tensors.get("attention_bias")
    assert (file_mask is None) == (mask is None) and (file_bias is None) == (bias_values is None)
    if file_mask is not None:
        assert file_mask.dtype == np.bool_ and file_mask.shape == mask.shape
    if file_bias is not None:
        assert file_bias.dtype == np.float64 and file_bias.shape == bias_values.shape

    output = module(dense.to_sparse(), key, value,
                    attention_mask=None if file_mask is None else torch.from_numpy(file_mask),
                    attention_bias=None if file_bias is None else torch.from_numpy(file_bias))
    with torch.no_grad():
        expected, _ = mha(dense, key, value, attn_mask=attn_mask.to(torch.float64) if bias_shape else attn_mask,
                          key_padding_mask=key_padding_mask)
    assert_close(output, expected, torch.float64, name)


def test_inputs_file_is_read_by_load_inputs(tmp_path, export_tools):
    if not sdmha._sdmha.with_io:
        pytest.skip("no sdmha::io in this build")
    dense, key, value = inputs()
    converted = export_tools.attention_inputs_from_torch(B, T, S, bias((B * H, T, S), 11),
                                                         key_padding_mask=torch.zeros(B, S, dtype=torch.bool),
                                                         num_heads=H)
    path = tmp_path / "inputs.safetensors"
    export_tools.write_inputs(str(path), export_tools.sparse_query_tensors(dense.numpy()), value.numpy(),
                              key=key.numpy(), **converted)
    loaded = sdmha.load_inputs(path, "float64")
    np.testing.assert_array_equal(loaded["attention_mask"], converted["attention_mask"])
    if loaded.get("attention_bias") is not None:  # an sdmha::io that reads attention_bias
        np.testing.assert_array_equal(loaded["attention_bias"], converted["attention_bias"])


def test_attention_mask_from_torch_keeps_working_for_bool_masks_and_refuses_float_ones(export_tools):
    blocked_2d = blocked((T, S), 12)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, 2] = True
    mask = export_tools.attention_mask_from_torch(B, T, S, blocked_2d, padding)
    expected = ~blocked_2d.numpy()[None] & ~padding.numpy()[:, None, :]
    np.testing.assert_array_equal(mask, expected)
    assert mask.shape == (B, T, S)
    per_head = blocked((B * H, T, S), 13)
    mask = export_tools.attention_mask_from_torch(B, T, S, per_head, num_heads=H)
    np.testing.assert_array_equal(mask, ~per_head.numpy().reshape(B, H, T, S))
    np.testing.assert_array_equal(export_tools.attention_mask_from_torch(B, T, S), np.ones((B, T, S), bool))
    with pytest.raises(ValueError, match="float attn_mask is added to the scores: use attention_inputs_from_torch"):
        export_tools.attention_mask_from_torch(B, T, S, torch.zeros(T, S))


@pytest.mark.parametrize("arguments, message", [
    ({"attn_mask": torch.zeros(B * H + 1, T, S, dtype=torch.bool), "num_heads": H},
     r"attn_mask has shape \(5, 5, 4\); its first dimension 5 is not N\*H = 2\*2 = 4"),
    ({"attn_mask": torch.zeros(B * H, T, S)}, r"attn_mask has shape \(4, 5, 4\).*pass num_heads="),
    ({"attn_mask": torch.zeros(T, S + 1)}, r"attn_mask has shape \(5, 5\); expected \(L, S\) = \(5, 4\)"),
    ({"attn_mask": torch.zeros(S)}, r"attn_mask has shape \(4,\)"),
    ({"attn_mask": torch.zeros(3, H, T, S)}, r"attn_mask has shape \(3, 2, 5, 4\)"),
    ({"attn_mask": torch.zeros(T, S, dtype=torch.int32)}, r"attn_mask has dtype int32; expected bool"),
    ({"key_padding_mask": torch.zeros(B, S + 1, dtype=torch.bool)},
     r"key_padding_mask has shape \(2, 5\); expected \(B, S\) = \(2, 4\)"),
    ({"key_padding_mask": torch.zeros(B, S)}, r"key_padding_mask has dtype float32; expected bool"),
])
def test_attention_inputs_from_torch_bad_input(export_tools, arguments, message):
    with pytest.raises(ValueError, match=message):
        export_tools.attention_inputs_from_torch(B, T, S, **arguments)


def test_inputs_writer_checks_mask_and_bias(export_tools):
    dense, key, value = inputs()
    query = export_tools.sparse_query_tensors(dense.numpy().astype(np.float32))
    tensors = export_tools.inputs_tensors(query, value.numpy(), attention_mask=np.ones((1, H, T, S), bool),
                                          attention_bias=np.zeros((B, 1, T, S)))
    assert tensors["attention_mask"].shape == (1, H, T, S) and tensors["attention_mask"].dtype == np.bool_
    assert tensors["attention_bias"].shape == (B, 1, T, S) and tensors["attention_bias"].dtype == np.float32
    with pytest.raises(ValueError, match="attention_mask has dtype float64; expected bool.*attention_bias"):
        export_tools.inputs_tensors(query, value.numpy(), attention_mask=np.zeros((T, S)))
    with pytest.raises(ValueError, match=r"attention_bias has shape \(3, 5, 4\); expected \(T, S\)"):
        export_tools.inputs_tensors(query, value.numpy(), attention_bias=np.zeros((3, T, S)))
    with pytest.raises(ValueError, match="attention_bias has dtype bool"):
        export_tools.inputs_tensors(query, value.numpy(), attention_bias=np.zeros((T, S), bool))
