"""PyTorch front end of sdmha: ``SparseQueryMultiheadAttention``, an ``nn.Module`` that trains.

The layer is Keras' MultiHeadAttention on a sparse query (a torch sparse COO tensor (B, T, Eq),
or a sparse CSR tensor (B*T, Eq)) and dense key (B, S, Ek) and value (B, S, Ev); forward and
backward run in sdmha's C++ (``sdmha._sdmha``) through one ``torch.autograd.Function``, with the
GIL released. Gradients reach the eight parameters, key, value and the query's stored values:
a query built as ``torch.sparse_coo_tensor(indices, values, size)`` from ``values`` that require
grad gets ``values.grad`` (duplicates each get their coordinate's gradient). Only the stored
positions of the query have a gradient: its sparsity pattern is not differentiable.

How the weights reach C++ (the choice, and why). The C++ layer holds its weights as a
``std::shared_ptr<sdmha::MhaWeights>``, Eigen matrices it owns; they cannot map torch's memory.
Rather than copying every parameter into them before each call (64 MB for the 32768-feature
query kernel of the ``bow`` workload, every training step, since every step changes every
weight), the module goes the other way: its ``nn.Parameter`` s *are* views of the C++ weights'
memory (``torch.from_numpy`` over ``Layer.weight(name)``). An optimizer's in-place update, a
``load_state_dict`` (in-place ``copy_``) or DDP's initial broadcast (in place) write straight
into the weights the next call reads: no copy, and nothing to compare. When a parameter no
longer shares that memory (``param.data = ...``, ``module.double()``, ``copy.deepcopy``,
unpickling), the next forward copies it in once and points the parameter back at the C++ memory
(a new C++ layer first when the dtype or a shape changed). The ``autograd.Function`` itself
compares data pointers only: a weight tensor that is not the layer's memory (the functional
form, gradcheck) is copied in before the call and again before its backward.
"""

import math
import os
import re
import warnings
import weakref

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import WEIGHT_NAMES, ShapeError, _sdmha, dtype_name, load_keras_layer

__all__ = ["SparseQueryMultiheadAttention", "sparse_query_attention", "HAS_CUSTOM_OP", "CUSTOM_OP_ERROR"]

_INT32_MAX = 2**31 - 1
_SCORE_STRATEGIES = ("automatic", "project_first", "sparse_regrouped")
_PRECISIONS = ("float32", "bfloat16")
_BFLOAT16_HINT = ("; for bfloat16 inference build the module in float32 and call module.to(torch.bfloat16), "
                  "or pass precision='bfloat16'")


def _torch_version():
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


#: Whether this PyTorch has torch.library.custom_op (>= 2.4), through which sdmha/_torch_ops.py
#: registers the op for torch.compile and torch.export; eager calls take the autograd.Function.
CUSTOM_OP_SUPPORTED = _torch_version() >= (2, 4) and hasattr(torch.library, "custom_op")
#: Whether that registration happened (see CUSTOM_OP_ERROR when it failed).
HAS_CUSTOM_OP = False
#: Why the op is not registered: None when it is.
CUSTOM_OP_ERROR = None if CUSTOM_OP_SUPPORTED else f"torch.library.custom_op needs PyTorch >= 2.4; this is {torch.__version__}"


def _check_dtype(dtype):
    if dtype not in (torch.float32, torch.float64):
        hint = _BFLOAT16_HINT if dtype == torch.bfloat16 else ""
        raise TypeError(f"sdmha: dtype {dtype} is not supported; expected torch.float32 or torch.float64{hint}")
    return dtype


def _check_cpu(name, tensor):
    if tensor.device.type != "cpu":
        raise TypeError(f"sdmha: {name} is on {tensor.device}; sdmha runs on the CPU only: move it there with "
                        ".cpu() (and keep the module on the CPU: module.cpu())")


def _check_tensor_dtype(name, tensor, dtype):
    if tensor.dtype != dtype:
        hint = _BFLOAT16_HINT if tensor.dtype in (torch.bfloat16, torch.float16) else ""
        raise TypeError(f"sdmha: {name} has dtype {tensor.dtype}; expected {dtype} (the module's): convert it "
                        f"with .to({dtype}){hint}")


def _worker_count(num_threads):
    """sdmha's worker count for a call: num_threads when given (0: sdmha's own choice, the physical
    cores), else torch.get_num_threads() as it is at the call (torchrun sets it per process)."""
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def _check_num_threads(num_threads):
    if num_threads is not None and int(num_threads) < 0:
        raise _sdmha.ConfigError(f"sdmha: num_threads = {num_threads}; expected None (torch.get_num_threads()), "
                                 "0 (the physical cores) or a positive count")


class _Binding:
    """A C++ layer (sdmha::SparseDenseMHA over shared MhaWeights) and its Workspace.

    ``tensors[name]`` are torch views of the C++ weights' memory. The workspace serves one call
    at a time: calling one module from several threads at once raises ConfigError.
    """

    def __init__(self, dtype, num_heads, key_dim, query_dim, key_in_dim, value_in_dim, value_dim,
                 output_dim, use_bias):
        name = dtype_name(dtype)
        self.dtype = dtype
        self.layer = getattr(_sdmha, f"Layer_{name}")(num_heads, key_dim, query_dim, key_in_dim,
                                                      value_in_dim, value_dim, output_dim, use_bias)
        self.workspace = getattr(_sdmha, f"Workspace_{name}")()
        self.query_class = getattr(_sdmha, f"SparseQuery_{name}")
        self.key = (dtype, num_heads, key_dim, query_dim, key_in_dim, value_in_dim, value_dim,
                    output_dim, use_bias)
        self.tensors = {}
        self.pointers = {}
        self.stamp = None  # the parameters a bfloat16 snapshot was taken of (_bound_bfloat16)
        for weight in WEIGHT_NAMES:
            array = self.layer.weight(weight)
            if array is not None:
                self.tensors[weight] = torch.from_numpy(array)
                self.pointers[weight] = array.__array_interface__["data"][0]
        _BINDINGS[self.pointers["query_kernel"]] = self

    def shares(self, name, tensor):
        """Whether `tensor` is exactly this layer's weight `name` (same memory, shape, layout)."""
        mine = self.tensors[name]
        return (tensor.data_ptr() == self.pointers[name] and tensor.dtype == self.dtype
                and tensor.shape == mine.shape and tensor.stride() == mine.stride())

    def load(self, weights):
        """Copies into the C++ weights each tensor of {name: tensor} that is not already them."""
        for name, tensor in weights.items():
            if tensor is None:
                continue
            if not self.shares(name, tensor):
                self.layer.set_weight(name, _array(name, tensor, self.dtype))


