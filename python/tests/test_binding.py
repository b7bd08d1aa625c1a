"""The NumPy-level binding sdmha._sdmha: CSR and COO queries, forward/backward against the
reference, memory ownership, the workspace, the GIL, and bad input as Python exceptions."""

import builtins
import threading
import time

import numpy as np
import pytest
import torch

import sdmha
from conftest import Case, assert_close, numpy_of, reference


def csr_arrays(case):
    """indptr, indices, values of the case's coalesced query (B*T rows)."""
    coalesced = case.query().coalesce()
    indices = coalesced.indices()
    rows = indices[0] * case.steps + indices[1]
    indptr = np.zeros(case.batch * case.steps + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows.numpy(), minlength=case.batch * case.steps), out=indptr[1:])
    return indptr, indices[2].numpy().astype(np.int32), numpy_of(coalesced.values())


def layer_of(case, dtype="float64"):
    layer = sdmha.Layer(case.heads, case.key_dim, case.features, case.key.shape[2], case.value.shape[2],
                        value_dim=case.value_dim, output_dim=case.output_dim, use_bias=case.use_bias, dtype=dtype)
    for name, weight in case.weights.items():
        if weight is not None:
            layer.set_weight(name, numpy_of(weight))
    return layer


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_csr_forward_and_backward_match_the_reference(dtype):
    case = Case()
    torch_dtype = getattr(torch, dtype)
    layer = layer_of(case, dtype)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values.astype(dtype))
    assert query.dtype == dtype and query.nonzeros == values.size
    key, value = numpy_of(case.key).astype(dtype), numpy_of(case.value).astype(dtype)
    mask = numpy_of(case.random_mask())
    workspace = sdmha.Workspace(dtype)
    output, scores = layer.forward(query, key, value, attention_mask=mask, use_causal_mask=True,
                                   return_attention_scores=True, workspace=workspace, num_threads=2)
    assert output.dtype == np.dtype(dtype) and output.flags.c_contiguous and output.flags.writeable
    expected, expected_scores = reference(case.dense_query(), case.key, case.value, case.weights, case.heads,
                                          torch.from_numpy(mask), True)
    assert_close(output, expected, torch_dtype, "output")
    assert_close(scores, expected_scores, torch_dtype, "scores")
    d_output = numpy_of(case.d_output).astype(dtype)
    grads = layer.backward(query, key, value, d_output, attention_mask=mask, use_causal_mask=True,
                           workspace=workspace)
    assert workspace.bytes > 0

    ref_values = case.query().coalesce().values().clone().requires_grad_()
    ref_weights = {n: w.clone().requires_grad_() for n, w in case.weights.items()}
    ref_key, ref_value = case.key.clone().requires_grad_(), case.value.clone().requires_grad_()
    dense = torch.sparse_coo_tensor(case.query().coalesce().indices(), ref_values, case.query().shape).to_dense()
    ref_output, _ = reference(dense, ref_key, ref_value, ref_weights, case.heads, torch.from_numpy(mask), True)
    (ref_output * case.d_output).sum().backward()
    for name, weight in ref_weights.items():
        assert_close(grads[name], weight.grad, torch_dtype, name)
    assert_close(grads["query_values"], ref_values.grad, torch_dtype, "query values (CSR order)")
    assert_close(grads["key"], ref_key.grad, torch_dtype, "key")
    assert_close(grads["value"], ref_value.grad, torch_dtype, "value")


def test_input_gradients_selects_what_backward_returns():
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values)
    key, value, d_output = numpy_of(case.key), numpy_of(case.value), numpy_of(case.d_output)
    every = layer.backward(query, key, value, d_output)
    for wanted in ((), ("key",), ("value", "query_values"), ("query_values", "key", "value")):
        grads = layer.backward(query, key, value, d_output, input_gradients=wanted)
        for name, expected in every.items():
            if name in ("query_values", "key", "value") and name not in wanted:
                assert grads[name] is None, name
            elif expected is not None:
                assert np.array_equal(grads[name], expected), name
    with pytest.raises(sdmha.ConfigError, match="input_gradients names 'keys'; expected 'query_values', 'key' or"):
        layer.backward(query, key, value, d_output, input_gradients=("keys",))
    with pytest.raises(sdmha.ConfigError, match="input_gradients is the string 'key'; expected a tuple"):
        layer.backward(query, key, value, d_output, input_gradients="key")


