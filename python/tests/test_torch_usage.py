"""sdmha.torch as PyTorch users call it: worker threads from torch.get_num_threads(), bfloat16
inference, errors for what sdmha cannot take, from_torch on an nn.MultiheadAttention instance,
state_dict round trips, and the torch.library operator behind torch.compile and torch.export
(PyTorch >= 2.4; its tests skip elsewhere, its implementation is tested everywhere)."""

import io

import pytest
import torch

import sdmha
import sdmha.torch as sdmha_torch
from sdmha import WEIGHT_NAMES
from sdmha.torch import SparseQueryMultiheadAttention
from conftest import Case, assert_close, reference

# Skipped where PyTorch has no custom_op; where it has one, a failed registration fails the tests.
NEEDS_CUSTOM_OP = pytest.mark.skipif(not sdmha_torch.CUSTOM_OP_SUPPORTED, reason=str(sdmha_torch.CUSTOM_OP_ERROR))


def _require_registered():
    assert sdmha_torch.HAS_CUSTOM_OP, sdmha_torch.CUSTOM_OP_ERROR


def _module(case, **kwargs):
    module = SparseQueryMultiheadAttention(case.heads, case.key_dim, case.features, case.key.shape[2],
                                           case.value.shape[2], value_dim=case.value_dim, output_dim=case.output_dim,
                                           use_bias=case.use_bias, dtype=case.dtype, **kwargs)
    with torch.no_grad():
        for name, weight in case.weights.items():
            if weight is not None:
                getattr(module, name).copy_(weight)
    return module


class _ThreadsSeen:
    """Records the num_threads of every call that reaches the autograd.Function."""

    def __init__(self, monkeypatch):
        self.seen = []
        original = sdmha_torch._SparseQueryAttention.apply

        def apply(binding, call, *args):
            self.seen.append(call.options["num_threads"])
            return original(binding, call, *args)

        monkeypatch.setattr(sdmha_torch._SparseQueryAttention, "apply", apply)


def test_num_threads_defaults_to_torch_get_num_threads_at_each_call(monkeypatch):
    case = Case(dtype=torch.float32)
    threads = _ThreadsSeen(monkeypatch)
    default, explicit, physical = _module(case), _module(case, num_threads=3), _module(case, num_threads=0)
    before = torch.get_num_threads()
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            for module in (default, explicit, physical):
                module(case.query(), case.key, case.value)
            sdmha_torch.sparse_query_attention(case.query(), case.key, case.value, *case.weights.values(),
                                               num_heads=case.heads)
            assert threads.seen[-4:] == [count, 3, 0, count]
    finally:
        torch.set_num_threads(before)
    assert default.num_threads is None and "num_threads" not in default.extra_repr()
    with pytest.raises(sdmha.ConfigError, match="num_threads = -1; expected None"):
        _module(case, num_threads=-1)


def _inference_case():
    case = Case(batch=2, steps=6, features=40, key_steps=9, key_width=16, value_width=12, heads=2, key_dim=8,
                dtype=torch.float32, seed=11)
    return case, _module(case).eval()


def _rounded(case):
    """The reference's weights, each kernel rounded to bfloat16 (what the library's mode reads)."""
    return {name: None if w is None else (w.to(torch.bfloat16).to(torch.float32) if name.endswith("kernel") else w)
            for name, w in case.weights.items()}


def test_bfloat16_precision_is_inference_near_the_float32_layer_on_rounded_kernels():
    case, module = _inference_case()
    assert module.bfloat16_gemm_engine == "off"
    module.precision = "bfloat16"
    # The engine this machine chose: the library's choice, or one SDMHA_BFLOAT16_GEMMS forced.
    assert module.bfloat16_gemm_engine in ("off", "on", "amx", "onednn", "amx-emulated")
    with torch.no_grad():
        output = module(case.query(), case.key, case.value)
        float32 = SparseQueryMultiheadAttention.__call__(_module(case).eval(), case.query(), case.key, case.value)
    assert output.dtype == torch.float32
    expected, _ = reference(case.dense_query().double(), case.key.double(), case.value.double(),
                            {k: None if v is None else v.double() for k, v in _rounded(case).items()}, case.heads)
    # The inputs and the intermediates are rounded too: bfloat16's 2^-8 relative, not float32's.
    scale = 1 + expected.abs()
    assert float(((output.double() - expected).abs() / scale).max()) < 3e-2
    assert not torch.equal(output, float32)  # the mode did change something
    module.precision = "float32"  # and back: the float32 layer bit for bit
    assert module.bfloat16_gemm_engine == "off"
    with torch.no_grad():
        assert torch.equal(module(case.query(), case.key, case.value), float32)