#: Every live binding by the address of its query kernel: how sdmha/_torch_ops.py finds the C++
#: layer whose memory a module's parameters are.
_BINDINGS = weakref.WeakValueDictionary()


def _array(name, tensor, dtype):
    """A CPU tensor as a NumPy array over the same memory (a copy only if not contiguous)."""
    _check_cpu(name, tensor)
    _check_tensor_dtype(name, tensor, dtype)
    return tensor.detach().contiguous().numpy()


class _Call:
    """What one call passes from forward to backward, besides tensors."""

    __slots__ = ("batch", "steps", "features", "options", "value_is_key", "save_context",
                 "num_threads")

    def __init__(self, batch, steps, features, options, value_is_key, save_context, num_threads):
        self.batch, self.steps, self.features = batch, steps, features
        self.options = options
        self.value_is_key = value_is_key
        self.save_context = save_context
        self.num_threads = num_threads


def _prepare(binding, call, indptr, columns, query_values, key, value, bias):
    """(query, key array, value array, options) for binding.layer's forward and backward: NumPy
    views of the tensors (no copy when contiguous), the query a CSR view of its arrays."""
    dtype = binding.dtype
    query = binding.query_class.from_csr(call.batch, call.steps, call.features, indptr.numpy(), columns.numpy(),
                                         _array("query values", query_values, dtype))
    key_array = _array("key", key, dtype)
    value_array = key_array if call.value_is_key else _array("value", value, dtype)
    options = call.options
    if bias is not None:
        # The binding views this array (no copy) in forward and backward; the caller keeps it alive.
        options = dict(options, attention_bias=_array("attention_bias", bias, dtype))
    return query, key_array, value_array, options


class _SparseQueryAttention(torch.autograd.Function):
    """sdmha's forward and backward as one autograd node.

    Inputs: (binding, call, indptr, columns, query_values, key, value, attention_bias (or None),
    *eight weights (None for absent biases)). Outputs: output (B, T, O) and, when asked, the
    attention scores (B, H, T, S), which are not differentiable.
    """

    @staticmethod
    def forward(ctx, binding, call, indptr, columns, query_values, key, value, bias, *weights):
        weights = dict(zip(WEIGHT_NAMES, weights))
        binding.load(weights)
        query, key_array, value_array, options = _prepare(binding, call, indptr, columns, query_values, key,
                                                          value, bias)
        context = None
        if call.save_context:
            # K and V projected once, for the forward and again for the backward.
            context = binding.layer.project_context(key_array, value_array, call.num_threads,
                                                    workspace=binding.workspace)
        output, scores = binding.layer.forward(query, key_array, value_array, workspace=binding.workspace,
                                               context=context, **options)
        ctx.binding, ctx.call, ctx.query, ctx.context = binding, call, query, context
        ctx.options = options
        ctx.arrays = (key_array, value_array)
        # Saved for autograd's version check: a weight or input changed in place between
        # forward and backward raises instead of giving a gradient of something else.
        ctx.save_for_backward(query_values, key, value, bias, *weights.values())
        output = torch.from_numpy(output)
        if scores is None:
            return output
        scores = torch.from_numpy(scores)
        ctx.mark_non_differentiable(scores)
        return output, scores

    @staticmethod
    @once_differentiable  # the C++ backward is not itself differentiable: double backward raises
    def backward(ctx, d_output, *unused):
        saved = ctx.saved_tensors
        binding, call = ctx.binding, ctx.call
        binding.load(dict(zip(WEIGHT_NAMES, saved[4:])))  # no copy for a module's own parameters
        d_output = _array("d_output", d_output, binding.dtype)
        key_array, value_array = ctx.arrays
        needs = ctx.needs_input_grad
        options = ctx.options
        if "attention_bias" in options:
            options = dict(options, compute_bias_gradient=bool(needs[7]))
        # Only the gradients autograd asks for: ∂key and ∂value cost as much as K and V did. (With
        # value = key both are asked for and autograd adds them.)
        wanted = tuple(name for name, index in (("query_values", 4), ("key", 5), ("value", 6)) if needs[index])
        options = dict(options, input_gradients=wanted)
        grads = binding.layer.backward(ctx.query, key_array, value_array, d_output,
                                       workspace=binding.workspace, context=ctx.context, **options)

        def tensor(name, index):
            array = grads.get(name)
            return torch.from_numpy(array) if needs[index] and array is not None else None

        return (None, None, None, None, tensor("query_values", 4), tensor("key", 5), tensor("value", 6),
                tensor("attention_bias", 7), *(tensor(name, 8 + i) for i, name in enumerate(WEIGHT_NAMES)))


# ---- inputs ---------------------------------------------------------------------------------------