def test_key_mask_true_may_attend():
    """key_mask (B, S), True = may attend (the negation of PyTorch's key_padding_mask): a key step
    whose entry is False gets probability 0 from every query and head of its batch entry; the
    forward and backward equal the reference with key_padding_mask = ~key_mask. A view of a
    non-contiguous array is taken on a copy that the call keeps alive."""
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values)
    key, value = numpy_of(case.key), numpy_of(case.value)
    key_mask = np.ones((case.batch, case.key_steps), bool)
    key_mask[0, 1] = False
    key_mask[1, -1] = False
    output, scores = layer.forward(query, key, value, key_mask=key_mask, return_attention_scores=True)
    assert np.all(scores[0, :, :, 1] == 0) and np.all(scores[1, :, :, -1] == 0)
    assert np.all(scores[0, :, :, 0] > 0) and np.all(scores[1, :, :, 0] > 0)
    expected, expected_scores = reference(case.dense_query(), case.key, case.value, case.weights, case.heads,
                                          key_padding_mask=torch.from_numpy(~key_mask))
    assert_close(output, expected, torch.float64, "output")
    assert_close(scores, expected_scores, torch.float64, "scores")
    transposed = np.asfortranarray(key_mask)  # not C-contiguous: copied for the call
    assert np.array_equal(layer.forward(query, key, value, key_mask=transposed)[0], output)
    d_output = numpy_of(case.d_output)
    masked = layer.backward(query, key, value, d_output, key_mask=key_mask)
    assert np.all(masked["key"][0, 1] == 0) and np.all(masked["value"][1, -1] == 0)
    everything = layer.backward(query, key, value, d_output, key_mask=np.ones_like(key_mask))
    assert not np.all(everything["key"][0, 1] == 0)
    with pytest.raises(sdmha.ShapeError, match=r"key_mask is \(1, 4\); expected \(B, S\) = \(2, 4\)"):
        layer.forward(query, key, value, key_mask=np.ones((1, case.key_steps), bool))
    with pytest.raises(sdmha.ShapeError, match="key_mask has 1 dimensions; expected 2"):
        layer.forward(query, key, value, key_mask=np.ones(case.key_steps, bool))
    with pytest.raises(TypeError, match="key_padding_mask .* expected key_mask"):
        layer.forward(query, key, value, key_padding_mask=~key_mask)


def test_coo_query_gives_one_gradient_per_input_entry():
    case = Case(duplicates=3)
    layer = layer_of(case)
    coordinates = np.ascontiguousarray(case.indices.T.numpy())
    query = sdmha.coo_query(case.batch, case.steps, case.features, coordinates, numpy_of(case.values))
    assert query.from_coo_entries
    mapping = query.coo_to_stored()
    assert mapping.shape == (case.values.numel(),)
    assert query.nonzeros == case.values.numel() - 3  # duplicates summed
    key, value = numpy_of(case.key), numpy_of(case.value)
    np.testing.assert_allclose(query.to_dense(), numpy_of(case.dense_query()), rtol=0, atol=1e-15)
    grads = layer.backward(query, key, value, numpy_of(case.d_output))
    values = case.values.clone().requires_grad_()
    output, _ = reference(case.dense_query(values), case.key, case.value, case.weights, case.heads)
    (output * case.d_output).sum().backward()
    assert_close(grads["query_values"], values.grad, torch.float64, "per COO entry")


def test_context_and_no_context_agree_and_results_outlive_the_layer():
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values)
    key, value = numpy_of(case.key), numpy_of(case.value)
    context = layer.project_context(key, value)
    assert context.batch == case.batch and context.key_steps == case.key_steps
    plain, _ = layer.forward(query, key, value)
    with_context, _ = layer.forward(query, key, value, context=context)
    np.testing.assert_array_equal(plain, with_context)
    d_output = numpy_of(case.d_output)
    g1 = layer.backward(query, key, value, d_output)
    g2 = layer.backward(query, key, value, d_output, context=context)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)
    view = layer.weight("query_kernel")
    del layer, query, context
    assert np.isfinite(plain).all() and np.isfinite(g1["key"]).all() and view.sum() != 0  # still alive


