"""sdmha.torch.SparseQueryMultiheadAttention: forward and every gradient against a float64 torch
reference of Keras' math on the densified query; gradcheck; masks; dropout; the shared weights."""

import copy
import io
import math
import pickle

import pytest
import torch

import sdmha
from conftest import Case, assert_close, reference
from sdmha.torch import SparseQueryMultiheadAttention, sparse_query_attention

CASES = {
    "cross": dict(),
    "value_dim_output_dim": dict(value_dim=4, output_dim=3, heads=3),
    "no_bias": dict(use_bias=False),
    "empty_rows": dict(nonzeros=3, duplicates=1, steps=6),
    "single_head": dict(heads=1, key_dim=5),
}
MASKS = ["none", "mask", "causal", "mask_and_causal", "padding"]


def run_both(case, mask_kind, return_scores=True):
    """sdmha (module) and the reference on the same inputs; returns both and their gradients."""
    attention_mask = case.random_mask() if mask_kind in ("mask", "mask_and_causal") else None
    causal = mask_kind in ("causal", "mask_and_causal")
    padding = None
    if mask_kind == "padding":
        padding = torch.zeros(case.batch, case.key_steps, dtype=torch.bool)
        padding[0, -1] = True
        padding[1, 0] = True
    module = case.module()
    values = case.values.clone().requires_grad_()
    key = case.key.clone().requires_grad_()
    value = case.value.clone().requires_grad_()
    result = module(case.query(values), key, value, attention_mask=attention_mask, use_causal_mask=causal,
                    return_attention_scores=return_scores, key_padding_mask=padding)
    output, scores = result if return_scores else (result, None)
    (output * case.d_output).sum().backward()
    got = {name: getattr(module, name).grad for name in sdmha.WEIGHT_NAMES if getattr(module, name) is not None}
    got.update(query_values=values.grad, key=key.grad, value=value.grad)

    ref_values = case.values.to(torch.float64).clone().requires_grad_()
    ref_key = case.key.to(torch.float64).clone().requires_grad_()
    ref_value = case.value.to(torch.float64).clone().requires_grad_()
    ref_weights = {n: (None if w is None else w.to(torch.float64).clone().requires_grad_())
                   for n, w in case.weights.items()}
    ref_output, ref_scores = reference(case.dense_query(ref_values), ref_key, ref_value, ref_weights, case.heads,
                                       attention_mask, causal, padding)
    (ref_output * case.d_output.to(torch.float64)).sum().backward()
    expected = {n: w.grad for n, w in ref_weights.items() if w is not None}
    expected.update(query_values=ref_values.grad, key=ref_key.grad, value=ref_value.grad)
    return (output, scores, got), (ref_output, ref_scores, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("case_name", list(CASES))
def test_forward_and_every_gradient_match_the_reference(case_name, mask_kind, dtype):
    case = Case(dtype=dtype, **CASES[case_name])
    (output, scores, got), (ref_output, ref_scores, expected) = run_both(case, mask_kind)
    assert output.dtype == dtype and output.shape == (case.batch, case.steps, case.output_dim)
    assert_close(output, ref_output, dtype, "output")
    assert_close(scores, ref_scores, dtype, "attention scores")
    assert set(got) == set(expected)
    for name in expected:
        assert got[name] is not None, name
        assert got[name].dtype == dtype, name
        assert_close(got[name], expected[name], dtype, name)


def test_duplicate_coordinates_each_get_their_coordinates_gradient():
    case = Case(duplicates=3)
    (_, _, got), (_, _, expected) = run_both(case, "none", return_scores=False)
    nnz = case.values.numel()
    assert_close(got["query_values"][nnz - 3:], got["query_values"][:3], torch.float64, "duplicates")
    assert_close(got["query_values"], expected["query_values"], torch.float64, "query values")


def test_gradcheck_float64():
    case = Case(batch=2, steps=3, features=4, key_steps=3, key_width=3, value_width=2, heads=2, key_dim=2,
                value_dim=1, output_dim=2, nonzeros=7, duplicates=1)
    mask = case.random_mask(fully_blocked_row=False)
    names = list(case.weights)

    def function(values, key, value, *weights):
        return sparse_query_attention(case.query(values), key, value, *weights, num_heads=case.heads,
                                      attention_mask=mask, num_threads=1)

    inputs = [case.values, case.key, case.value] + [case.weights[n] for n in names]
    inputs = [t.clone().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradcheck_with_dropout_and_causal_mask():
    case = Case(batch=1, steps=3, features=3, key_steps=3, key_width=2, value_width=2, heads=1, key_dim=2,
                nonzeros=5, duplicates=0)

    def function(values, key, value, query_kernel, output_kernel):
        weights = dict(case.weights, query_kernel=query_kernel, output_kernel=output_kernel)
        return sparse_query_attention(case.query(values), key, value, *weights.values(), num_heads=1,
                                      use_causal_mask=True, dropout=0.5, training=True, dropout_seed=7,
                                      num_threads=1)

    inputs = [t.clone().requires_grad_() for t in (case.values, case.key, case.value,
                                                   case.weights["query_kernel"], case.weights["output_kernel"])]
    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradcheck_through_the_module_parameters():
    case = Case(batch=1, steps=2, features=3, key_steps=2, key_width=2, value_width=2, heads=1, key_dim=2,
                nonzeros=3, duplicates=0)
    module = case.module()
    query = case.query()

    def function(*parameters):
        # gradcheck perturbs the module's own parameters in place: the C++ weights are that memory.
        return module(query, case.key, case.value)

    assert torch.autograd.gradcheck(function, list(module.parameters()), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_self_attention_value_defaults_to_key_and_gets_both_gradients():
    case = Case(key_width=5, value_width=5)
    module = case.module()
    key = case.key.clone().requires_grad_()
    (module(case.query(), key) * case.d_output).sum().backward()
    ref_key = case.key.clone().requires_grad_()
    ref_output, _ = reference(case.dense_query(), ref_key, ref_key, case.weights, case.heads)
    (ref_output * case.d_output).sum().backward()
    assert_close(key.grad, ref_key.grad, torch.float64, "key (= value) gradient")


def test_inputs_without_grad_get_none_and_the_weights_the_same_gradients():
    # The module asks the C++ backward only for the input gradients autograd wants; the weights'
    # gradients do not depend on which.
    case = Case()
    module = case.module()
    (module(case.query(), case.key.clone().requires_grad_(), case.value.clone().requires_grad_())
     * case.d_output).sum().backward()
    expected = {name: p.grad.clone() for name, p in module.named_parameters()}
    for key_grad, value_grad in ((False, False), (True, False), (False, True)):
        module.zero_grad(set_to_none=True)
        key = case.key.clone().requires_grad_(key_grad)
        value = case.value.clone().requires_grad_(value_grad)
        (module(case.query(), key, value) * case.d_output).sum().backward()
        assert (key.grad is not None) == key_grad and (value.grad is not None) == value_grad
        for name, p in module.named_parameters():
            assert torch.equal(p.grad, expected[name]), name


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_sparse_csr_query_equals_coo():
    case = Case()
    module = case.module()
    coo = case.query().coalesce()
    csr = coo.to_dense().view(case.batch * case.steps, case.features).to_sparse_csr()
    assert_close(module(csr, case.key, case.value), module(coo, case.key, case.value), torch.float64, "csr")


def test_keras_initialisation_limits():
    torch.manual_seed(0)
    heads, key_dim, value_dim, eq, ek, ev, out = 4, 8, 6, 40, 24, 20, 12
    module = SparseQueryMultiheadAttention(heads, key_dim, eq, ek, ev, value_dim=value_dim, output_dim=out)
    limits = {
        "query_kernel": math.sqrt(6 / (eq * heads + eq * key_dim)),
        "key_kernel": math.sqrt(6 / (ek * heads + ek * key_dim)),
        "value_kernel": math.sqrt(6 / (ev * heads + ev * value_dim)),
        "output_kernel": math.sqrt(6 / (heads * value_dim + heads * out)),
    }
    for name, limit in limits.items():
        kernel = getattr(module, name).detach()
        assert kernel.abs().max() <= limit
        assert kernel.abs().max() > 0.9 * limit  # uniform over the whole range
        assert abs(float(kernel.std()) - limit / math.sqrt(3)) < 0.15 * limit
    for name in sdmha.WEIGHT_NAMES[1::2]:
        assert torch.count_nonzero(getattr(module, name)) == 0
    assert module.query_kernel.shape == (eq, heads * key_dim)
    assert module.value_kernel.shape == (ev, heads * value_dim)
    assert module.output_kernel.shape == (heads * value_dim, out)
    # the same limits as the C++ MhaWeights::glorot_uniform: its draws stay inside them too
    layer = sdmha.Layer(heads, key_dim, eq, ek, ev, value_dim=value_dim, output_dim=out, seed=3)
    for name, limit in limits.items():
        assert abs(layer.weight(name)).max() <= limit


def test_dropout_train_versus_eval():
    # H = 1, value one-hot per key step, identity value and output kernels, no bias: the output
    # is the dropped probabilities themselves, so the dropout mask can be read off it.
    steps, key_steps, rate = 16, 32, 0.25
    case = Case(batch=2, steps=steps, features=6, key_steps=key_steps, key_width=3, value_width=key_steps, heads=1,
                key_dim=4, value_dim=key_steps, output_dim=key_steps, use_bias=False, nonzeros=60)
    case.weights["value_kernel"] = torch.eye(key_steps, dtype=torch.float64)
    case.weights["output_kernel"] = torch.eye(key_steps, dtype=torch.float64)
    value = torch.eye(key_steps, dtype=torch.float64).expand(case.batch, key_steps, key_steps).contiguous()
    module = case.module(dropout=rate)
    query = case.query()

    module.eval()
    eval_output, probabilities = module(query, case.key, value, return_attention_scores=True)
    assert_close(eval_output, probabilities[:, 0], torch.float64, "eval: no dropout")

    module.train()
    torch.manual_seed(5)
    train_output, train_scores = module(query, case.key, value, return_attention_scores=True)
    torch.manual_seed(5)
    again = module(query, case.key, value)
    assert torch.equal(train_output, again), "the same torch seed gives the same dropout mask"
    assert_close(train_scores, probabilities, torch.float64, "scores are taken before dropout")
    kept = train_output != 0
    assert_close(train_output[kept], (probabilities[:, 0] / (1 - rate))[kept], torch.float64, "kept / (1 - rate)")
    dropped_fraction = 1 - float(kept.double().mean())
    assert abs(dropped_fraction - rate) < 0.06, dropped_fraction
    third = module(query, case.key, value)
    assert not torch.equal(third, train_output), "a fresh seed per call"

    # The backward drops the same entries as the forward.
    values = case.values.clone().requires_grad_()
    key = case.key.clone().requires_grad_()
    torch.manual_seed(9)
    output = module(case.query(values), key, value)
    multiplier = (output != 0).double()[:, None] / (1 - rate)
    (output * case.d_output[..., :key_steps]).sum().backward()
    ref_values = case.values.clone().requires_grad_()
    ref_key = case.key.clone().requires_grad_()
    ref_output, _ = reference(case.dense_query(ref_values), ref_key, value, case.weights, 1,
                              dropout_multiplier=multiplier)
    (ref_output * case.d_output[..., :key_steps]).sum().backward()
    assert_close(output, ref_output, torch.float64, "train output")
    assert_close(values.grad, ref_values.grad, torch.float64, "train query values gradient")
    assert_close(key.grad, ref_key.grad, torch.float64, "train key gradient")


def test_workspace_is_kept_across_calls_and_shapes():
    module = Case().module()
    workspace = module._binding.workspace
    results = []
    for batch, steps in [(2, 5), (3, 8), (1, 2), (3, 8)]:
        case = Case(batch=batch, steps=steps, seed=batch * 10 + steps)
        with torch.no_grad():
            for name, weight in Case().weights.items():
                getattr(module, name).copy_(weight)
        values = case.values.clone().requires_grad_()
        output = module(case.query(values), case.key, case.value)
        output.sum().backward()
        expected, _ = reference(case.dense_query(), case.key, case.value, Case().weights, case.heads)
        assert_close(output, expected, torch.float64, f"B={batch} T={steps}")
        results.append(workspace.bytes)
        assert module._binding.workspace is workspace
    assert results[0] > 0
    assert results[3] == results[1], "the same shapes again: no growth"


def test_weights_are_shared_with_cpp_and_rebound_after_replacement():
    case = Case()
    module = case.module()
    binding = module._binding
    assert module.query_kernel.data_ptr() == binding.pointers["query_kernel"]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(case.query(), case.key, case.value).sum().backward()
    optimizer.step()  # in place, into the C++ weights
    assert module.query_kernel.data_ptr() == binding.pointers["query_kernel"]
    expected, _ = reference(case.dense_query(), case.key, case.value,
                            {n: (None if p is None else p.detach().clone()) for n, p in
                             zip(sdmha.WEIGHT_NAMES, module._weights())}, case.heads)
    assert_close(module(case.query(), case.key, case.value), expected, torch.float64, "after an SGD step")

    # param.data replaced: copied in once, and the parameter is the C++ memory again.
    replacement = torch.randn_like(module.key_kernel)
    module.key_kernel.data = replacement.clone()
    weights = {n: (None if p is None else p.detach().clone()) for n, p in zip(sdmha.WEIGHT_NAMES, module._weights())}
    expected, _ = reference(case.dense_query(), case.key, case.value, weights, case.heads)
    assert_close(module(case.query(), case.key, case.value), expected, torch.float64, "after param.data = ...")
    assert module.key_kernel.data_ptr() == module._binding.pointers["key_kernel"]

    # load_state_dict copies in place; deepcopy and pickling make a module that rebinds.
    state = {k: v.clone() for k, v in module.state_dict().items()}
    other = case.module()
    other.load_state_dict(state)
    assert other.query_kernel.data_ptr() == other._binding.pointers["query_kernel"]
    assert_close(other(case.query(), case.key, case.value), expected, torch.float64, "load_state_dict")
    clone = copy.deepcopy(module)
    assert_close(clone(case.query(), case.key, case.value), expected, torch.float64, "deepcopy")
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert_close(loaded(case.query(), case.key, case.value), expected, torch.float64, "torch.save / torch.load")
    assert pickle.loads(pickle.dumps(module)) is not None


def test_module_to_float32_rebinds_in_the_new_dtype():
    case = Case()
    module = case.module()
    expected = module(case.query(), case.key, case.value).detach()
    module.float()
    query = torch.sparse_coo_tensor(case.indices, case.values.float(), case.query().shape)
    output = module(query, case.key.float(), case.value.float())
    assert output.dtype == torch.float32
    assert module._binding.dtype == torch.float32
    assert_close(output, expected, torch.float32, "float32 after .float()")


def test_weight_changed_between_forward_and_backward_is_detected():
    case = Case()
    module = case.module()
    output = module(case.query(), case.key, case.value)
    with torch.no_grad():
        module.query_kernel.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        output.sum().backward()


def test_no_grad_inference_and_training_loop_decreases_loss():
    case = Case(dtype=torch.float32)
    module = case.module()
    with torch.no_grad():
        output = module(case.query(), case.key, case.value)
    assert output.grad_fn is None
    optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
    target = torch.zeros_like(output)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(case.query(), case.key, case.value), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]