def _csr_parts(query, batch_hint, dtype, features_hint=None):
    """(B, T, Eq, indptr int32, columns int32, values) of a sparse COO (B, T, Eq) or CSR (B*T, Eq)
    query, or of a tuple (crow_indices, col_indices, values) of B*T CSR rows of Eq = features_hint
    (dense tensors: what torch.export takes); `values` stays connected to the query's autograd
    graph (COO: through coalesce)."""
    if isinstance(query, (tuple, list)) and features_hint is not None:
        return _csr_tuple(query, batch_hint, dtype, features_hint)
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"sdmha: query is a {type(query).__name__}; expected a torch sparse tensor")
    _check_cpu("query", query)
    _check_tensor_dtype("query", query, dtype)
    if query.layout == torch.sparse_coo:
        if query.dim() != 3 or query.sparse_dim() != 3:
            raise ShapeError(
                f"sdmha: query has {query.sparse_dim()} sparse and {query.dense_dim()} dense dimensions; "
                "expected a sparse COO tensor (B, T, Eq) with 3 sparse dimensions")
        batch, steps, features = query.shape
        coalesced = query.coalesce()  # differentiable: values.grad maps back through it
        indices, values = coalesced.indices(), coalesced.values()
        _check_int32(batch * steps, features, values.numel())
        rows = indices[0] * steps + indices[1]
        indptr = torch.zeros(batch * steps + 1, dtype=torch.int32)
        if rows.numel():
            indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=batch * steps), 0)
        columns = indices[2].to(torch.int32)
        return batch, steps, features, indptr, columns, values
    if query.layout == torch.sparse_csr:
        if query.dim() != 2:
            raise ShapeError(f"sdmha: query is a sparse CSR tensor of {query.dim()} dimensions; expected (B*T, Eq)")
        rows, features = query.shape
        if batch_hint <= 0 or rows % batch_hint:
            raise ShapeError(f"sdmha: the CSR query has {rows} rows; expected B*T rows for the key's batch B = "
                             f"{batch_hint}")
        values = query.values()
        _check_int32(rows, features, values.numel())
        indptr = query.crow_indices().to(torch.int32)
        columns = query.col_indices().to(torch.int32)
        return batch_hint, rows // batch_hint, features, indptr, columns, values
    raise TypeError(
        f"sdmha: query has layout {query.layout}; expected a sparse COO tensor (B, T, Eq) or a sparse CSR "
        "tensor (B*T, Eq): build it with torch.sparse_coo_tensor(indices, values, (B, T, Eq)) or "
        "query.to_sparse_csr(). A dense query would get no gradient at its zeros: convert it with "
        "query.to_sparse() only if that is what you mean")


def _csr_tuple(query, batch, dtype, features):
    if len(query) != 3 or not all(isinstance(t, torch.Tensor) for t in query):
        raise TypeError("sdmha: a query tuple is (crow_indices, col_indices, values), three tensors")
    indptr, columns, values = query
    for name, tensor in (("crow_indices", indptr), ("col_indices", columns)):
        _check_cpu(f"query {name}", tensor)
        if tensor.dim() != 1 or tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"sdmha: query {name} has dtype {tensor.dtype} and shape {tuple(tensor.shape)}; "
                            "expected a 1-D int32 or int64 tensor")
    _check_cpu("query values", values)
    _check_tensor_dtype("query values", values, dtype)
    rows = indptr.shape[0] - 1
    if batch <= 0 or rows < 0 or rows % batch:
        raise ShapeError(f"sdmha: the CSR query has {rows} rows; expected B*T rows for the key's batch B = {batch}")
    _check_int32(rows, features, values.shape[0])
    return batch, rows // batch, features, indptr.to(torch.int32), columns.to(torch.int32), values


def _check_int32(rows, features, nonzeros):
    for name, value in (("B*T", rows), ("Eq", features), ("the query's nonzeros", nonzeros)):
        if value > _INT32_MAX:
            raise ShapeError(f"sdmha: {name} = {value} does not fit sdmha's int index type; expected <= {_INT32_MAX}")


def _dense(name, tensor, dtype):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sdmha: {name} is a {type(tensor).__name__}; expected a torch.Tensor")
    if tensor.layout != torch.strided:
        raise TypeError(f"sdmha: {name} has layout {tensor.layout}; expected a dense (strided) tensor: convert "
                        "it with .to_dense()")
    _check_cpu(name, tensor)
    _check_tensor_dtype(name, tensor, dtype)
    if tensor.dim() != 3:
        raise ShapeError(f"sdmha: {name} has shape {tuple(tensor.shape)}; expected 3 dimensions (B, S, E)")
    return tensor.contiguous()


def _bool_array(name, mask, ranks):
    """A bool mask (torch or array-like) as a C-contiguous NumPy array of one of `ranks` dims."""
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"sdmha: {name} has dtype {mask.dtype}; expected torch.bool")
        _check_cpu(name, mask)
        mask = mask.detach().contiguous().numpy()
    else:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"sdmha: {name} has dtype {mask.dtype}; expected bool")
    if mask.ndim not in ranks:
        raise ShapeError(f"sdmha: {name} has shape {mask.shape}; expected {_RANK_TEXT[ranks]}")
    return np.ascontiguousarray(mask)


_RANK_TEXT = {
    (2,): "2 dimensions (B, S)",
    (2, 3, 4): "(T, S), (B, T, S) or (B, H, T, S) with B or H possibly 1",
}


def _mask(name, mask, rank):
    return None if mask is None else _bool_array(name, mask, (rank,))


def _four(shape):
    """(T, S) -> (1, 1, T, S), (B, T, S) -> (B, 1, T, S) (sdmha's reading of rank 3)."""
    shape = tuple(shape)
    if len(shape) == 2:
        return (1, 1) + shape
    if len(shape) == 3:
        return (shape[0], 1) + shape[1:]
    return shape


def _torch_mask_4d(attn_mask, batch, heads):
    """PyTorch's attn_mask as (…, L, S) of rank 2 or 4: a 3-D mask is (N·H, L, S) (nn.MultiheadAttention's
    per-head layout, batch entry major) and is read as (N, H, L, S)."""
    if attn_mask.dim() == 3:
        if attn_mask.shape[0] != batch * heads:
            raise ShapeError(
                f"sdmha: attn_mask has shape {tuple(attn_mask.shape)}; a 3-D attn_mask is PyTorch's (N*H, L, S) "
                f"with N*H = {batch}*{heads} = {batch * heads}; expected (L, S), (N*H, L, S) or (N, H, L, S)")
        return attn_mask.reshape(batch, heads, attn_mask.shape[1], attn_mask.shape[2])
    if attn_mask.dim() not in (2, 4):
        raise ShapeError(f"sdmha: attn_mask has shape {tuple(attn_mask.shape)}; expected (L, S), (N*H, L, S) or "
                         "(N, H, L, S)")
    return attn_mask