def test_result_buffers_are_recycled_only_once_released():
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values)
    key, value = numpy_of(case.key), numpy_of(case.value)
    d_output = numpy_of(case.d_output)
    first = layer.backward(query, key, value, d_output)
    kept = {name: array.copy() for name, array in first.items()}
    second = layer.backward(query, key, value, 2 * d_output)  # `first` is alive: new buffers
    for name, array in first.items():
        np.testing.assert_array_equal(array, kept[name], err_msg=f"{name} was overwritten")
        assert array.ctypes.data != second[name].ctypes.data, name
    np.testing.assert_allclose(second["key"], 2 * first["key"], rtol=1e-12)
    address = first["query_kernel"].ctypes.data
    del first
    third = layer.backward(query, key, value, d_output)  # reuses the released buffers
    assert third["query_kernel"].ctypes.data == address
    np.testing.assert_array_equal(third["query_kernel"], kept["query_kernel"])
    output, _ = layer.forward(query, key, value)
    address = output.ctypes.data
    expected = output.copy()
    del output
    again, _ = layer.forward(query, key, value)
    assert again.ctypes.data == address
    np.testing.assert_array_equal(again, expected)

    # Contexts come from a pool too: one still held is never projected over.
    workspace = sdmha.Workspace("float64")
    held = layer.project_context(key, value, workspace=workspace)
    other = layer.project_context(2 * key, 2 * value, workspace=workspace)
    for _ in range(3):
        layer.project_context(3 * key, 3 * value, workspace=workspace)  # reuses released ones
    np.testing.assert_array_equal(layer.forward(query, key, value, context=held)[0], expected)
    doubled, _ = layer.forward(query, 2 * key, 2 * value)
    np.testing.assert_array_equal(layer.forward(query, key, value, context=other)[0], doubled)


def test_weight_views_write_through_and_int32_arrays_are_viewed():
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr.astype(np.int32), indices, values)
    key, value = numpy_of(case.key), numpy_of(case.value)
    before, _ = layer.forward(query, key, value)
    layer.weight("output_bias")[:] += 1.0  # a view of the C++ weights: no set_weight needed
    after, _ = layer.forward(query, key, value)
    np.testing.assert_allclose(after - before, np.ones_like(before), rtol=0, atol=1e-12)
    assert layer.weight_names[0] == "query_kernel"
    assert layer.output_dim == case.output_dim and layer.query_dim == case.features
    assert layer.resolve_strategy(query, case.key_steps) in ("project_first", "sparse_regrouped")
    no_bias = sdmha.Layer(2, 3, 7, 6, 5, use_bias=False, dtype="float32")
    assert no_bias.weight("query_bias") is None


def test_the_gil_is_released_while_computing():
    rng = np.random.default_rng(0)
    batch, steps, features, key_steps, width = 8, 256, 4096, 256, 256
    layer = sdmha.Layer(8, 32, features, width, width, seed=1, dtype="float32")
    rows = batch * steps
    per_row = 64
    indptr = np.arange(rows + 1, dtype=np.int32) * per_row
    indices = rng.integers(0, features, rows * per_row).astype(np.int32)
    query = sdmha.csr_query(batch, steps, features, indptr, indices, rng.standard_normal(rows * per_row, np.float32))
    key = rng.standard_normal((batch, key_steps, width), np.float32)
    state = {"running": False, "duration": 0.0}

    def work():
        state["running"] = True
        start = time.perf_counter()
        for _ in range(3):
            layer.forward(query, key, key, num_threads=1, score_strategy="project_first")
        state["duration"] = time.perf_counter() - start
        state["running"] = False

    thread = threading.Thread(target=work)
    thread.start()
    seen, largest_gap = [], 0.0
    while thread.is_alive():
        if state["running"]:
            now = time.perf_counter()
            if seen:
                largest_gap = max(largest_gap, now - seen[-1])
            seen.append(now)
    thread.join()
    # Holding the GIL, the calls would leave this loop one gap as long as all of them.
    assert state["duration"] > 0.05
    assert largest_gap < 0.5 * state["duration"], (largest_gap, state["duration"])