def test_module_to_bfloat16_runs_the_bfloat16_mode_with_bfloat16_outputs():
    case, module = _inference_case()
    module.to(torch.bfloat16)
    assert module.query_kernel.dtype == torch.bfloat16
    twin = _module(case).eval()  # float32 parameters holding the rounded ones, biases included
    twin.load_state_dict(module.state_dict())
    twin.precision = "bfloat16"
    with torch.no_grad():
        output, scores = module(case.query(), case.key.to(torch.bfloat16), case.value.to(torch.bfloat16),
                                return_attention_scores=True)
        # Parameters already bfloat16 and inputs that are: the same as rounding float32 ones.
        expected, expected_scores = twin(case.query(), case.key.to(torch.bfloat16).float(),
                                         case.value.to(torch.bfloat16).float(), return_attention_scores=True)
    assert output.dtype == torch.bfloat16 and scores.dtype == torch.bfloat16
    assert torch.equal(output, expected.to(torch.bfloat16))
    assert torch.equal(scores, expected_scores.to(torch.bfloat16))
    with torch.no_grad():  # an in-place change of a bfloat16 parameter is seen (a new snapshot)
        module.output_bias.add_(1.0)
        moved = module(case.query(), case.key, case.value)
    assert not torch.equal(moved, output)
    with torch.inference_mode():
        assert module(case.query(), case.key, case.value).dtype == torch.bfloat16


def test_bfloat16_training_raises_naming_what_to_do():
    case, module = _inference_case()
    module.precision = "bfloat16"
    with pytest.raises(sdmha.ConfigError, match="gradients.*torch.no_grad"):
        module(case.query(), case.key, case.value)
    module.train()
    with pytest.raises(sdmha.ConfigError, match="inference only.*module.eval"):
        with torch.no_grad():
            module(case.query(), case.key, case.value)
    with pytest.raises(sdmha.ConfigError, match="precision = 'half'"):
        _module(case, precision="half")
    with pytest.raises(sdmha.ConfigError, match="needs dtype torch.float32"):
        SparseQueryMultiheadAttention(2, 3, 7, 6, 5, dtype=torch.float64, precision="bfloat16")
    with pytest.raises(TypeError, match="module.to\\(torch.bfloat16\\)"):
        SparseQueryMultiheadAttention(2, 3, 7, 6, 5, dtype=torch.bfloat16)


def test_errors_name_the_argument_and_what_to_do():
    case = Case()
    module = case.module()
    query = case.query()
    with pytest.raises(TypeError, match=r"key has dtype torch.float32; expected torch.float64 .*\.to\(torch.float64\)"):
        module(query, case.key.float(), case.value)
    with pytest.raises(TypeError, match="value has dtype torch.bfloat16.*precision='bfloat16'"):
        module(query, case.key, case.value.to(torch.bfloat16))
    with pytest.raises(TypeError, match="key has dtype torch.int64"):
        module(query, case.key.long(), case.value)
    with pytest.raises(TypeError, match="key has layout torch.sparse_coo; expected a dense .*to_dense"):
        module(query, case.key.to_sparse(), case.value)
    with pytest.raises(TypeError, match="query has layout torch.strided.*sparse_coo_tensor"):
        module(case.dense_query(), case.key, case.value)
    # Another device, on a machine without one: PyTorch's meta device has a device and a dtype.
    on_meta = torch.empty(case.key.shape, dtype=case.key.dtype, device="meta")
    with pytest.raises(TypeError, match=r"key is on meta; sdmha runs on the CPU only: move it there with \.cpu\(\)"):
        module(query, on_meta, case.value)
    meta_module = case.module().to("meta")
    with pytest.raises(TypeError, match=r"parameter query_kernel is on meta.*module\.cpu\(\)"):
        meta_module(query, case.key, case.value)
    with pytest.raises(TypeError, match=r"key_padding_mask is on meta"):
        module(query, case.key, case.value, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("separate_projections", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_takes_an_nn_multihead_attention_instance(separate_projections, bias):
    torch.manual_seed(5)
    batch, steps, key_steps, embed, heads = 2, 5, 6, 8, 2
    kdim, vdim = (5, 7) if separate_projections else (embed, embed)
    mha = torch.nn.MultiheadAttention(embed, heads, bias=bias, batch_first=True, kdim=kdim, vdim=vdim,
                                      dtype=torch.float64, dropout=0.25)
    if bias:
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    mha.eval()
    module = SparseQueryMultiheadAttention.from_torch(mha, num_threads=1).eval()
    assert module.query_kernel.dtype == torch.float64 and module.use_bias == bias and module.dropout == 0.25
    assert SparseQueryMultiheadAttention.from_torch(mha, dtype=torch.float32, dropout=0.0).dropout == 0.0

    dense = torch.randn(batch, steps, embed, dtype=torch.float64) * (torch.rand(batch, steps, embed) < 0.4)
    key = torch.randn(batch, key_steps, kdim, dtype=torch.float64)
    value = torch.randn(batch, key_steps, vdim, dtype=torch.float64)
    padding = torch.zeros(batch, key_steps, dtype=torch.bool)
    padding[0, -2:] = True
    output = module(dense.to_sparse(), key, value, key_padding_mask=padding)
    with torch.no_grad():
        expected, _ = mha(dense, key, value, key_padding_mask=padding)
    assert_close(output, expected, torch.float64, "output")


def test_from_torch_refuses_what_keras_has_no_equivalent_of():
    with pytest.raises(sdmha.ConfigError, match="add_bias_kv or add_zero_attn"):
        SparseQueryMultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="float16.*expected torch.float32 or torch.float64"):
        SparseQueryMultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, dtype=torch.float16))