def _float_bias(name, bias, dtype):
    if not isinstance(bias, torch.Tensor):
        bias = torch.as_tensor(np.asarray(bias))
    if not bias.is_floating_point():
        raise TypeError(f"sdmha: {name} has dtype {bias.dtype}; expected a floating-point tensor")
    _check_cpu(name, bias)
    if bias.dim() not in (2, 3, 4):
        raise ShapeError(f"sdmha: {name} has shape {tuple(bias.shape)}; expected {_RANK_TEXT[(2, 3, 4)]}")
    return bias.to(dtype)  # differentiable


def _attention_terms(attention_mask, attention_bias, attn_mask, batch, heads, dtype):
    """(mask NumPy bool or None, bias tensor or None) from the three conventions:

    attention_mask  bool, True = may attend (Keras); (T, S), (B, T, S), (B, H, T, S), B or H 1.
    attention_bias  float, added to the scaled scores; the same shapes (3-D is (B, T, S)).
    attn_mask       PyTorch's: bool True = blocked, or float added to the scores; (L, S),
                    (N*H, L, S) (read as (N, H, L, S)) or (N, H, L, S).
    Several masks are ANDed, several biases summed (broadcast to their common shape)."""
    masks, biases = [], []
    if attention_mask is not None:
        masks.append(_bool_array("attention_mask", attention_mask, (2, 3, 4)))
    if attention_bias is not None:
        biases.append(_float_bias("attention_bias", attention_bias, dtype))
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            attn_mask = torch.as_tensor(np.asarray(attn_mask))
        attn_mask = _torch_mask_4d(attn_mask, batch, heads)
        _check_cpu("attn_mask", attn_mask)
        if attn_mask.dtype == torch.bool:
            masks.append(_bool_array("attn_mask", ~attn_mask.detach(), (2, 3, 4)))
        else:
            biases.append(_float_bias("attn_mask", attn_mask, dtype))
    mask = masks[0] if len(masks) == 1 else None
    if len(masks) > 1:
        mask = np.ascontiguousarray(np.logical_and.reduce(np.broadcast_arrays(*(m.reshape(_four(m.shape))
                                                                                for m in masks))))
    bias = biases[0] if len(biases) == 1 else None
    if len(biases) > 1:
        bias = sum(b.reshape(_four(b.shape)) for b in biases)
    return mask, bias


def _options(attention_mask, key_padding_mask, use_causal_mask, return_attention_scores, num_threads,
             score_strategy, dropout, training, scale=None, causal_alignment="top_left",
             fully_masked_rows="zeros"):
    options = {
        "use_causal_mask": bool(use_causal_mask),
        "return_attention_scores": bool(return_attention_scores),
        "num_threads": int(num_threads),
        "score_strategy": score_strategy,
        "causal_alignment": causal_alignment,
        "fully_masked_rows": fully_masked_rows,
    }
    if scale is not None:
        options["scale"] = float(scale)
    if attention_mask is not None:
        options["attention_mask"] = attention_mask
    padding = _mask("key_padding_mask", key_padding_mask, 2)
    if padding is not None:
        # PyTorch's polarity (True = padding) inverted into sdmha's key_mask (True = may attend):
        # an array of its own, which the options (kept for the backward) hold alive.
        options["key_mask"] = np.logical_not(padding)
    if training and dropout > 0:
        # A fresh seed per call from torch's generator: reproducible under torch.manual_seed,
        # and the backward (same options) drops the same entries.
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        options.update(training=True, dropout_rate=float(dropout), dropout_seed=seed)
    return options


def _apply(binding, query, key, value, weights, options, num_threads, bias=None):
    dtype = binding.dtype
    value_is_key = value is None or value is key
    key = _dense("key", key, dtype)
    value = key if value_is_key else _dense("value", value, dtype)
    batch, steps, features, indptr, columns, values = _csr_parts(query, key.shape[0], dtype,
                                                                 binding.layer.query_dim)
    for name, tensor in (("key", key), ("value", value)):
        if tensor.shape[0] != batch:  # before project_context, whose message would speak of a context
            raise ShapeError(f"sdmha: SparseDenseMHA::forward: {name} has batch {tensor.shape[0]}; expected the "
                             f"query's batch {batch}")
    key_mask = options.get("key_mask")
    if key_mask is not None and key_mask.shape != (batch, key.shape[1]):  # named as the caller gave it
        raise ShapeError(f"sdmha: key_padding_mask has shape {tuple(key_mask.shape)}; expected (B, S) = "
                         f"({batch}, {key.shape[1]})")
    needs_grad = torch.is_grad_enabled() and (
        values.requires_grad or key.requires_grad or value.requires_grad
        or (bias is not None and bias.requires_grad)
        or any(w is not None and w.requires_grad for w in weights))
    call = _Call(batch, steps, features, options, value_is_key, needs_grad, num_threads)
    return _SparseQueryAttention.apply(binding, call, indptr, columns, values, key, value, bias, *weights)


def _one_bias(attention_bias, attn_bias):
    if attention_bias is not None and attn_bias is not None:
        raise TypeError("sdmha: attention_bias and attn_bias are the same argument; give one")
    return attn_bias if attention_bias is None else attention_bias


def _tracing(*tensors):
    """Whether torch.compile or torch.export is tracing this call (its tensors are fake)."""
    compiler = getattr(torch, "compiler", None)
    for check in ("is_compiling", "is_exporting"):
        if compiler is not None and hasattr(compiler, check) and getattr(compiler, check)():
            return True
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
    except ImportError:
        return False
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)


