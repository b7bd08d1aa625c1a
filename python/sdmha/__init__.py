"""sdmha: multi-head attention whose query is sparse (CSR) and whose key and value are dense.

Keras' MultiHeadAttention semantics, forward and backward, computed by the header-only C++
library sdmha through the extension module ``sdmha._sdmha``. Two levels:

* NumPy (this module): :func:`Layer`, :func:`csr_query`, :func:`coo_query`, :func:`Workspace`,
  :func:`load_layer`, :func:`load_keras_layer`, :func:`load_inputs` and the exceptions.
* PyTorch: ``sdmha.torch.SparseQueryMultiheadAttention``, an ``nn.Module`` that trains
  (``import sdmha.torch``; torch is imported only then).

Example::

    import numpy as np, sdmha
    layer = sdmha.Layer(num_heads=8, key_dim=64, query_dim=32768, key_in_dim=512,
                        value_in_dim=512, seed=1, dtype="float32")
    query = sdmha.csr_query(batch, steps, 32768, indptr, indices, values)  # B*T CSR rows
    workspace = sdmha.Workspace("float32")                                   # kept across calls
    output, scores = layer.forward(query, key, value, workspace=workspace,
                                   return_attention_scores=True)
    grads = layer.backward(query, key, value, d_output, workspace=workspace)

Every failure sdmha detects raises a subclass of :class:`Error` (a ``ValueError``) carrying the
C++ message: :class:`ShapeError`, :class:`IndexError` (also a built-in ``IndexError``),
:class:`ConfigError`, :class:`FormatError`, :class:`IoError`. docs/python.md has the details.
"""

import os as _os
import sys as _sys

import numpy as _np

from . import _kernels

try:
    # One extension module of those built per instruction set, chosen by the CPU and
    # SDMHA_KERNELS (sdmha/_kernels.py), known as sdmha._sdmha from here on.
    _sdmha, _extension = _kernels.load()
except ImportError as error:  # the source tree, or a build for another interpreter
    raise ImportError(
        f"sdmha: the compiled extension cannot be imported ({error}); build it with CMake "
        "(docs/python.md) and put <build>/python on PYTHONPATH, or install the package") from error
_sys.modules[__name__ + "._sdmha"] = _sdmha
from ._sdmha import ConfigError, Error, FormatError, IoError, ShapeError  # noqa: E402

# Also a built-in IndexError; left out of __all__ so that `from sdmha import *` does not shadow it.
IndexError = _sdmha.IndexError  # noqa: A001

__version__ = _sdmha.__version__

__all__ = [
    "Layer",
    "csr_query",
    "coo_query",
    "Workspace",
    "load_layer",
    "load_keras_layer",
    "load_inputs",
    "dtype_name",
    "kernels",
    "WEIGHT_NAMES",
    "Error",
    "ShapeError",
    "ConfigError",
    "FormatError",
    "IoError",
]

#: The weights in Keras' layout, in the order the C++ MhaWeights declares them.
WEIGHT_NAMES = (
    "query_kernel",
    "query_bias",
    "key_kernel",
    "key_bias",
    "value_kernel",
    "value_bias",
    "output_kernel",
    "output_bias",
)


