"""sdmha's forward and backward as PyTorch operators, for torch.compile and torch.export.

``torch.ops.sdmha.attention`` and ``torch.ops.sdmha.attention_backward``, registered through
``torch.library.custom_op`` (PyTorch >= 2.4, sdmha.torch.HAS_CUSTOM_OP) with a fake (shape-only)
implementation each and ``register_autograd`` linking the two: graphs see two opaque operators of
known output shapes, and the compiled backward calls the second. Eager calls keep going through
sdmha.torch's autograd.Function, which also keeps K and V from the forward for the backward; the
operator's backward projects them again (its inputs are tensors only).

The operators take tensors, a list of sizes and the options as a JSON string (constants for a
graph). Their implementations find the C++ layer whose memory the weights are (a module's
parameters: no copy), else one kept per configuration here, into which the weights are copied.
The implementations are plain functions (forward, backward, fake_forward, fake_backward), which
the tests also call on PyTorch versions without custom_op.
"""

import json
from typing import List, Optional, Tuple

import numpy as np
import torch

from . import WEIGHT_NAMES
from . import torch as front

# Bindings for weights that are no module's memory, one per configuration (the functional form).
_OWN_BINDINGS = {}


def binding_for(weights, num_heads):
    """The C++ layer for eight weights (None for absent biases), loaded with them."""
    query_kernel, _, key_kernel, _, value_kernel, _, output_kernel, _ = weights
    key = (query_kernel.dtype, num_heads, query_kernel.shape[1] // num_heads, query_kernel.shape[0],
           key_kernel.shape[0], value_kernel.shape[0], value_kernel.shape[1] // num_heads, output_kernel.shape[1],
           weights[1] is not None)
    binding = front._BINDINGS.get(query_kernel.data_ptr())
    if binding is None or binding.key != key:
        binding = _OWN_BINDINGS.get(key)
        if binding is None:
            binding = _OWN_BINDINGS[key] = front._Binding(*key)
    if binding.layer.precision != "float32":
        binding.layer.set_precision("float32")
    binding.load(dict(zip(WEIGHT_NAMES, weights)))
    return binding


def options_text(options):
    """The JSON of forward's scalar options (the masks travel as tensors)."""
    return json.dumps({k: v for k, v in options.items() if k not in ("attention_mask", "key_mask")}, sort_keys=True)


def _call(sizes, options, attention_mask, key_mask, value_is_key):
    batch, steps, features, _ = sizes
    options = json.loads(options)
    if attention_mask is not None:
        options["attention_mask"] = np.ascontiguousarray(attention_mask.numpy())
    if key_mask is not None:
        options["key_mask"] = np.ascontiguousarray(key_mask.numpy())
    return front._Call(batch, steps, features, options, value_is_key, False, options["num_threads"])


def forward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask, key_mask, sizes,
            options):
    """(output (B, T, O), scores (B, H, T, S) or an empty tensor) of the C++ forward."""
    binding = binding_for(weights, sizes[3])
    call = _call(sizes, options, attention_mask, key_mask, value is key)
    query, key_array, value_array, kwargs = front._prepare(binding, call, indptr, columns, query_values, key,
                                                           value, attention_bias)
    output, scores = binding.layer.forward(query, key_array, value_array, workspace=binding.workspace, **kwargs)
    scores = torch.from_numpy(scores) if scores is not None else key.new_empty(0)
    return torch.from_numpy(output), scores


def backward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask, key_mask, sizes,
             options, d_output, compute_bias_gradient):
    """The gradients of query_values, key, value, attention_bias and the eight weights, in that
    order; an empty tensor for an absent input (a bias without use_bias, no attention_bias)."""
    binding = binding_for(weights, sizes[3])
    call = _call(sizes, options, attention_mask, key_mask, False)
    query, key_array, value_array, kwargs = front._prepare(binding, call, indptr, columns, query_values, key,
                                                           value, attention_bias)
    if attention_bias is not None:
        kwargs = dict(kwargs, compute_bias_gradient=bool(compute_bias_gradient))
    d_output = front._array("d_output", d_output, binding.dtype)
    grads = binding.layer.backward(query, key_array, value_array, d_output, workspace=binding.workspace, **kwargs)
    names = ("query_values", "key", "value", "attention_bias", *WEIGHT_NAMES)
    return [torch.from_numpy(grads[name]) if grads.get(name) is not None else key.new_empty(0) for name in names]