def _traced_terms(attention_mask, attention_bias, attn_mask, batch, heads, dtype):
    """_attention_terms with torch operations only: (bool mask tensor or None, bias or None)."""
    masks, biases = [], []
    if attention_mask is not None:
        masks.append(attention_mask)
    if attention_bias is not None:
        biases.append(_float_bias("attention_bias", attention_bias, dtype))
    if attn_mask is not None:
        attn_mask = _torch_mask_4d(attn_mask, batch, heads)
        if attn_mask.dtype == torch.bool:
            masks.append(torch.logical_not(attn_mask))
        else:
            biases.append(_float_bias("attn_mask", attn_mask, dtype))
    for mask in masks:
        if mask.dtype != torch.bool or mask.dim() not in (2, 3, 4):
            raise TypeError(f"sdmha: a mask has dtype {mask.dtype} and shape {tuple(mask.shape)}; expected torch.bool, "
                            f"{_RANK_TEXT[(2, 3, 4)]}")
    mask = masks[0] if len(masks) == 1 else None
    if len(masks) > 1:
        mask = torch.logical_and(*torch.broadcast_tensors(*(m.reshape(_four(m.shape)) for m in masks)))
    bias = biases[0] if len(biases) == 1 else None
    if len(biases) > 1:
        bias = sum(b.reshape(_four(b.shape)) for b in biases)
    return (None if mask is None else mask.contiguous()), bias