# ---- bad input ----------------------------------------------------------------------------------


def test_exception_hierarchy():
    for error in (sdmha.ShapeError, sdmha.IndexError, sdmha.ConfigError, sdmha.FormatError, sdmha.IoError):
        assert issubclass(error, sdmha.Error)
    assert issubclass(sdmha.Error, ValueError)
    assert issubclass(sdmha.IndexError, builtins.IndexError)


def test_bad_input_raises_clear_python_exceptions(tmp_path):
    case = Case()
    layer = layer_of(case)
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values)
    key, value = numpy_of(case.key), numpy_of(case.value)

    with pytest.raises(sdmha.ShapeError, match=r"^sdmha: SparseDenseMHA::forward: key has batch 3; expected"):
        layer.forward(query, np.zeros((3, 4, 6)), value)
    with pytest.raises(sdmha.ShapeError, match="key has width 2"):
        layer.forward(query, np.zeros((case.batch, 4, 2)), value)
    with pytest.raises(sdmha.ShapeError, match="expected 3"):
        layer.forward(query, np.zeros((case.batch, 4)), value)
    with pytest.raises(sdmha.ShapeError, match="attention_mask"):
        layer.forward(query, key, value, attention_mask=np.ones((1, 2, 3), bool))
    with pytest.raises(sdmha.ShapeError, match="d_output"):
        layer.backward(query, key, value, np.zeros((1, 1, 1)))
    bad = indices.copy()
    bad[0] = 99
    with pytest.raises(sdmha.IndexError, match="column index 99"):
        sdmha.csr_query(case.batch, case.steps, case.features, indptr, bad, values)
    with pytest.raises(IndexError):  # the built-in catches it too
        sdmha.csr_query(case.batch, case.steps, case.features, indptr, bad, values)
    with pytest.raises(sdmha.IndexError, match="does not fit"):
        sdmha.csr_query(case.batch, case.steps, case.features, indptr, np.array([-1] * values.size), values)
    with pytest.raises(sdmha.ShapeError, match="row_offsets has"):
        sdmha.csr_query(case.batch, case.steps, case.features, indptr[:-1], indices, values)
    with pytest.raises(sdmha.IndexError, match=r"indices\[0\] feature = 70"):
        sdmha.coo_query(1, 1, 5, np.array([[0, 0, 70]]), np.array([1.0]))
    with pytest.raises(sdmha.ShapeError, match=r"expected \(nnz, 3\)"):
        sdmha.coo_query(1, 1, 5, np.array([[0, 0]]), np.array([1.0]))
    with pytest.raises(sdmha.ConfigError, match="num_threads"):
        layer.forward(query, key, value, num_threads=-1)
    with pytest.raises(sdmha.ConfigError, match="dropout_rate"):
        layer.forward(query, key, value, training=True, dropout_rate=1.0)
    with pytest.raises(sdmha.ConfigError, match="score_strategy"):
        layer.forward(query, key, value, score_strategy="fastest")
    with pytest.raises(sdmha.ConfigError, match="num_heads"):
        sdmha.Layer(0, 3, 7, 6, 5)
    with pytest.raises(sdmha.ShapeError, match=r"query_kernel has shape \(2, 2\); expected \(7, 6\)"):
        layer.set_weight("query_kernel", np.zeros((2, 2)))
    with pytest.raises(KeyError, match="no weight named"):
        layer.weight("bias")
    with pytest.raises(TypeError, match="unexpected keyword argument 'mask'"):
        layer.forward(query, key, value, mask=None)
    with pytest.raises(TypeError, match="workspace"):
        layer.forward(query, key, value, workspace=sdmha.Workspace("float32"))
    with pytest.raises(TypeError, match="SparseQuery_float64"):
        layer.forward(sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices,
                                      values.astype(np.float32)), key, value)
    with pytest.raises(TypeError, match="integer"):
        sdmha.csr_query(case.batch, case.steps, case.features, indptr.astype(float), indices, values)
    with pytest.raises(sdmha.IoError):
        sdmha.load_layer(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(sdmha.FormatError):
        sdmha.load_layer(garbage)
    with pytest.raises(TypeError, match="float16"):
        sdmha.Layer(1, 1, 1, 1, 1, dtype="float16")


def test_torch_module_bad_input():
    from sdmha.torch import SparseQueryMultiheadAttention

    case = Case()
    module = case.module()
    query = case.query()
    with pytest.raises(TypeError, match="dense query would get no gradient"):
        module(case.dense_query(), case.key, case.value)
    with pytest.raises(TypeError, match="dtype torch.float32"):
        module(query, case.key.float(), case.value)
    with pytest.raises(TypeError, match="query has dtype"):
        module(torch.sparse_coo_tensor(case.indices, case.values.float(), query.shape), case.key, case.value)
    with pytest.raises(sdmha.ShapeError, match="key has batch 1"):
        module(query, case.key[:1], case.value[:1])
    with pytest.raises(sdmha.ShapeError, match="key has shape"):
        module(query, case.key[0], case.value)
    with pytest.raises(sdmha.ShapeError, match="2 sparse"):
        module(case.dense_query()[0].to_sparse(), case.key, case.value)
    with pytest.raises(sdmha.ShapeError, match="attention_mask"):
        module(query, case.key, case.value, attention_mask=torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.bool"):
        module(query, case.key, case.value, attention_mask=torch.ones(2, 5, 4))
    with pytest.raises(sdmha.ShapeError, match=r"key_padding_mask has shape \(2, 5\); expected \(B, S\) = \(2, 4\)"):
        module(query, case.key, case.value, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask has dtype"):
        module(query, case.key, case.value, key_padding_mask=torch.zeros(2, 4))
    with pytest.raises(sdmha.ConfigError, match="dropout"):
        SparseQueryMultiheadAttention(2, 3, 7, 6, 5, dropout=1.5)
    with pytest.raises(TypeError, match="float16"):
        SparseQueryMultiheadAttention(2, 3, 7, 6, 5, dtype=torch.float16)
    with pytest.raises(sdmha.ConfigError, match="score_strategy"):
        SparseQueryMultiheadAttention(2, 3, 7, 6, 5, score_strategy="fast")


def test_bfloat16_query_kernel_is_the_float32_layer_on_the_rounded_kernel():
    """set_precision('bfloat16_query_kernel'): the forward equals the float32 layer whose query
    kernel is rounded to bfloat16 by torch (bit for bit), set_weight rounds the new kernel (and
    keeps the mode), and backward refuses."""
    case = Case()
    layer = layer_of(case, "float32")
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values.astype("float32"))
    key, value = numpy_of(case.key).astype("float32"), numpy_of(case.value).astype("float32")
    assert layer.precision == "float32"
    layer.set_precision("bfloat16_query_kernel")
    assert layer.precision == "bfloat16_query_kernel"
    output, _ = layer.forward(query, key, value)

    twin = layer_of(case, "float32")
    kernel = case.weights["query_kernel"].to(torch.float32)
    twin.set_weight("query_kernel", kernel.to(torch.bfloat16).to(torch.float32).numpy())
    expected, _ = twin.forward(query, key, value)
    assert np.array_equal(output, expected)

    doubled = (2 * kernel).numpy()
    layer.set_weight("query_kernel", doubled)
    twin.set_weight("query_kernel", torch.from_numpy(doubled).to(torch.bfloat16).to(torch.float32).numpy())
    assert np.array_equal(layer.forward(query, key, value)[0], twin.forward(query, key, value)[0])
    assert layer.precision == "bfloat16_query_kernel"

    with pytest.raises(sdmha.ConfigError, match="expected float32 for the backward"):
        layer.backward(query, key, value, numpy_of(case.d_output).astype("float32"))
    with pytest.raises(sdmha.ConfigError,
                       match="expected 'float32', 'bfloat16' or 'bfloat16_query_kernel'"):
        layer.set_precision("half")
    with pytest.raises(sdmha.ConfigError,
                       match="precision is bfloat16_query_kernel for a double layer.*need Scalar = float"):
        layer_of(case, "float64").set_precision("bfloat16_query_kernel")
    layer.set_precision("float32")
    assert layer.precision == "float32"


def test_bfloat16_precision_rounds_every_kernel():
    """set_precision('bfloat16'): every kernel in bfloat16 — the output moves (rounding happens)
    but stays within bfloat16's tolerance of the float32 layer; set_weight of a kernel rounds the
    new one (bitwise a twin rounded afresh); backward and bad names refuse."""
    case = Case()
    layer = layer_of(case, "float32")
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values.astype("float32"))
    key, value = numpy_of(case.key).astype("float32"), numpy_of(case.value).astype("float32")
    expected, _ = layer.forward(query, key, value)
    layer.set_precision("bfloat16")
    assert layer.precision == "bfloat16"
    output, _ = layer.forward(query, key, value)
    assert not np.array_equal(output, expected)
    # Each projection term within 2^-7 of itself; the small case's outputs move by well under 2^-5.
    assert np.max(np.abs(output - expected) / (1 + np.abs(expected))) < 2.0**-5

    doubled = (2 * case.weights["key_kernel"].to(torch.float32)).numpy()
    layer.set_weight("key_kernel", doubled)
    twin = layer_of(case, "float32")
    twin.set_weight("key_kernel", doubled)
    twin.set_precision("bfloat16")
    assert np.array_equal(layer.forward(query, key, value)[0], twin.forward(query, key, value)[0])

    with pytest.raises(sdmha.ConfigError, match="expected float32 for the backward"):
        layer.backward(query, key, value, numpy_of(case.d_output).astype("float32"))
    with pytest.raises(sdmha.ConfigError,
                       match="Layer.set_precision.*expected 'float32', 'bfloat16' or 'bfloat16_query_kernel'"):
        layer.set_precision("half")
    with pytest.raises(sdmha.ConfigError, match="need Scalar = float"):
        layer_of(case, "float64").set_precision("bfloat16")
    layer.set_precision("float32")
    assert layer.precision == "float32"


def test_bfloat16_gemm_engine_names_what_the_gemms_run_on(monkeypatch):
    """bfloat16_gemm_engine: 'off' outside the bfloat16 mode; in it, the engine that
    SDMHA_BFLOAT16_GEMMS forces at set_precision, or this CPU's choice (auto)."""
    case = Case()
    layer = layer_of(case, "float32")
    assert layer.bfloat16_gemm_engine == "off"
    for forced in ("on", "off", "amx-emulated"):
        monkeypatch.setenv("SDMHA_BFLOAT16_GEMMS", forced)
        layer.set_precision("bfloat16")
        assert layer.bfloat16_gemm_engine == forced
    monkeypatch.setenv("SDMHA_BFLOAT16_GEMMS", "auto")
    layer.set_precision("bfloat16")
    assert layer.bfloat16_gemm_engine in ("off", "on", "amx")
    layer.set_precision("bfloat16_query_kernel")
    assert layer.bfloat16_gemm_engine == "off"


def test_precision_and_weights_change_safely_beside_running_calls():
    """forward releases the GIL; set_precision and set_weight from another thread wait for it
    (and it for them): every output is exactly the float32 or the bfloat16 layer's, never a mix
    or a crash on a freed bfloat16 copy."""
    import threading

    case = Case()
    layer = layer_of(case, "float32")
    indptr, indices, values = csr_arrays(case)
    query = sdmha.csr_query(case.batch, case.steps, case.features, indptr, indices, values.astype("float32"))
    key, value = numpy_of(case.key).astype("float32"), numpy_of(case.value).astype("float32")
    float_output = layer.forward(query, key, value)[0].copy()
    layer.set_precision("bfloat16")
    bfloat16_output = layer.forward(query, key, value)[0].copy()
    kernel = layer.weight("key_kernel").copy()
    outputs, failures = [], []

    def run():
        try:
            for _ in range(200):
                outputs.append(layer.forward(query, key, value)[0].copy())
        except Exception as error:  # noqa: BLE001 — reported below
            failures.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    for i in range(200):
        layer.set_precision("float32" if i % 2 else "bfloat16")
        layer.set_weight("key_kernel", kernel)
    worker.join()
    assert not failures
    assert len(outputs) == 200
    assert all(np.array_equal(o, float_output) or np.array_equal(o, bfloat16_output) for o in outputs)