def dtype_name(dtype):
    """'float32' or 'float64' for a NumPy dtype, a torch dtype or their names; TypeError otherwise."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    else:
        try:
            text = _np.dtype(dtype).name
        except TypeError:
            pass
    if text in ("float32", "float64"):
        return text
    raise TypeError(f"sdmha: dtype {dtype!r} is not supported; expected float32 or float64")


def kernels():
    """Which compiled kernels this process runs, chosen once at import:

    ``{'extension': 'avx512_bf16' | 'portable' | 'native'`` (the module imported),
    ``'requested': 'auto' | 'portable'`` (SDMHA_KERNELS), ``'float32_gemm': 'avx512' | 'eigen'``,
    ``'bfloat16_gemm': 'avx512_bf16' | 'portable'`` (the C++ library's GEMM engines,
    sdmha::active_kernels()) and ``'compiled_for'``: the instruction sets of the module among
    avx2, fma, avx512f and avx512bf16."""
    result = {"extension": _extension[len("_sdmha_"):], "requested": _kernels.requested()}
    result.update(_sdmha.active_kernels())
    result["compiled_for"] = list(_sdmha.compiled_for)
    return result


def _class(prefix, dtype):
    return getattr(_sdmha, f"{prefix}_{dtype_name(dtype)}")


def Layer(num_heads, key_dim, query_dim, key_in_dim, value_in_dim, value_dim=0, output_dim=0,
          use_bias=True, seed=None, dtype="float32"):
    """A C++ SparseDenseMHA of `dtype` (Layer_float32 / Layer_float64).

    Widths: query_dim Eq, key_in_dim Ek, value_in_dim Ev; value_dim 0 means key_dim and
    output_dim 0 means Eq (Keras' defaults). seed=None gives zero weights, an integer sdmha's
    glorot_uniform(seed). ``layer.weight(name)`` is a writable view of a weight (no copy),
    ``layer.set_weight(name, array)`` copies into it.

    ``layer.forward(query, key, value, key_mask=...)`` takes the C++ API's key mask: bool (B, S),
    True = key step s of batch entry b may be attended (attention_mask's polarity, the negation
    of PyTorch's key_padding_mask, which only ``sdmha.torch`` takes). ``layer.set_precision(p)``
    with p = 'float32', 'bfloat16' (every kernel) or 'bfloat16_query_kernel' (Wq only); float32
    layers only for the bfloat16 modes; ``layer.precision`` is the mode last set.
    """
    return _class("Layer", dtype)(num_heads, key_dim, query_dim, key_in_dim, value_in_dim,
                                  value_dim, output_dim, use_bias, seed)


def Workspace(dtype="float32"):  # noqa: N802 (a factory standing for the two classes)
    """A workspace (memory and worker threads kept between calls) for layers of `dtype`."""
    return _class("Workspace", dtype)()


def _values_dtype(values, dtype):
    if dtype is not None:
        return dtype_name(dtype)
    kind = getattr(values, "dtype", None)
    return "float64" if kind is not None and _np.dtype(kind) == _np.float64 else "float32"


def csr_query(batch, steps, features, indptr, indices, values, dtype=None):
    """The query (batch, steps, features) from CSR arrays of batch*steps rows, viewed in place.

    indptr has batch*steps + 1 entries, indices and values one per stored value. int32 indices
    and C-contiguous values of the layer's dtype are not copied (other integer types are
    converted once, with a range check); the query keeps the arrays alive: do not change them
    while it is in use. dtype defaults to the values' (float64 stays float64, else float32).
    """
    name = _values_dtype(values, dtype)
    return _class("SparseQuery", name).from_csr(batch, steps, features, indptr, indices, values)


def coo_query(batch, steps, features, indices, values, dtype=None):
    """The query from COO coordinates: indices (nnz, 3) int64 (batch, step, feature), any order.

    Duplicate coordinates are summed; Layer.backward then returns ``query_values`` with one
    gradient per input entry, in input order (duplicates each get their coordinate's gradient).
    """
    name = _values_dtype(values, dtype)
    return _class("SparseQuery", name).from_coo(batch, steps, features, indices, values)


def load_layer(path, dtype="float32", num_heads=None, layout=None, prefix=None, use_causal_mask=None):
    """sdmha::io::load_layer: a layer's weights from safetensors or .npz, Keras' or PyTorch's names.

    Returns {'layer': Layer, 'layout': 'keras' | 'torch', 'use_causal_mask': bool, 'options':
    dict}. 'options' holds the file's attention settings (use_causal_mask, causal_alignment, scale,
    fully_masked_rows) as forward's and backward's keyword arguments, so that
    ``layer.forward(query, key, value, **loaded["options"])`` runs the layer as the file says.
    num_heads is needed for PyTorch weights whose metadata lacks it.
    """
    _require_io("load_layer")
    return _sdmha.load_layer(_os.fspath(path), dtype_name(dtype), num_heads, layout, prefix,
                             use_causal_mask)


def load_keras_layer(path, dtype="float32", layer_name="", num_heads=None, key_dim=0, value_dim=0,
                     output_dim=0, use_bias=True, isolated=True):
    """sdmha::io::load_keras_layer: a MultiHeadAttention from a Keras 3 file — ``model.save``'s
    .keras zip (or its unzipped directory) or ``model.save_weights``' .weights.h5.

    layer_name is the Keras layer name, an HDF5 group path such as "layers/multi_head_attention",
    or "" for the file's only MultiHeadAttention. A .weights.h5 written before Keras 3.6 names no
    layers and holds no configuration: give the group path, and num_heads (with key_dim,
    value_dim, output_dim, use_bias) to have every shape checked. docs/keras_files.md has the
    details. Returns {'layer': Layer, 'name', 'group', 'keras_version',
    'no_keras_version_reason'} (the reason is '' when keras_version is known).

    isolated=True (the default) reads the file in a child process
    (sdmha::io::load_keras_layer_isolated: 4 GiB, 5 s plus 30 s per GiB of the file, at most
    60 s): libhdf5 crashes or hangs on some damaged files, and there that is an IoError naming
    the file while this process goes on.
    isolated=False reads it in this process: for trusted files only (docs/bad_input.md, "Trust
    boundary").
    """
    _require_io("load_keras_layer")
    if not _sdmha.with_keras_files:
        raise ConfigError("sdmha: load_keras_layer: this build has no Keras file reader")
    return _sdmha.load_keras_layer(_os.fspath(path), dtype_name(dtype), layer_name, num_heads, key_dim,
                                   value_dim, output_dim, use_bias, bool(isolated))


def load_inputs(path, dtype="float32"):
    """sdmha::io::load_inputs: {'query', 'key', 'value', 'attention_mask' (or None), 'has_key'}."""
    _require_io("load_inputs")
    return _sdmha.load_inputs(_os.fspath(path), dtype_name(dtype))


def _require_io(what):
    if not _sdmha.with_io:
        raise ConfigError(f"sdmha: {what}: this build has no sdmha::io (configured with SDMHA_WITH_IO=OFF)")