def _widen_bfloat16(tensor):
    """A bfloat16 tensor as float32 (exactly); anything else as it is (checked later)."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16:
        return tensor.to(torch.float32)
    return tensor


def _batch_of(key):
    return key.shape[0] if isinstance(key, torch.Tensor) and key.dim() == 3 else 0


# ---- the module -----------------------------------------------------------------------------------


class SparseQueryMultiheadAttention(nn.Module):
    """Keras' MultiHeadAttention with a sparse query, on sdmha (CPU, float32 or float64).

    Parameters, in Keras' layout flattened (H heads, Dk = key_dim, Dv = value_dim, O = output_dim):
    query_kernel (Eq, H*Dk), query_bias (H*Dk), key_kernel (Ek, H*Dk), key_bias (H*Dk),
    value_kernel (Ev, H*Dv), value_bias (H*Dv), output_kernel (H*Dv, O), output_bias (O); the
    biases are None when use_bias is False. Initialised like Keras: Glorot uniform with Keras'
    fans for an (E, H, D) kernel (limit sqrt(6 / (E*H + E*D)); output kernel (H, Dv, O):
    sqrt(6 / (H*Dv + H*O))), biases zero, drawn from torch's generator.

    ``dropout`` applies to the attention probabilities in training mode (Keras' dropout), with a
    fresh seed per call from torch's generator. ``num_threads``: sdmha's workers per call; None
    (the default) = torch.get_num_threads() at the call, 0 = the physical cores. ``score_strategy``
    ('automatic', 'project_first', 'sparse_regrouped') goes to sdmha as it is.

    ``precision='bfloat16'`` (or parameters converted with ``module.to(torch.bfloat16)``) runs the
    library's bfloat16 mode: every kernel rounded to bfloat16, the projections, scores and P·V on
    bfloat16 products with float32 sums. Inference only: in eval mode and without autograd
    (torch.no_grad() or torch.inference_mode()); outputs are float32, or bfloat16 for a module
    whose parameters are bfloat16. Inputs may be float32 or bfloat16.
    """

    def __init__(self, num_heads, key_dim, query_features, key_features, value_features, value_dim=None,
                 output_dim=None, use_bias=True, dropout=0.0, dtype=torch.float32, *, num_threads=None,
                 score_strategy="automatic", precision="float32"):
        super().__init__()
        _check_dtype(dtype)
        if not 0.0 <= float(dropout) < 1.0:
            raise _sdmha.ConfigError(f"sdmha: dropout = {dropout}; expected 0 <= dropout < 1")
        if score_strategy not in _SCORE_STRATEGIES:
            raise _sdmha.ConfigError(f"sdmha: score_strategy = {score_strategy!r}; expected one of {_SCORE_STRATEGIES}")
        _check_num_threads(num_threads)
        if precision not in _PRECISIONS:
            raise _sdmha.ConfigError(f"sdmha: precision = {precision!r}; expected one of {_PRECISIONS}")
        if precision == "bfloat16" and dtype != torch.float32:
            raise _sdmha.ConfigError(f"sdmha: precision = 'bfloat16' needs dtype torch.float32; got {dtype}")
        self.num_heads = int(num_heads)
        self.key_dim = int(key_dim)
        self.value_dim = int(value_dim) if value_dim else self.key_dim
        self.query_features = int(query_features)
        self.key_features = int(key_features)
        self.value_features = int(value_features)
        self.output_dim = int(output_dim) if output_dim else self.query_features
        self.use_bias = bool(use_bias)
        self.dropout = float(dropout)
        self.num_threads = None if num_threads is None else int(num_threads)
        self.score_strategy = score_strategy
        #: 'float32' (the module's dtype as it is) or 'bfloat16' (inference; see the class docstring).
        self.precision = precision
        #: use_causal_mask from a loaded file's metadata (from_keras / from_torch); forward's
        #: use_causal_mask is what applies.
        self.file_use_causal_mask = False
        binding = _Binding(dtype, self.num_heads, self.key_dim, self.query_features, self.key_features,
                           self.value_features, self.value_dim, self.output_dim, self.use_bias)
        self._binding = binding
        for name in WEIGHT_NAMES:
            if name in binding.tensors:
                self.register_parameter(name, nn.Parameter(binding.tensors[name]))  # shares memory
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def _limits(self):
        heads, key_dim, value_dim = self.num_heads, self.key_dim, self.value_dim
        eq, ek, ev, out = self.query_features, self.key_features, self.value_features, self.output_dim

        def glorot(fan_in, fan_out):
            return math.sqrt(6.0 / (fan_in + fan_out))

        return {
            "query_kernel": glorot(eq * heads, eq * key_dim),
            "key_kernel": glorot(ek * heads, ek * key_dim),
            "value_kernel": glorot(ev * heads, ev * value_dim),
            "output_kernel": glorot(heads * value_dim, heads * out),
        }

    def reset_parameters(self):
        """Keras' initialisation: kernels Glorot uniform (Keras' fans), biases zero."""
        with torch.no_grad():
            for name, limit in self._limits().items():
                getattr(self, name).uniform_(-limit, limit)
            for name in WEIGHT_NAMES[1::2]:
                bias = getattr(self, name)
                if bias is not None:
                    bias.zero_()

    def _weights(self):
        return [getattr(self, name) for name in WEIGHT_NAMES]

    def _binding_for(self, weights, dtype):
        """The C++ layer of `dtype` for parameters of these shapes (a new one when they changed)."""
        for name, tensor in weights.items():
            if tensor is not None:
                _check_cpu(f"parameter {name}", tensor)
        kernel = weights["query_kernel"]
        key = (dtype, self.num_heads, self.key_dim, kernel.shape[0], weights["key_kernel"].shape[0],
               weights["value_kernel"].shape[0], self.value_dim, self.output_dim, self.use_bias)
        binding = self.__dict__.get("_binding")
        if binding is None or binding.key != key:
            binding = _Binding(*key)
            self._binding = binding
        return binding

    def _bound(self):
        """The C++ layer for the parameters as they are now (see the module docstring)."""
        weights = dict(zip(WEIGHT_NAMES, self._weights()))
        dtype = _check_dtype(weights["query_kernel"].dtype)
        binding = self._binding_for(weights, dtype)
        if binding.layer.precision != "float32":
            binding.layer.set_precision("float32")
        for name, tensor in weights.items():
            if tensor is not None and not binding.shares(name, tensor):
                binding.layer.set_weight(name, _array(name, tensor, dtype))
                tensor.data = binding.tensors[name]  # the parameter is the C++ memory again
        return binding

    def _precision_now(self):
        """'bfloat16' for bfloat16 parameters or precision='bfloat16', else 'float32'."""
        if self.query_kernel.dtype == torch.bfloat16:
            return "bfloat16"
        return getattr(self, "precision", "float32")  # modules pickled before the attribute existed

    def _bound_bfloat16(self):
        """A float32 C++ layer in bfloat16 mode over the parameters as they are now.

        float32 parameters stay the C++ memory; bfloat16 ones are copied in (widened, exactly).
        The rounded kernels are a snapshot, taken again whenever a parameter was replaced or
        written in place since (its data pointer or its version counter moved)."""
        weights = dict(zip(WEIGHT_NAMES, self._weights()))
        dtype = weights["query_kernel"].dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise _sdmha.ConfigError(f"sdmha: precision 'bfloat16' needs float32 or bfloat16 parameters; these "
                                     f"are {dtype}: call module.float() first")
        binding = self._binding_for(weights, torch.float32)
        stamp = tuple(None if t is None else (t.data_ptr(), t._version, t.dtype) for t in weights.values())
        if binding.layer.precision != "bfloat16" or binding.stamp != stamp:
            for name, tensor in weights.items():
                if tensor is not None and not binding.shares(name, tensor):
                    binding.layer.set_weight(name, tensor.detach().to(torch.float32).contiguous().numpy())
            binding.layer.set_precision("bfloat16")
            binding.stamp = stamp
        return binding

    @property
    def bfloat16_gemm_engine(self):
        """What the bfloat16 mode runs the projections, the scores and P·V on, as
        sdmha.Layer.bfloat16_gemm_engine names it ('off' for a float32 module: float32; 'on',
        'amx', ... in the bfloat16 mode). Takes the bfloat16 snapshot of the kernels now if no
        call has taken it yet."""
        if self._precision_now() != "bfloat16":
            return "off"
        return self._bound_bfloat16().layer.bfloat16_gemm_engine

    def _check_inference(self, tensors):
        if self.training:
            raise _sdmha.ConfigError("sdmha: precision 'bfloat16' runs inference only (sdmha has no bfloat16 "
                                     "backward): call module.eval() first, or train in float32")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            raise _sdmha.ConfigError("sdmha: precision 'bfloat16' computes no gradients, and autograd would need "
                                     "them here: call the module under torch.no_grad() or torch.inference_mode(), "
                                     "or train in float32")

    def forward(self, query, key, value=None, attention_mask=None, use_causal_mask=False,
                return_attention_scores=False, key_padding_mask=None, *, attention_bias=None, attn_bias=None,
                attn_mask=None, scale=None, causal_alignment="top_left", fully_masked_rows="zeros"):
        """query: sparse COO (B, T, Eq) or sparse CSR (B*T, Eq); key (B, S, Ek); value (B, S, Ev),
        None meaning key. Returns output (B, T, O), and with return_attention_scores the
        probabilities (B, H, T, S) (not differentiable) too.

        Masks and biases, each (T, S), (B, T, S), (B, H, T, S) or with B or H 1 (all combine):

        * attention_mask: bool, True = may attend (Keras' convention); a 3-D one is (B, T, S).
        * attention_bias (alias attn_bias): float, added to the scaled scores before the softmax
          (S = scale·Q·Kᵀ + bias; −inf blocks); differentiable, its gradient in its own shape.
        * attn_mask: PyTorch's convention: a bool one has True = blocked (inverted here), a float
          one is an additive bias (as attention_bias); a 3-D one is nn.MultiheadAttention's
          (N·H, L, S), read as (N, H, L, S).
        * key_padding_mask: bool (B, S), True = padding (PyTorch).

        scale: the factor on the scores (default 1/sqrt(key_dim)); causal_alignment 'top_left'
        (s <= t) or 'bottom_right' (s <= t + S - T) for use_causal_mask; fully_masked_rows
        'zeros' (PyTorch, Keras 3) or 'uniform' (rows with every key blocked average every value)."""
        threads = _worker_count(self.num_threads)
        if HAS_CUSTOM_OP and _tracing(self.query_kernel, key):
            return self._forward_traced(query, key, value, attention_mask, use_causal_mask, return_attention_scores,
                                        key_padding_mask, _one_bias(attention_bias, attn_bias), attn_mask, scale,
                                        causal_alignment, fully_masked_rows, threads)
        bfloat16 = self._precision_now() == "bfloat16"
        binding = self._bound_bfloat16() if bfloat16 else self._bound()
        mask, bias = _attention_terms(attention_mask, _one_bias(attention_bias, attn_bias), attn_mask,
                                      _batch_of(key), self.num_heads, binding.dtype)
        options = _options(mask, key_padding_mask, use_causal_mask, return_attention_scores, threads,
                           self.score_strategy, self.dropout, self.training, scale, causal_alignment,
                           fully_masked_rows)
        if not bfloat16:
            return _apply(binding, query, key, value, self._weights(), options, threads, bias)
        self._check_inference([*self._weights(), query, key, value, bias])
        widen = _widen_bfloat16
        value = None if value is None or value is key else widen(value)
        weights = [binding.tensors.get(name) for name in WEIGHT_NAMES]  # the C++ memory: nothing to load
        result = _apply(binding, widen(query), widen(key), value, weights, options, threads, widen(bias))
        out = self.query_kernel.dtype  # bfloat16 outputs for bfloat16 parameters
        return result.to(out) if isinstance(result, torch.Tensor) else tuple(r.to(out) for r in result)

    def _forward_traced(self, query, key, value, attention_mask, use_causal_mask, return_attention_scores,
                        key_padding_mask, bias, attn_mask, scale, causal_alignment, fully_masked_rows, threads):
        """forward under torch.compile or torch.export: torch operations and the operator
        torch.ops.sdmha.attention only (sdmha/_torch_ops.py); masks as torch tensors."""
        if self._precision_now() != "float32":
            raise _sdmha.ConfigError("sdmha: precision 'bfloat16' runs eagerly only; call the module outside "
                                     "torch.compile / torch.export")
        dtype = _check_dtype(self.query_kernel.dtype)
        value_is_key = value is None or value is key
        key = _dense("key", key, dtype)
        value = key if value_is_key else _dense("value", value, dtype)
        batch, steps, features, indptr, columns, values = _csr_parts(query, key.shape[0], dtype,
                                                                     self.query_features)
        mask, bias = _traced_terms(attention_mask, bias, attn_mask, batch, self.num_heads, dtype)
        options = _options(None, None, use_causal_mask, return_attention_scores, threads, self.score_strategy,
                           self.dropout, self.training, scale, causal_alignment, fully_masked_rows)
        key_mask = None if key_padding_mask is None else torch.logical_not(key_padding_mask)
        call = _Call(batch, steps, features, options, value_is_key, False, threads)
        return _torch_ops.apply(call, indptr, columns, values, key, value, bias, self._weights(), self.num_heads,
                                mask, key_mask)

    def extra_repr(self):
        text = (f"num_heads={self.num_heads}, key_dim={self.key_dim}, query_features={self.query_features}, "
                f"key_features={self.key_features}, value_features={self.value_features}")
        if self.value_dim != self.key_dim:
            text += f", value_dim={self.value_dim}"
        if self.output_dim != self.query_features:
            text += f", output_dim={self.output_dim}"
        if not self.use_bias:
            text += ", use_bias=False"
        if self.dropout:
            text += f", dropout={self.dropout}"
        if self.precision != "float32":
            text += f", precision={self.precision!r}"
        return text + f", dtype={self.query_kernel.dtype}"

    def __getstate__(self):
        # The C++ layer is not picklable; the parameters are, and the next forward rebinds.
        state = self.__dict__.copy()
        state["_binding"] = None
        return state

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_keras(cls, path, dtype=torch.float32, prefix=None, layer_name="", isolated=True, **kwargs):
        """A module with the weights of a Keras MultiHeadAttention.

        From a Keras 3 file — ``model.save``'s .keras (or its unzipped directory) or
        ``model.save_weights``' .weights.h5, read by sdmha::io::load_keras_layer; layer_name picks
        the layer (a Keras layer name or an HDF5 group path; "" for the file's only one) — or from
        safetensors / .npz in the names query/kernel (Eq, H, Dk) ... attention_output/bias (O),
        optionally under a layer `prefix` (tools/cli/sdmha_export.py's export_keras writes them),
        read by sdmha::io::load_layer. A Keras file is read in a child process (libhdf5 cannot be
        hardened against hostile files); isolated=False reads it in this one, for trusted files."""
        text = os.fspath(path)
        if os.path.isdir(text) or text.endswith((".keras", ".h5")):
            _check_dtype(dtype)
            loaded = load_keras_layer(text, dtype_name(dtype), layer_name, isolated=isolated)
            return cls._from_layer(loaded["layer"], dtype, False, kwargs)
        return cls._from_file(path, dtype, "keras", None, prefix, kwargs)

    @classmethod
    def from_torch(cls, source, num_heads=None, dtype=None, **kwargs):
        """A module with the weights of a torch.nn.MultiheadAttention: the instance itself, or its
        weights saved in safetensors or .npz (in_proj_weight or q/k/v_proj_weight, in_proj_bias,
        out_proj.weight, out_proj.bias; tools/cli/sdmha_export.py's export_torch writes them; num_heads
        is needed when the file's metadata lacks it). The result equals the torch module on the
        densified query (batch_first, attn_mask polarity inverted). dtype: the instance's (float32
        or float64) by default, float32 for a file; an instance's dropout is taken unless given."""
        if isinstance(source, nn.MultiheadAttention):
            return cls._from_torch_module(source, dtype, kwargs)
        return cls._from_file(source, torch.float32 if dtype is None else dtype, "torch", num_heads, None, kwargs)

    @classmethod
    def _from_torch_module(cls, source, dtype, kwargs):
        if source.bias_k is not None or source.add_zero_attn:
            raise _sdmha.ConfigError("sdmha: from_torch: the nn.MultiheadAttention has add_bias_kv or add_zero_attn, "
                                     "which Keras' layer has no equivalent of; expected neither")
        for name, parameter in source.named_parameters():
            _check_cpu(f"the nn.MultiheadAttention's {name}", parameter)
        if source._qkv_same_embed_dim:
            kernels = source.in_proj_weight.chunk(3)
        else:
            kernels = (source.q_proj_weight, source.k_proj_weight, source.v_proj_weight)
        dtype = _check_dtype(kernels[0].dtype if dtype is None else dtype)
        in_bias = source.in_proj_bias
        kwargs.setdefault("dropout", source.dropout)
        module = cls(source.num_heads, source.head_dim, source.embed_dim, source.kdim, source.vdim,
                     value_dim=source.head_dim, output_dim=source.embed_dim, use_bias=in_bias is not None,
                     dtype=dtype, **kwargs)
        # nn.MultiheadAttention computes x·Wᵀ + b with W (out, in); Keras x·W + b with W (in, out).
        # Its heads split the projected width as (H, head_dim), head-major: Keras' flattening.
        weights = {"query_kernel": kernels[0].t(), "key_kernel": kernels[1].t(), "value_kernel": kernels[2].t(),
                   "output_kernel": source.out_proj.weight.t()}
        if in_bias is not None:
            weights.update(zip(("query_bias", "key_bias", "value_bias"), in_bias.chunk(3)))
            weights["output_bias"] = source.out_proj.bias
        with torch.no_grad():
            for name, tensor in weights.items():
                getattr(module, name).copy_(tensor)
        return module

    @classmethod
    def _from_file(cls, path, dtype, layout, num_heads, prefix, kwargs):
        _check_dtype(dtype)
        loaded = _sdmha.load_layer(os.fspath(path), dtype_name(dtype), num_heads, layout, prefix, None)
        return cls._from_layer(loaded["layer"], dtype, bool(loaded["use_causal_mask"]), kwargs)

    @classmethod
    def _from_layer(cls, layer, dtype, use_causal_mask, kwargs):
        module = cls(layer.num_heads, layer.key_dim, layer.query_dim, layer.key_in_dim, layer.value_in_dim,
                     value_dim=layer.value_dim, output_dim=layer.output_dim, use_bias=layer.use_bias,
                     dtype=dtype, **kwargs)
        with torch.no_grad():
            for name, parameter in zip(WEIGHT_NAMES, module._weights()):
                if parameter is not None:
                    parameter.copy_(torch.from_numpy(layer.weight(name)))
        module.file_use_causal_mask = use_causal_mask
        return module


def sparse_query_attention(query, key, value, query_kernel, query_bias, key_kernel, key_bias, value_kernel,
                           value_bias, output_kernel, output_bias, num_heads, attention_mask=None,
                           use_causal_mask=False, return_attention_scores=False, key_padding_mask=None,
                           dropout=0.0, training=False, dropout_seed=None, num_threads=None,
                           score_strategy="automatic", *, attention_bias=None, attn_bias=None, attn_mask=None,
                           scale=None, causal_alignment="top_left", fully_masked_rows="zeros"):
    """The layer as a function of its weights (Keras' layout, biases None without bias).

    Builds a C++ layer per call and copies the weights into it (the module avoids both);
    differentiable in every tensor argument (attention_bias too). key_dim, value_dim and the
    widths are read off the kernels. dropout_seed fixes the dropout mask (default: drawn from
    torch's generator). num_threads None means torch.get_num_threads(). The masks, biases and
    semantics options are SparseQueryMultiheadAttention.forward's.
    """
    dtype = _check_dtype(query_kernel.dtype)
    heads = int(num_heads)
    if query_kernel.dim() != 2 or query_kernel.shape[1] % heads or value_kernel.dim() != 2 \
            or value_kernel.shape[1] % heads or output_kernel.dim() != 2:
        raise ShapeError(
            f"sdmha: kernels of shapes {tuple(query_kernel.shape)}, {tuple(value_kernel.shape)}, "
            f"{tuple(output_kernel.shape)} do not give num_heads = {heads} heads; expected (Eq, H*Dk), "
            "(Ev, H*Dv), (H*Dv, O)")
    use_bias = query_bias is not None
    biases = (query_bias, key_bias, value_bias, output_bias)
    if any((bias is not None) != use_bias for bias in biases):
        raise ShapeError("sdmha: some biases are None and others not; expected all four or none")
    binding = _Binding(dtype, heads, query_kernel.shape[1] // heads, query_kernel.shape[0], key_kernel.shape[0],
                       value_kernel.shape[0], value_kernel.shape[1] // heads, output_kernel.shape[1], use_bias)
    mask, bias = _attention_terms(attention_mask, _one_bias(attention_bias, attn_bias), attn_mask, _batch_of(key),
                                  heads, dtype)
    _check_num_threads(num_threads)
    num_threads = _worker_count(num_threads)
    options = _options(mask, key_padding_mask, use_causal_mask, return_attention_scores, num_threads,
                       score_strategy, dropout, training, scale, causal_alignment, fully_masked_rows)
    if training and dropout > 0 and dropout_seed is not None:
        options["dropout_seed"] = int(dropout_seed)
    weights = [query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, output_kernel, output_bias]
    return _apply(binding, query, key, value, weights, options, num_threads, bias)


_torch_ops = None
if CUSTOM_OP_SUPPORTED:
    try:
        from . import _torch_ops  # noqa: E402  (needs the names above)

        _torch_ops.register()
        HAS_CUSTOM_OP = True
    except Exception as error:  # noqa: BLE001  the eager module must stay usable whatever the cause
        CUSTOM_OP_ERROR = f"registering torch.ops.sdmha.attention failed: {error!r}"
        warnings.warn(f"sdmha: {CUSTOM_OP_ERROR}; torch.compile and torch.export will not see sdmha's op "
                      "(eager calls are unaffected)", RuntimeWarning)