def fake_forward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask, key_mask, sizes,
                 options):
    batch, steps, _, heads = sizes
    output = key.new_empty((batch, steps, weights[6].shape[1]))
    if json.loads(options)["return_attention_scores"]:
        return output, key.new_empty((batch, heads, steps, key.shape[1]))
    return output, key.new_empty(0)


def fake_backward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask, key_mask,
                  sizes, options, d_output, compute_bias_gradient):
    inputs = (query_values, key, value, attention_bias if compute_bias_gradient else None, *weights)
    return [key.new_empty(0) if t is None else torch.empty_like(t) for t in inputs]


def register():
    """Registers the two operators (PyTorch >= 2.4); returns them (custom_op's objects)."""

    @torch.library.custom_op("sdmha::attention", mutates_args=())
    def attention(indptr: torch.Tensor, columns: torch.Tensor, query_values: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_bias: Optional[torch.Tensor], query_kernel: torch.Tensor,
                  query_bias: Optional[torch.Tensor], key_kernel: torch.Tensor, key_bias: Optional[torch.Tensor],
                  value_kernel: torch.Tensor, value_bias: Optional[torch.Tensor], output_kernel: torch.Tensor,
                  output_bias: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                  key_mask: Optional[torch.Tensor], sizes: List[int], options: str) -> Tuple[torch.Tensor, torch.Tensor]:
        weights = (query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, output_kernel,
                   output_bias)
        # An operator's outputs may not alias its inputs, nor each other: fresh C++ results do not.
        return forward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask,
                       key_mask, sizes, options)

    @attention.register_fake
    def _(indptr, columns, query_values, key, value, attention_bias, query_kernel, query_bias, key_kernel,
          key_bias, value_kernel, value_bias, output_kernel, output_bias, attention_mask, key_mask, sizes, options):
        weights = (query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, output_kernel,
                   output_bias)
        return fake_forward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask,
                            key_mask, sizes, options)

    @torch.library.custom_op("sdmha::attention_backward", mutates_args=())
    def attention_backward(indptr: torch.Tensor, columns: torch.Tensor, query_values: torch.Tensor,
                           key: torch.Tensor, value: torch.Tensor, attention_bias: Optional[torch.Tensor],
                           query_kernel: torch.Tensor, query_bias: Optional[torch.Tensor], key_kernel: torch.Tensor,
                           key_bias: Optional[torch.Tensor], value_kernel: torch.Tensor,
                           value_bias: Optional[torch.Tensor], output_kernel: torch.Tensor,
                           output_bias: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                           key_mask: Optional[torch.Tensor], sizes: List[int], options: str, d_output: torch.Tensor,
                           compute_bias_gradient: bool) -> List[torch.Tensor]:
        weights = (query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, output_kernel,
                   output_bias)
        return backward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask,
                        key_mask, sizes, options, d_output, compute_bias_gradient)

    @attention_backward.register_fake
    def _(indptr, columns, query_values, key, value, attention_bias, query_kernel, query_bias, key_kernel,
          key_bias, value_kernel, value_bias, output_kernel, output_bias, attention_mask, key_mask, sizes, options,
          d_output, compute_bias_gradient):
        weights = (query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, output_kernel,
                   output_bias)
        return fake_backward(indptr, columns, query_values, key, value, attention_bias, weights, attention_mask,
                             key_mask, sizes, options, d_output, compute_bias_gradient)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:16])
        ctx.sizes, ctx.options = inputs[16], inputs[17]

    def attention_grad(ctx, d_output, d_scores):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = attention_backward(*saved, ctx.sizes, ctx.options, d_output.contiguous(), bool(needs[5]))
        # Inputs 2-13 (query_values, key, value, attention_bias, eight weights) have gradients.
        result = [None, None]
        for index, grad in zip(range(2, 14), grads):
            result.append(grad if needs[index] and saved[index] is not None else None)
        return (*result, None, None, None, None)

    attention.register_autograd(attention_grad, setup_context=setup_context)
    return attention, attention_backward


def apply(call, indptr, columns, query_values, key, value, bias, weights, num_heads, attention_mask, key_mask):
    """The module's call through the operator: (output, scores) as forward returns them."""
    options = options_text(call.options)
    sizes = [call.batch, call.steps, call.features, num_heads]
    output, scores = torch.ops.sdmha.attention(indptr, columns, query_values, key, value, bias, *weights,
                                               attention_mask, key_mask, sizes, options)
    return (output, scores) if call.options["return_attention_scores"] else output
