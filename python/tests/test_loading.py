"""from_keras / from_torch through sdmha::io::load_layer: the goldens of tests/data/goldens, and a
live torch.nn.MultiheadAttention (outputs, attention weights and gradients) on the densified query."""

import numpy as np
import pytest
import torch

import sdmha
from conftest import GOLDENS, SOURCE_DIR, Case, assert_close, reference
from sdmha.torch import SparseQueryMultiheadAttention

KERAS_GOLDENS = sorted(path.name for path in GOLDENS.glob("keras_*.safetensors"))


def golden_inputs(tensors, dtype):
    indices = torch.from_numpy(tensors["query/indices"]).T
    shape = tuple(int(n) for n in tensors["query/dense_shape"])
    query = torch.sparse_coo_tensor(indices, torch.from_numpy(tensors["query/values"]).to(dtype), shape)
    value = torch.from_numpy(tensors["value"]).to(dtype)
    key = torch.from_numpy(tensors["key"]).to(dtype) if "key" in tensors else None
    mask = torch.from_numpy(tensors["attention_mask"]) if "attention_mask" in tensors else None
    return query, key, value, mask


@pytest.mark.parametrize("name", KERAS_GOLDENS + ["torch_packed_f64.safetensors"])
def test_goldens(name, export_tools):
    path = GOLDENS / name
    tensors, metadata = export_tools.read_safetensors(str(path))
    dtype = torch.float32 if name.endswith("f32.safetensors") else torch.float64
    if metadata["layout"] == "keras":
        module = SparseQueryMultiheadAttention.from_keras(path, dtype=dtype)
    else:
        module = SparseQueryMultiheadAttention.from_torch(path, dtype=dtype)
    assert module.file_use_causal_mask == (metadata["use_causal_mask"] == "true")
    query, key, value, mask = golden_inputs(tensors, dtype)
    # Keras' call(query, value, key=None): the key defaults to the value.
    output, scores = module(query, value if key is None else key, value, attention_mask=mask,
                            use_causal_mask=module.file_use_causal_mask, return_attention_scores=True)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    expected = torch.from_numpy(tensors["expected/output"])
    assert torch.all((output.double() - expected).abs() <= tolerance * (1 + expected.abs()))
    expected_scores = torch.from_numpy(tensors["expected/attention_scores"])
    assert torch.all((scores.double() - expected_scores).abs() <= tolerance * (1 + expected_scores.abs()))