@pytest.mark.parametrize("use_bias", [True, False])
def test_state_dict_round_trips_with_the_keras_names(use_bias):
    case = Case(use_bias=use_bias)
    module = case.module()
    state = module.state_dict()
    assert list(state) == [name for name in WEIGHT_NAMES if case.weights[name] is not None]
    for name, tensor in state.items():
        assert torch.equal(tensor, case.weights[name])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = Case(use_bias=use_bias, seed=99).module()
    fresh.load_state_dict(torch.load(buffer))
    for name in state:  # loaded in place: still the C++ layer's memory, no rebinding needed
        assert fresh._binding.shares(name, getattr(fresh, name))
    assert torch.equal(fresh(case.query(), case.key, case.value), module(case.query(), case.key, case.value))
    halves = module.to(torch.bfloat16).state_dict()  # a bfloat16 module's state loads into float32
    fresh.load_state_dict(halves)
    assert torch.equal(fresh.query_kernel, halves["query_kernel"].double())


# ---- the torch.library operator ---------------------------------------------------------------------


def _operator_arguments(case, module, return_scores=False, bias=None, attention_mask=None):
    from sdmha import _torch_ops

    coalesced = case.query().coalesce()
    batch, steps, features, indptr, columns, values = sdmha_torch._csr_parts(coalesced, case.batch, case.dtype)
    options = sdmha_torch._options(None, None, True, return_scores, 1, "automatic", 0.0, False)
    weights = tuple(module._weights())
    return (indptr, columns, values, case.key, case.value, bias, weights, attention_mask, None,
            [batch, steps, features, case.heads], _torch_ops.options_text(options))


@pytest.mark.parametrize("return_scores", [False, True])
def test_operator_implementation_equals_the_autograd_function(return_scores):
    """The functions behind torch.ops.sdmha.attention(_backward), called directly: what the
    module's eager path gives, and the fake implementations' shapes and dtypes."""
    from sdmha import _torch_ops

    case = Case(use_bias=True)
    module = case.module()
    bias = torch.randn(case.batch, 1, case.steps, case.key_steps, dtype=case.dtype)
    mask = case.random_mask()
    args = _operator_arguments(case, module, return_scores, bias, mask)
    output, scores = _torch_ops.forward(*args)
    values = case.values.clone().requires_grad_(True)
    key, value = case.key.clone().requires_grad_(True), case.value.clone().requires_grad_(True)
    eager_bias = bias.clone().requires_grad_(True)
    eager = module(case.query(values), key, value, attention_mask=mask, attention_bias=eager_bias,
                   use_causal_mask=True, return_attention_scores=return_scores)
    eager_output = eager[0] if return_scores else eager
    assert torch.equal(output, eager_output)
    if return_scores:
        assert torch.equal(scores, eager[1])
    else:
        assert scores.numel() == 0
    (eager_output * case.d_output).sum().backward()
    grads = _torch_ops.backward(*args, case.d_output, True)
    coalesced = case.query(values).coalesce()  # the operator sees the coalesced values
    expected = [None, key.grad, value.grad, eager_bias.grad, *(getattr(module, n).grad for n in WEIGHT_NAMES)]
    for name, got, want in zip(("query_values", "key", "value", "attention_bias", *WEIGHT_NAMES), grads, expected):
        if name == "query_values":
            assert got.shape == coalesced.values().shape
            continue
        assert torch.allclose(got, want, rtol=0, atol=1e-12), name
    fake_output, fake_scores = _torch_ops.fake_forward(*args)
    assert fake_output.shape == output.shape and fake_output.dtype == output.dtype
    assert fake_scores.shape == scores.shape
    fakes = _torch_ops.fake_backward(*args, case.d_output, True)
    assert [tuple(f.shape) for f in fakes] == [tuple(g.shape) for g in grads]