def test_load_layer_and_load_inputs_at_the_numpy_level(export_tools):
    path = GOLDENS / "keras_mask_f64.safetensors"
    tensors, _ = export_tools.read_safetensors(str(path))
    loaded = sdmha.load_layer(path, dtype="float64")
    assert loaded["layout"] == "keras"
    inputs = sdmha.load_inputs(path, dtype="float64")
    assert inputs["attention_mask"] is not None and inputs["query"].from_coo_entries
    output, _ = loaded["layer"].forward(inputs["query"], inputs["key"], inputs["value"],
                                        attention_mask=inputs["attention_mask"])
    np.testing.assert_allclose(output, tensors["expected/output"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["goldens/keras_causal_f64", "semantics/scale_keras_f64",
                                  "semantics/causal_bottom_right_t6_s4_uniform_torch_f64",
                                  "semantics/fully_masked_mask_uniform_keras_f64"])
def test_load_layer_hands_over_the_files_attention_settings(name, export_tools):
    path = SOURCE_DIR / "tests" / "data" / (name + ".safetensors")
    tensors, metadata = export_tools.read_safetensors(str(path))
    loaded = sdmha.load_layer(path, dtype="float64")
    settings = loaded["options"]
    assert settings["use_causal_mask"] == (metadata["use_causal_mask"] == "true")
    assert settings["causal_alignment"] == metadata.get("causal_alignment", "top_left")
    assert settings["fully_masked_rows"] == metadata.get("fully_masked_rows", "zeros")
    assert settings["scale"] == (float(metadata["scale"]) if "scale" in metadata else None)
    inputs = sdmha.load_inputs(path, dtype="float64")
    arrays = (inputs["query"], inputs["key"], inputs["value"])
    masks = {"attention_mask": inputs["attention_mask"], "attention_bias": inputs["attention_bias"]}
    output, _ = loaded["layer"].forward(*arrays, **masks, **settings)
    np.testing.assert_allclose(output, tensors["expected/output"], rtol=1e-10, atol=1e-10)
    # The settings matter: without them the output differs.
    plain, _ = loaded["layer"].forward(*arrays, **masks)
    assert not np.allclose(plain, tensors["expected/output"], rtol=1e-10, atol=1e-10)
    if name == "goldens/keras_causal_f64":  # docs/python.md's example prints it
        assert abs(output[0, 0, 0] - 0.0641) < 5e-5


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_from_keras_names_with_a_layer_prefix(tmp_path, export_tools, suffix, use_bias):
    case = Case(heads=3, key_dim=2, value_dim=4, output_dim=5, use_bias=use_bias)
    heads, eq = case.heads, case.features
    w = case.weights
    tensors = {
        "mha/query/kernel": w["query_kernel"].reshape(eq, heads, case.key_dim),
        "mha/key/kernel": w["key_kernel"].reshape(-1, heads, case.key_dim),
        "mha/value/kernel": w["value_kernel"].reshape(-1, heads, case.value_dim),
        "mha/attention_output/kernel": w["output_kernel"].reshape(heads, case.value_dim, case.output_dim),
    }
    if use_bias:
        tensors.update({
            "mha/query/bias": w["query_bias"].reshape(heads, case.key_dim),
            "mha/key/bias": w["key_bias"].reshape(heads, case.key_dim),
            "mha/value/bias": w["value_bias"].reshape(heads, case.value_dim),
            "mha/attention_output/bias": w["output_bias"],
        })
    path = tmp_path / f"layer{suffix}"
    writer = export_tools.write_npz if suffix == ".npz" else export_tools.write_safetensors
    writer(str(path), {k: v.numpy() for k, v in tensors.items()}, {"layout": "keras"})
    module = SparseQueryMultiheadAttention.from_keras(path, dtype=torch.float64, num_threads=1)
    assert (module.value_dim, module.output_dim, module.use_bias) == (4, 5, use_bias)
    expected, _ = reference(case.dense_query(), case.key, case.value, w, heads)
    assert_close(module(case.query(), case.key, case.value), expected, torch.float64, "from_keras")


@pytest.mark.parametrize("separate_projections", [False, True])
def test_from_torch_equals_nn_multihead_attention(tmp_path, export_tools, separate_projections):
    torch.manual_seed(3)
    batch, steps, key_steps, embed, heads = 3, 6, 5, 8, 2
    kdim, vdim = (5, 7) if separate_projections else (embed, embed)
    mha = torch.nn.MultiheadAttention(embed, heads, batch_first=True, kdim=kdim, vdim=vdim, dtype=torch.float64)
    with torch.no_grad():  # non-zero biases, so that they are checked too
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    path = tmp_path / "mha.safetensors"
    export_tools.export_torch(mha, str(path))
    module = SparseQueryMultiheadAttention.from_torch(path, dtype=torch.float64, num_threads=1)
    assert (module.num_heads, module.key_dim, module.output_dim) == (heads, embed // heads, embed)

    dense = torch.randn(batch, steps, embed, dtype=torch.float64) * (torch.rand(batch, steps, embed) < 0.4)
    key = torch.randn(batch, key_steps, kdim, dtype=torch.float64)
    value = torch.randn(batch, key_steps, vdim, dtype=torch.float64)
    allowed = torch.rand(batch, steps, key_steps) < 0.7
    allowed[..., 0] = True  # torch gives NaN for a fully blocked row; Keras/sdmha give zeros

    sparse_values = dense.to_sparse().coalesce()
    values = sparse_values.values().clone().requires_grad_()
    query = torch.sparse_coo_tensor(sparse_values.indices(), values, dense.shape)
    key_sdmha, value_sdmha = key.clone().requires_grad_(), value.clone().requires_grad_()
    output, scores = module(query, key_sdmha, value_sdmha, attention_mask=allowed, return_attention_scores=True)

    dense_query = dense.clone().requires_grad_()
    key_torch, value_torch = key.clone().requires_grad_(), value.clone().requires_grad_()
    # torch's attn_mask: True = not allowed; one (T, S) mask per batch entry and head.
    attn_mask = (~allowed).repeat_interleave(heads, dim=0)
    expected, weights = mha(dense_query, key_torch, value_torch, attn_mask=attn_mask, need_weights=True,
                            average_attn_weights=False)
    assert_close(output, expected, torch.float64, "output")
    assert_close(scores, weights, torch.float64, "attention weights")

    d_output = torch.randn_like(expected)
    (output * d_output).sum().backward()
    (expected * d_output).sum().backward()
    assert_close(key_sdmha.grad, key_torch.grad, torch.float64, "key gradient")
    assert_close(value_sdmha.grad, value_torch.grad, torch.float64, "value gradient")
    stored = sparse_values.indices()
    assert_close(values.grad, dense_query.grad[stored[0], stored[1], stored[2]], torch.float64, "query gradient")
    if separate_projections:
        q_weight, k_weight, v_weight = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        q_grad, k_grad, v_grad = q_weight.grad, k_weight.grad, v_weight.grad
    else:
        q_grad, k_grad, v_grad = mha.in_proj_weight.grad.split(embed)
    assert_close(module.query_kernel.grad, q_grad.T, torch.float64, "in_proj q")
    assert_close(module.key_kernel.grad, k_grad.T, torch.float64, "in_proj k")
    assert_close(module.value_kernel.grad, v_grad.T, torch.float64, "in_proj v")
    bias_grads = mha.in_proj_bias.grad.split(embed)
    assert_close(module.query_bias.grad, bias_grads[0], torch.float64, "in_proj_bias q")
    assert_close(module.value_bias.grad, bias_grads[2], torch.float64, "in_proj_bias v")
    assert_close(module.output_kernel.grad, mha.out_proj.weight.grad.T, torch.float64, "out_proj.weight")
    assert_close(module.output_bias.grad, mha.out_proj.bias.grad, torch.float64, "out_proj.bias")


def test_from_torch_needs_num_heads_without_metadata(tmp_path, export_tools):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    tensors, _ = export_tools.torch_tensors(mha)
    path = tmp_path / "bare.safetensors"
    export_tools.write_safetensors(str(path), tensors)
    with pytest.raises(sdmha.FormatError, match="num_heads"):
        SparseQueryMultiheadAttention.from_torch(path)
    assert SparseQueryMultiheadAttention.from_torch(path, num_heads=2).num_heads == 2


KERAS_FILES = SOURCE_DIR / "tests" / "data" / "keras"


@pytest.mark.skipif(not sdmha._sdmha.with_keras_files, reason="built without the Keras file reader")
@pytest.mark.parametrize("file, layer_name, expected", [
    ("functional_bias.keras", "attention", "functional_bias"),
    ("functional_bias.weights.h5", "attention", "functional_bias"),
    ("nested.keras", "attention", "nested_attention"),
    ("nested.keras", "outer_attention", "nested_outer_attention"),
])
@pytest.mark.parametrize("isolated", [True, False])
def test_from_keras_reads_keras_3_files(file, layer_name, expected, isolated):
    """Keras 3 .keras / .weights.h5 files (tests/data/keras, docs/keras_files.md) against the
    float64 outputs stored beside them, read in a child process (the default) and in this one;
    the query is the dense one made sparse."""
    module = SparseQueryMultiheadAttention.from_keras(KERAS_FILES / file, dtype=torch.float64,
                                                      layer_name=layer_name, num_threads=1,
                                                      isolated=isolated)
    arrays = np.load(KERAS_FILES / f"{expected}.expected.npz")
    query = torch.from_numpy(arrays["query"]).to_sparse()
    output = module(query, torch.from_numpy(arrays["key"]), torch.from_numpy(arrays["value"]))
    assert_close(output, torch.from_numpy(arrays["output"]), torch.float64, f"{file}:{layer_name}")


@pytest.mark.skipif(not sdmha._sdmha.with_keras_files, reason="built without the Keras file reader")
def test_load_keras_layer_names_the_layer_and_rejects_a_wrong_name():
    loaded = sdmha.load_keras_layer(KERAS_FILES / "functional_bias.keras", "float64", "attention")
    assert (loaded["group"], loaded["keras_version"]) == ("layers/multi_head_attention", "3.8.0")
    assert loaded["layer"].output_dim == 7
    with pytest.raises(sdmha.Error, match="no_such_layer"):
        sdmha.load_keras_layer(KERAS_FILES / "functional_bias.keras", "float64", "no_such_layer")


@pytest.mark.skipif(not sdmha._sdmha.with_keras_files, reason="built without the Keras file reader")
@pytest.mark.parametrize("file", ["functional_bias.keras", "functional_bias.weights.h5", "nested.keras"])
def test_load_keras_layer_isolated_by_default_and_in_process_on_request_agree(file):
    """The default (a child process reads the file) and isolated=False (this process) give the
    same layer: names, version and the reason for a missing one, and bitwise the same weights."""
    isolated = sdmha.load_keras_layer(KERAS_FILES / file, "float64", "attention")
    direct = sdmha.load_keras_layer(KERAS_FILES / file, "float64", "attention", isolated=False)
    for key in ("name", "group", "keras_version", "no_keras_version_reason"):
        assert isolated[key] == direct[key], key
    if file.endswith(".weights.h5"):
        assert isolated["no_keras_version_reason"] == "a .weights.h5 file holds no metadata.json"
    else:
        assert isolated["keras_version"] != "" and isolated["no_keras_version_reason"] == ""
    for name in isolated["layer"].weight_names:
        a, b = isolated["layer"].weight(name), direct["layer"].weight(name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.skipif(not sdmha._sdmha.with_keras_files, reason="built without the Keras file reader")
@pytest.mark.parametrize("file", ["address_all_ones_120.weights.h5", "address_all_ones_688.weights.h5"])
def test_load_keras_layer_isolated_turns_a_libhdf5_crash_into_an_io_error(file):
    """Files that crash libhdf5 in-process (tests/data/keras/damaged/README.md) end in an IoError
    naming the file, and this interpreter goes on (isolated=False would take it down: not run)."""
    path = KERAS_FILES / "damaged" / file
    with pytest.raises(sdmha.IoError, match=file):
        sdmha.load_keras_layer(path, "float64", "attention")
    assert sdmha.load_keras_layer(KERAS_FILES / "functional_bias.keras", "float64",
                                  "attention")["keras_version"] == "3.8.0"