class _RecordedOp:
    """What torch.library.custom_op returns, reduced to what register() uses: calls go to the
    function, register_fake and register_autograd record theirs."""

    def __init__(self, function):
        self.function, self.fake, self.backward, self.setup_context = function, None, None, None

    def __call__(self, *args):
        return self.function(*args)

    def register_fake(self, function):
        self.fake = function
        return function

    def register_autograd(self, backward, setup_context=None):
        self.backward, self.setup_context = backward, setup_context


class _Context:
    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def test_registration_wires_forward_fake_and_autograd(monkeypatch):
    """register() against a stand-in for torch.library.custom_op (every PyTorch version): the
    operator, its fake and its autograd formula (setup_context + backward, as PyTorch calls
    them) give the module's eager output and gradients, None where no gradient is asked."""
    from sdmha import _torch_ops

    recorded = {}

    def custom_op(name, mutates_args):
        assert mutates_args == ()

        def wrap(function):
            recorded[name] = _RecordedOp(function)
            return recorded[name]
        return wrap

    monkeypatch.setattr(torch.library, "custom_op", custom_op, raising=False)
    attention, attention_backward = _torch_ops.register()
    assert set(recorded) == {"sdmha::attention", "sdmha::attention_backward"}
    case = Case(use_bias=True)
    module = case.module()
    bias = torch.randn(case.batch, 1, case.steps, case.key_steps, dtype=case.dtype)
    packed = _operator_arguments(case, module, False, bias, case.random_mask())
    args = (*packed[:6], *packed[6], *packed[7:])  # the operator's 18 arguments, weights spread
    output, scores = attention(*args)
    fake_output, fake_scores = attention.fake(*args)
    assert fake_output.shape == output.shape and fake_scores.shape == scores.shape == (0,)

    key = case.key.clone().requires_grad_(True)
    eager_bias = bias.clone().requires_grad_(True)
    eager = module(case.query(), key, case.value, attention_mask=case.random_mask(), attention_bias=eager_bias,
                   use_causal_mask=True)
    assert torch.equal(output, eager)
    (eager * case.d_output).sum().backward()
    needs = [False] * 18
    needs[3] = needs[5] = needs[6] = True  # key, attention_bias, query_kernel
    ctx = _Context(tuple(needs))
    attention.setup_context(ctx, args, (output, scores))
    grads = attention.backward(ctx, case.d_output, None)
    assert len(grads) == 18
    assert [i for i, g in enumerate(grads) if g is not None] == [3, 5, 6]
    assert torch.allclose(grads[3], key.grad, rtol=0, atol=1e-12)
    assert torch.allclose(grads[5], eager_bias.grad, rtol=0, atol=1e-12)
    assert torch.allclose(grads[6], module.query_kernel.grad, rtol=0, atol=1e-12)
    fakes = attention_backward.fake(*args, case.d_output, True)
    assert [tuple(f.shape) for f in fakes] == [tuple(g.shape) for g in attention_backward(*args, case.d_output, True)]


@NEEDS_CUSTOM_OP
def test_torch_compile_runs_the_module_with_the_same_outputs_and_gradients():
    _require_registered()
    case = Case(dtype=torch.float32)
    module, twin = case.module(), case.module()
    compiled = torch.compile(module)
    outputs = []
    for model in (compiled, twin):
        values = case.values.clone().requires_grad_(True)
        key = case.key.clone().requires_grad_(True)
        output = model(case.query(values), key, case.value, use_causal_mask=True)
        (output * case.d_output).sum().backward()
        outputs.append((output.detach(), values.grad, key.grad, model.query_kernel.grad))
    for got, want in zip(*outputs):
        assert_close(got, want, torch.float32)


class _CsrModel(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, crow_indices, col_indices, values, key, value):
        return self.attention((crow_indices, col_indices, values), key, value)


@NEEDS_CUSTOM_OP
def test_torch_export_traces_the_operator():
    _require_registered()
    case = Case(dtype=torch.float32)
    module = case.module().eval()
    csr = case.query().coalesce().to_dense().reshape(case.batch * case.steps, case.features).to_sparse_csr()
    inputs = (csr.crow_indices(), csr.col_indices(), csr.values(), case.key, case.value)
    model = _CsrModel(module)
    # Non-strict: the module's Python (NumPy-free on this path, but json for the options) runs
    # as it is, on fake tensors, rather than under TorchDynamo.
    exported = torch.export.export(model, inputs, strict=False)
    assert "sdmha.attention" in str(exported.graph)
    assert_close(exported.module()(*inputs), model(*inputs), torch.float32)
