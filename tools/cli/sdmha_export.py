#!/usr/bin/env python3
"""Export a Keras or PyTorch attention layer, and its inputs, to files that `sdmha-run` reads.

Tensor names are those of tests/data/goldens/README.md:

    export_keras(layer, "weights.safetensors")  # keras MultiHeadAttention (Keras 3, tf-keras)
    export_torch(module, "weights.safetensors")  # torch.nn.MultiheadAttention
    query = sparse_query_tensors(x)              # tf.SparseTensor / torch sparse (B, T, E),
                                                 # scipy.sparse (B*T, E) with batch=, steps=,
                                                 # or a dense (B, T, E) array
    write_inputs("inputs.safetensors", query, value, key=None, attention_mask=None,
                 attention_bias=None)
    # PyTorch's attn_mask / key_padding_mask: a bool mask (inverted) and a float one (a bias)
    write_inputs(..., **attention_inputs_from_torch(B, T, S, attn_mask, key_padding_mask,
                                                    num_heads=H))

then `sdmha-run --weights weights.safetensors --inputs inputs.safetensors --out out.safetensors`
and `python3 tools/cli/sdmha_compare.py out.safetensors reference.npy` (see tools/cli/README.md).

Only numpy is needed to import this module; Keras, TensorFlow, PyTorch and SciPy are touched only
through the objects you pass in. The safetensors writer and reader here are numpy-only (no
`safetensors` package): an 8-byte little-endian header length, a JSON header padded with spaces
to a multiple of 8 bytes, then the data, laid out largest element first as sdmha's own writer does.

`python3 tools/cli/sdmha_export.py --self-check [--sdmha-run PATH]` checks the numpy-only parts, and
with sdmha-run, runs a random layer through it against a numpy reference of the math.
"""

import json
import os
import sys
import tempfile

try:
    import numpy as np
except ImportError:
    raise ImportError(
        "sdmha_export needs numpy: pip install numpy (Debian: apt-get install python3-numpy)"
    ) from None

__all__ = [
    "export_keras",
    "export_torch",
    "keras_tensors",
    "torch_tensors",
    "sparse_query_tensors",
    "inputs_tensors",
    "write_inputs",
    "attention_mask_from_torch",
    "attention_inputs_from_torch",
    "write_safetensors",
    "read_safetensors",
    "write_npz",
]

# numpy dtype <-> safetensors dtype name, for the dtypes sdmha reads.
_DTYPE_NAMES = {
    np.dtype("float16"): "F16",
    np.dtype("float32"): "F32",
    np.dtype("float64"): "F64",
    np.dtype("int32"): "I32",
    np.dtype("int64"): "I64",
    np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}
_NAME_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_MAX_HEADER_BYTES = 100_000_000  # the limit of sdmha's reader and of the reference implementation


class ExportError(ValueError):
    """An object or array that cannot be exported as asked; the message says what and why."""


# ------------------------------------------------------------------------ safetensors, numpy only


def _as_array(value, what):
    """A framework tensor or variable (Keras, TensorFlow, PyTorch, JAX) or array-like as numpy."""
    if value is None:
        raise ExportError(f"{what} is None")
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # torch.Tensor / torch.nn.Parameter
        value = value.detach()
        if getattr(value, "is_sparse", False):
            raise ExportError(f"{what} is a sparse torch tensor; expected a dense one")
        return value.cpu().numpy()
    if hasattr(value, "numpy"):  # tf.Tensor, tf.Variable, Keras 3 variables on the TF backend
        try:
            return np.asarray(value.numpy())
        except (TypeError, ValueError, AttributeError, NotImplementedError):
            pass
    return np.asarray(value)  # Keras 3 variables and JAX arrays implement __array__


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: array} (and {key: str} metadata) as a safetensors file, atomically.

    Arrays of float16/32/64, int32/64, uint8 and bool are written as F16, F32, F64, I32, I64, U8
    and BOOL, little-endian and C-ordered whatever their layout in memory.
    """
    entries = []
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ExportError(
                f"tensor name {name!r} is not allowed; expected a string other than __metadata__"
            )
        array = _as_array(value, f"tensor '{name}'")
        dtype_name = _DTYPE_NAMES.get(array.dtype.newbyteorder("="))
        if dtype_name is None:
            raise ExportError(
                f"tensor '{name}' has dtype {array.dtype}; expected one of "
                + ", ".join(str(d) for d in _DTYPE_NAMES)
            )
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        entries.append((name, dtype_name, list(array.shape), little.tobytes()))
    # Largest element first, then by name: with the header padded to 8 bytes every tensor starts
    # at a multiple of its element size, as sdmha's SafetensorsWriter lays it out.
    entries.sort(key=lambda entry: (-_NAME_DTYPES[entry[1]].itemsize, entry[0]))

    header = {}
    if metadata:
        header["__metadata__"] = {str(key): str(metadata[key]) for key in sorted(metadata)}
    offset = 0
    for name, dtype_name, shape, data in entries:
        header[name] = {
            "dtype": dtype_name,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)

    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(len(text).to_bytes(8, "little"))
            stream.write(text)
            for entry in entries:
                stream.write(entry[3])
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def read_safetensors(path):
    """Reads a safetensors file: ({name: numpy array}, {key: str} metadata).

    BF16 tensors come back as float32 (exact). The header is checked: length inside the file,
    known dtypes, offsets inside the data and matching each shape.
    """
    with open(path, "rb") as stream:
        data = stream.read()
    if len(data) < 8:
        raise ExportError(f"{path}: file is {len(data)} bytes; expected at least 8")
    length = int.from_bytes(data[:8], "little")
    if length > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ExportError(
            f"{path}: header length {length} does not fit the file of {len(data)} bytes"
        )
    try:
        header = json.loads(data[8 : 8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{path}: header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    buffer = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ExportError(
                f"{path}: tensor '{name}' lacks dtype, shape or data_offsets"
            ) from None
        if dtype_name == "BF16":
            dtype = np.dtype("<u2")
        elif dtype_name in _NAME_DTYPES:
            dtype = _NAME_DTYPES[dtype_name].newbyteorder("<")
        else:
            raise ExportError(f"{path}: tensor '{name}' has unsupported dtype {dtype_name!r}")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ExportError(
                f"{path}: tensor '{name}' has shape {shape}; expected non-negative integers"
            )
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if not (0 <= begin <= end <= len(buffer)) or end - begin != count * dtype.itemsize:
            raise ExportError(
                f"{path}: tensor '{name}' data_offsets [{begin}, {end}] do not hold "
                f"{count} elements of {dtype_name} inside the {len(buffer)}-byte data"
            )
        array = np.frombuffer(buffer[begin:end], dtype=dtype).reshape(shape)
        if dtype_name == "BF16":  # the high half of a float32
            tensors[name] = (array.astype(np.uint32) << 16).view(np.float32)
        else:
            tensors[name] = array.astype(dtype.newbyteorder("="), copy=True)
    return tensors, dict(metadata)


def write_npz(path, tensors, metadata=None):
    """Writes {name: array} as an .npz (numpy.savez), metadata as uint8 arrays "__metadata__/<key>",
    the form sdmha's .npz reader takes metadata in."""
    arrays = {name: _as_array(value, f"tensor '{name}'") for name, value in tensors.items()}
    for key, value in (metadata or {}).items():
        arrays[f"__metadata__/{key}"] = np.frombuffer(str(value).encode("utf-8"), dtype=np.uint8)
    np.savez(path, **arrays)


def _write(path, tensors, metadata):
    if str(path).lower().endswith(".npz"):
        write_npz(path, tensors, metadata)
    else:
        write_safetensors(path, tensors, metadata)


# --------------------------------------------------------------------------- weights


def _attribute(obj, *names):
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def keras_tensors(layer, prefix="", use_causal_mask=False):
    """A Keras MultiHeadAttention layer's weights as ({name: array}, metadata), Keras layout.

    Works with Keras 3 and tf-keras (Keras 2): the layer's four EinsumDense sublayers hold
    query/key/value kernels (E, H, D) and biases (H, D), the output kernel (H, Dv, O) and bias (O).
    use_causal_mask is a call argument in Keras, not part of the layer: pass the one you call with.
    """
    projections = {
        "query": _attribute(layer, "_query_dense", "query_dense"),
        "key": _attribute(layer, "_key_dense", "key_dense"),
        "value": _attribute(layer, "_value_dense", "value_dense"),
        "attention_output": _attribute(layer, "_output_dense", "output_dense"),
    }
    if any(dense is None for dense in projections.values()):
        raise ExportError(
            f"{type(layer).__name__} has no query/key/value/output dense sublayers; "
            "expected a keras.layers.MultiHeadAttention that has been built (call it once)"
        )
    tensors = {}
    for name, dense in projections.items():
        kernel = getattr(dense, "kernel", None)
        if kernel is None:
            raise ExportError(
                f"the layer's {name} projection has no kernel yet; build the layer "
                "(call it once on example inputs) before exporting"
            )
        tensors[f"{prefix}{name}/kernel"] = _as_array(kernel, f"{name}/kernel")
        bias = getattr(dense, "bias", None)
        if bias is not None:
            tensors[f"{prefix}{name}/bias"] = _as_array(bias, f"{name}/bias")

    query_kernel = tensors[f"{prefix}query/kernel"]
    value_kernel = tensors[f"{prefix}value/kernel"]
    output_kernel = tensors[f"{prefix}attention_output/kernel"]
    if query_kernel.ndim != 3 or value_kernel.ndim != 3 or output_kernel.ndim != 3:
        raise ExportError(
            "the layer's kernels have ranks "
            f"{query_kernel.ndim}, {value_kernel.ndim}, {output_kernel.ndim}; sdmha takes "
            "(B, T, E) inputs with the default attention_axes and a 1-D output_shape, "
            "i.e. rank-3 kernels"
        )
    heads, key_dim, value_dim = query_kernel.shape[1], query_kernel.shape[2], value_kernel.shape[2]
    declared = _attribute(layer, "num_heads", "_num_heads")
    if declared is not None and int(declared) != heads:
        raise ExportError(
            f"the layer says num_heads = {declared} but its query kernel holds {heads} heads"
        )
    metadata = {
        "num_heads": str(heads),
        "key_dim": str(key_dim),
        "value_dim": str(value_dim),
        "layout": "keras",
        "use_causal_mask": "true" if use_causal_mask else "false",
    }
    return tensors, metadata


def export_keras(layer, path, prefix="", use_causal_mask=False):
    """Writes a Keras MultiHeadAttention layer's weights to `path` (.safetensors, or .npz)."""
    tensors, metadata = keras_tensors(layer, prefix, use_causal_mask)
    _write(path, tensors, metadata)
    return metadata


def torch_tensors(module, use_causal_mask=False):
    """A torch.nn.MultiheadAttention's weights as ({name: array}, metadata), PyTorch layout.

    in_proj_weight (3E, E) when q, k, v share E, else q_proj_weight (E, E), k_proj_weight (E, kdim),
    v_proj_weight (E, vdim); in_proj_bias (3E) and out_proj.bias (E) when bias=True;
    out_proj.weight (E, E).
    """
    if _attribute(module, "bias_k") is not None or _attribute(module, "bias_v") is not None:
        raise ExportError(
            "the module was built with add_bias_kv=True, which sdmha does not support"
        )
    if getattr(module, "add_zero_attn", False):
        raise ExportError(
            "the module was built with add_zero_attn=True, which sdmha does not support"
        )
    out_proj = _attribute(module, "out_proj")
    heads = _attribute(module, "num_heads")
    if out_proj is None or heads is None:
        raise ExportError(f"{type(module).__name__} is not a torch.nn.MultiheadAttention")
    tensors = {}
    if getattr(module, "in_proj_weight", None) is not None:
        tensors["in_proj_weight"] = _as_array(module.in_proj_weight, "in_proj_weight")
    else:
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            tensors[name] = _as_array(getattr(module, name), name)
    if getattr(module, "in_proj_bias", None) is not None:
        tensors["in_proj_bias"] = _as_array(module.in_proj_bias, "in_proj_bias")
    tensors["out_proj.weight"] = _as_array(out_proj.weight, "out_proj.weight")
    if getattr(out_proj, "bias", None) is not None:
        tensors["out_proj.bias"] = _as_array(out_proj.bias, "out_proj.bias")
    embed_dim = tensors["out_proj.weight"].shape[1]
    if embed_dim % int(heads) != 0:
        raise ExportError(f"embed_dim {embed_dim} is not divisible by num_heads {heads}")
    head_dim = embed_dim // int(heads)
    metadata = {
        "num_heads": str(int(heads)),
        "key_dim": str(head_dim),
        "value_dim": str(head_dim),
        "layout": "torch",
        "use_causal_mask": "true" if use_causal_mask else "false",
    }
    return tensors, metadata


def export_torch(module, path, use_causal_mask=False):
    """Writes a torch.nn.MultiheadAttention's weights to `path` (.safetensors, or .npz)."""
    tensors, metadata = torch_tensors(module, use_causal_mask)
    _write(path, tensors, metadata)
    return metadata


# --------------------------------------------------------------------------- inputs


def _query_arrays_from(x, batch, steps):
    """(indices (nnz, 3), values (nnz,), dense_shape (3,)) of a supported sparse or dense query."""
    module = type(x).__module__
    # torch sparse tensors: COO directly, CSR/CSC/BSR through to_sparse_coo().
    if module.startswith("torch") and hasattr(x, "layout"):
        import torch  # noqa: F401  (the object is a torch tensor, so torch is installed)

        if x.layout != torch.sparse_coo:
            if x.layout == torch.strided:
                x = x.to_sparse()
            else:
                x = x.to_sparse_coo()
        x = x.detach().coalesce()
        if x.sparse_dim() != 3 or x.dense_dim() != 0:
            raise ExportError(
                f"the torch sparse tensor has {x.sparse_dim()} sparse and {x.dense_dim()} "
                "dense dimensions; expected (B, T, E) with all three sparse"
            )
        return (
            x.indices().cpu().numpy().T,
            x.values().cpu().numpy(),
            np.array(x.shape, dtype=np.int64),
        )
    # tf.SparseTensor (and tf.compat.v1.SparseTensorValue).
    if hasattr(x, "indices") and hasattr(x, "values") and hasattr(x, "dense_shape"):
        return (
            _as_array(x.indices, "indices"),
            _as_array(x.values, "values"),
            _as_array(x.dense_shape, "dense_shape"),
        )
    # scipy.sparse matrices and arrays: (B*T, E) rows, b = row // T, t = row % T.
    if hasattr(x, "tocoo") and getattr(x, "ndim", 2) == 2:
        coo = x.tocoo(copy=True)
        coo.sum_duplicates()
        rows_total, features = coo.shape
        if batch is None and steps is None:
            raise ExportError("a scipy.sparse matrix holds B*T rows; pass batch= and/or steps=")
        if steps is None:
            steps = rows_total // batch if batch else 0
        if batch is None:
            batch = rows_total // steps if steps else 0
        if batch * steps != rows_total:
            raise ExportError(
                f"the scipy.sparse matrix has {rows_total} rows; expected batch * steps = "
                f"{batch} * {steps} = {batch * steps}"
            )
        rows = coo.row.astype(np.int64)
        indices = np.stack([rows // steps, rows % steps, coo.col.astype(np.int64)], axis=1)
        return indices, coo.data, np.array([batch, steps, features], dtype=np.int64)
    # A dense (B, T, E) array: its nonzeros.
    dense = _as_array(x, "query")
    if dense.ndim != 3:
        raise ExportError(
            f"the query has shape {dense.shape}; expected a tf.SparseTensor, a torch sparse "
            "tensor, a scipy.sparse matrix with batch/steps, or a dense (B, T, E) array"
        )
    indices = np.argwhere(dense != 0)
    return indices, dense[tuple(indices.T)], np.array(dense.shape, dtype=np.int64)


def sparse_query_tensors(x, batch=None, steps=None):
    """The query tensors query/indices (int64 nnz x 3, row-major order), query/values and
    query/dense_shape (int64 [B, T, E]) from a tf.SparseTensor (B, T, E), a torch sparse tensor
    (B, T, E), a scipy.sparse matrix (B*T, E) plus batch and/or steps, or a dense (B, T, E) array.

    Floating values keep their dtype (it sets the precision sdmha-run runs in); other values
    become float32. Coordinates must lie inside the dense shape.
    """
    indices, values, dense_shape = _query_arrays_from(x, batch, steps)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1, 3)
    values = np.asarray(values).reshape(-1)
    dense_shape = np.asarray(dense_shape, dtype=np.int64).reshape(-1)
    if dense_shape.shape != (3,):
        raise ExportError(f"the query's dense shape is {dense_shape.tolist()}; expected (B, T, E)")
    if len(values) != len(indices):
        raise ExportError(f"the query has {len(indices)} coordinates but {len(values)} values")
    if len(indices) and ((indices < 0).any() or (indices >= dense_shape).any()):
        bad = int(np.argmax(((indices < 0) | (indices >= dense_shape)).any(axis=1)))
        raise ExportError(
            f"query coordinate {indices[bad].tolist()} (entry {bad}) is outside the dense "
            f"shape {dense_shape.tolist()}"
        )
    if not np.issubdtype(values.dtype, np.floating):
        values = values.astype(np.float32)
    order = np.lexsort((indices[:, 2], indices[:, 1], indices[:, 0]))
    return {
        "query/indices": np.ascontiguousarray(indices[order]),
        "query/values": np.ascontiguousarray(values[order]),
        "query/dense_shape": dense_shape,
    }


_BROADCAST_SHAPES = "(T, S), (B, T, S), (B, 1, T, S), (B, H, T, S) or (1, H, T, S)"


def _torch_attn_mask(attn_mask, batch, steps, key_steps, num_heads):
    """PyTorch's attn_mask as an array of rank 2 (T, S) or 4 (B', H', T, S); 3-D is (N*H, L, S)."""
    mask = _as_array(attn_mask, "attn_mask")
    if mask.dtype != np.bool_ and mask.dtype.kind != "f":
        raise ExportError(
            f"attn_mask has dtype {mask.dtype}; expected bool (True = blocked) or floating point "
            "(added to the scores), as PyTorch reads it (convert a uint8 mask with .bool())"
        )
    shape = mask.shape
    expected = (
        f"expected (L, S) = ({steps}, {key_steps}), (N*H, L, S) = "
        f"({batch}*{num_heads if num_heads else 'H'}, {steps}, {key_steps}) or (N, H, L, S)"
    )
    if mask.ndim < 2 or mask.ndim > 4 or shape[-2:] != (steps, key_steps):
        raise ExportError(f"attn_mask has shape {shape}; {expected}")
    if mask.ndim == 3:
        if num_heads is None:
            raise ExportError(
                f"attn_mask has shape {shape}, PyTorch's per-head (N*H, L, S); pass num_heads= to "
                f"read it as (N, H, L, S) ({expected})"
            )
        if shape[0] != batch * num_heads:
            raise ExportError(
                f"attn_mask has shape {shape}; its first dimension {shape[0]} is not "
                f"N*H = {batch}*{num_heads} = {batch * num_heads}; {expected}"
            )
        mask = mask.reshape(batch, num_heads, steps, key_steps)
    elif mask.ndim == 4:
        heads_ok = shape[1] == 1 or num_heads is None or shape[1] == num_heads
        if shape[0] not in (1, batch) or not heads_ok:
            raise ExportError(f"attn_mask has shape {shape}; {expected} with N or H possibly 1")
    return mask


def _key_padding(key_padding_mask, batch, key_steps):
    padding = _as_array(key_padding_mask, "key_padding_mask")
    if padding.dtype != np.bool_:
        raise ExportError(
            f"key_padding_mask has dtype {padding.dtype}; expected bool (True = padding)"
        )
    if padding.shape != (batch, key_steps):
        raise ExportError(
            f"key_padding_mask has shape {padding.shape}; expected (B, S) = ({batch}, {key_steps})"
        )
    return padding


def _as_four(array):
    """(T, S) -> (1, 1, T, S), (B, T, S) -> (B, 1, T, S): sdmha's reading of the ranks."""
    if array.ndim == 2:
        return array[None, None]
    return array[:, None] if array.ndim == 3 else array


def attention_inputs_from_torch(
    batch, steps, key_steps, attn_mask=None, key_padding_mask=None, num_heads=None
):
    """PyTorch's masks as sdmha's inputs: {"attention_mask": bool or None (True = may attend),
    "attention_bias": float or None (added to the scaled scores)}, for write_inputs(**result).

    attn_mask (nn.MultiheadAttention / scaled_dot_product_attention):
      bool   True = blocked; inverted into attention_mask.
      float  added to the scores; it becomes attention_bias as it is: 0, -inf and large
             negatives (-1e9, finfo.min) alike are kept as bias values (-inf blocks in sdmha as in
             PyTorch; a large negative weighs as in PyTorch, not as a block).
      (L, S) stays (T, S); (N*H, L, S) is read as (N, H, L, S) (needs num_heads, checks N*H);
      (N, H, L, S) with N or H possibly 1 stays as it is.
    key_padding_mask: bool (B, S), True = padding; ANDed into attention_mask.
    Other shapes or dtypes raise ExportError (a ValueError) naming the argument and its shape.
    """
    mask = bias = None
    if attn_mask is not None:
        converted = _torch_attn_mask(attn_mask, batch, steps, key_steps, num_heads)
        if converted.dtype == np.bool_:
            mask = ~converted
        else:
            bias = converted
    if key_padding_mask is not None:
        allowed = ~_key_padding(key_padding_mask, batch, key_steps)[:, None, :]  # (B, 1, S)
        if mask is None:
            mask = np.broadcast_to(allowed, (batch, steps, key_steps))
        elif mask.ndim == 2:
            mask = mask[None] & allowed
        else:
            mask = mask & allowed[:, None]
    if mask is not None:
        mask = np.ascontiguousarray(mask)
    return {"attention_mask": mask, "attention_bias": bias}


def attention_mask_from_torch(
    batch, steps, key_steps, attn_mask=None, key_padding_mask=None, num_heads=None
):
    """PyTorch's bool masks as one boolean attention_mask, Keras' polarity (True = may attend):
    (B, T, S), or (B, H, T, S) for per-head masks ((N*H, L, S) with num_heads, or (N, H, L, S)).

    attn_mask: bool, True = blocked. A float attn_mask is an additive bias, not a mask: this
    function refuses it; attention_inputs_from_torch turns it into attention_bias.
    key_padding_mask: (B, S) boolean, True = padding.
    """
    if attn_mask is not None:
        array = _as_array(attn_mask, "attn_mask")
        if array.dtype != np.bool_:
            raise ExportError(
                f"attn_mask has dtype {array.dtype}; attention_mask_from_torch takes bool masks "
                "(True = blocked). A float attn_mask is added to the scores: use "
                "attention_inputs_from_torch, which makes it attention_bias"
            )
    inputs = attention_inputs_from_torch(
        batch, steps, key_steps, attn_mask, key_padding_mask, num_heads
    )
    mask = inputs["attention_mask"]
    if mask is None:
        return np.ones((batch, steps, key_steps), dtype=bool)
    if mask.ndim == 2:
        return np.ascontiguousarray(np.broadcast_to(mask, (batch, steps, key_steps)))
    if mask.ndim == 4:
        return np.ascontiguousarray(np.broadcast_to(mask, (batch,) + mask.shape[1:]))
    return mask


def _broadcast_input(array, name, batch, steps, key_steps):
    """Checks a mask or bias shape: (T, S), (B', T, S) or (B', H', T, S) with B' in {1, B}."""
    shape = array.shape
    ok = (
        2 <= array.ndim <= 4
        and shape[-2:] == (steps, key_steps)
        and (array.ndim == 2 or shape[0] in (1, batch))
    )
    if not ok:
        raise ExportError(
            f"{name} has shape {shape}; expected {_BROADCAST_SHAPES} with (B, T, S) = "
            f"({batch}, {steps}, {key_steps}) and H the layer's heads"
        )
    return np.ascontiguousarray(array)


def inputs_tensors(query, value, key=None, attention_mask=None, attention_bias=None):
    """{name: array} of a layer call's inputs: query (the dict of sparse_query_tensors, or anything
    it takes without batch/steps), value (B, S, Ev), key (B, S, Ek) or None for key = value,
    attention_mask bool in Keras' polarity (True = may attend) and attention_bias float (added to
    the scaled scores), each (T, S), (B, T, S), (B, 1, T, S), (B, H, T, S), (1, H, T, S) or None.

    value, key and attention_bias are cast to the query values' dtype (float32 unless float64),
    the precision sdmha-run will run in; attention_mask is written as BOOL.
    """
    if not (isinstance(query, dict) and "query/indices" in query):
        query = sparse_query_tensors(query)
    batch, steps, _ = (int(d) for d in query["query/dense_shape"])
    dtype = query["query/values"].dtype
    tensors = dict(query)
    value = _as_array(value, "value")
    if value.ndim != 3 or value.shape[0] != batch:
        raise ExportError(f"value has shape {value.shape}; expected (B, S, Ev) with B = {batch}")
    tensors["value"] = value.astype(dtype, copy=False)
    if key is not None:
        key = _as_array(key, "key")
        if key.ndim != 3 or key.shape[:2] != value.shape[:2]:
            raise ExportError(
                f"key has shape {key.shape}; expected (B, S, Ek) with (B, S) = {value.shape[:2]}"
            )
        tensors["key"] = key.astype(dtype, copy=False)
    key_steps = value.shape[1]
    if attention_mask is not None:
        mask = _as_array(attention_mask, "attention_mask")
        if mask.dtype.kind == "f":
            raise ExportError(
                f"attention_mask has dtype {mask.dtype}; expected bool (True = may attend). A float "
                "mask is an additive bias: pass it as attention_bias (attention_inputs_from_torch "
                "converts PyTorch's attn_mask)"
            )
        if mask.dtype != np.bool_ and not np.isin(mask, (0, 1)).all():
            raise ExportError(
                f"attention_mask has dtype {mask.dtype} with values other than 0 and 1; "
                "expected bool (True = may attend)"
            )
        mask = _broadcast_input(mask, "attention_mask", batch, steps, key_steps)
        tensors["attention_mask"] = mask.astype(bool)
    if attention_bias is not None:
        bias = _as_array(attention_bias, "attention_bias")
        if bias.dtype.kind != "f":
            raise ExportError(
                f"attention_bias has dtype {bias.dtype}; expected floating point (added to the scores)"
            )
        bias = _broadcast_input(bias, "attention_bias", batch, steps, key_steps)
        bias_dtype = np.float64 if dtype == np.float64 else np.float32
        tensors["attention_bias"] = bias.astype(bias_dtype, copy=False)
    return tensors


def write_inputs(path, query, value, key=None, attention_mask=None, attention_bias=None):
    """Writes a layer call's inputs (see inputs_tensors) to `path` (.safetensors, or .npz)."""
    _write(path, inputs_tensors(query, value, key, attention_mask, attention_bias), None)


# --------------------------------------------------------------------------- self-check


def _reference_attention(tensors, metadata, causal):
    """The goldens' math (tests/data/goldens/README.md) in float64 numpy, Keras layout."""
    shape = tensors["query/dense_shape"]
    x = np.zeros(tuple(shape))
    np.add.at(x, tuple(tensors["query/indices"].T), tensors["query/values"].astype(np.float64))
    value = tensors["value"].astype(np.float64)
    key = tensors.get("key", tensors["value"]).astype(np.float64)
    q = np.einsum("bte,ehd->bthd", x, tensors["query/kernel"]) + tensors["query/bias"]
    k = np.einsum("bse,ehd->bshd", key, tensors["key/kernel"]) + tensors["key/bias"]
    v = np.einsum("bse,ehd->bshd", value, tensors["value/kernel"]) + tensors["value/bias"]
    scores = np.einsum("bthd,bshd->bhts", q / np.sqrt(int(metadata["key_dim"])), k)
    allowed = np.ones((shape[0], 1, shape[1], key.shape[1]), dtype=bool)
    if "attention_mask" in tensors:
        allowed = allowed & _as_four(tensors["attention_mask"])
    if causal:
        allowed = allowed & np.tril(np.ones((shape[1], key.shape[1]), dtype=bool))
    if "attention_bias" in tensors:
        bias = _as_four(tensors["attention_bias"].astype(np.float64))
        allowed = allowed & (bias != -np.inf)
        scores = scores + np.where(allowed, bias, 0.0)
    allowed = np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    exp = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0.0)
    total = exp.sum(axis=-1, keepdims=True)
    probs = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    attended = np.einsum("bhts,bshd->bthd", probs, v)
    output = np.einsum("bthd,hdo->bto", attended, tensors["attention_output/kernel"])
    return output + tensors["attention_output/bias"], probs


def _self_check(sdmha_run=None):
    import subprocess

    rng = np.random.default_rng(7)
    failures = []

    def check(condition, what):
        print(("ok   " if condition else "FAIL ") + what)
        if not condition:
            failures.append(what)

    with tempfile.TemporaryDirectory() as directory:
        # 1. Round trip of every dtype, with metadata, and the BF16 reader.
        arrays = {
            "f16": rng.standard_normal((2, 3)).astype(np.float16),
            "f32": rng.standard_normal((4,)).astype(np.float32),
            "f64": rng.standard_normal((2, 2, 2)),
            "i32": np.arange(5, dtype=np.int32),
            "i64": np.arange(6, dtype=np.int64).reshape(3, 2),
            "u8": np.arange(3, dtype=np.uint8),
            "bool": np.array([[True, False], [False, True]]),
            "empty": np.zeros((0, 3), dtype=np.float32),
            "scalar": np.array(2.5),
            "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
            "big_endian": np.arange(4, dtype=">f8"),
        }
        path = os.path.join(directory, "round_trip.safetensors")
        write_safetensors(path, arrays, {"num_heads": 2, "layout": "keras"})
        back, metadata = read_safetensors(path)
        check(
            set(back) == set(arrays)
            and all(
                np.array_equal(back[n], arrays[n])
                and back[n].dtype == arrays[n].dtype.newbyteorder("=")
                for n in arrays
            ),
            "write_safetensors -> read_safetensors keeps every dtype, shape and value",
        )
        check(
            metadata == {"layout": "keras", "num_heads": "2"},
            "metadata round trip (values as strings)",
        )
        raw = open(path, "rb").read()
        header_length = int.from_bytes(raw[:8], "little")
        check(
            header_length % 8 == 0
            and raw[8 + header_length - 1 : 8 + header_length] in (b" ", b"}"),
            "header padded with spaces to a multiple of 8 bytes",
        )
        header = json.loads(raw[8 : 8 + header_length])
        check(
            all(
                header[n]["data_offsets"][0] % np.dtype(_NAME_DTYPES[header[n]["dtype"]]).itemsize
                == 0
                for n in arrays
            ),
            "every tensor starts at a multiple of its element size",
        )
        bf16 = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
        bits = (bf16.view(np.uint32) >> 16).astype("<u2").tobytes()
        text = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(directory, "bf16.safetensors"), "wb") as stream:
            stream.write(len(text).to_bytes(8, "little") + text + bits)
        check(
            np.array_equal(
                read_safetensors(os.path.join(directory, "bf16.safetensors"))[0]["x"], bf16
            ),
            "BF16 is read as float32",
        )
        for name, content in {
            "truncated": raw[: len(raw) - 3],
            "short": raw[:5],
            "bad_json": (16).to_bytes(8, "little") + b"{not json}      ",
        }.items():
            bad = os.path.join(directory, name + ".safetensors")
            with open(bad, "wb") as stream:
                stream.write(content)
            try:
                read_safetensors(bad)
                check(False, f"read_safetensors rejects a {name} file")
            except ExportError as error:
                check(True, f"read_safetensors rejects a {name} file ({error})")

        # 2. Sparse query conversion from a dense array, and from scipy when it is installed.
        dense = rng.standard_normal((2, 5, 6)) * (rng.random((2, 5, 6)) < 0.3)
        dense[1, 3] = 0.0  # a query row with no stored values
        query = sparse_query_tensors(dense)
        rebuilt = np.zeros((2, 5, 6))
        rebuilt[tuple(query["query/indices"].T)] = query["query/values"]
        check(
            np.array_equal(rebuilt, dense) and query["query/dense_shape"].tolist() == [2, 5, 6],
            "sparse_query_tensors(dense array) keeps every nonzero",
        )
        check(
            np.all(np.diff(query["query/indices"] @ np.array([30, 6, 1])) > 0),
            "query/indices are in row-major order without duplicates",
        )
        try:
            import scipy.sparse

            from_scipy = sparse_query_tensors(
                scipy.sparse.csr_matrix(dense.reshape(10, 6)), batch=2
            )
            check(
                all(np.array_equal(from_scipy[n], query[n]) for n in query),
                "sparse_query_tensors(scipy.sparse, batch=2) equals the dense conversion",
            )
        except ImportError:
            print("skip scipy.sparse conversion (scipy is not installed)")
        try:
            sparse_query_tensors(dense.reshape(10, 6))
            check(False, "a 2-D dense query is rejected")
        except ExportError:
            check(True, "a 2-D dense query is rejected")

        # PyTorch's masks: float -> bias kept as values, bool -> inverted mask, (N*H, L, S) ->
        # (N, H, L, S), key padding ANDed, anything else refused with its name and shape.
        float_mask = rng.standard_normal((2 * 3, 5, 5))
        float_mask[0, 1, 2], float_mask[3, 0, 4] = -np.inf, -1e9
        padding = np.zeros((2, 5), dtype=bool)
        padding[1, 3] = True
        converted = attention_inputs_from_torch(2, 5, 5, float_mask, padding, num_heads=3)
        check(
            np.array_equal(converted["attention_bias"], float_mask.reshape(2, 3, 5, 5))
            and np.array_equal(converted["attention_mask"], ~padding[:, None].repeat(5, 1)),
            "a float attn_mask (N*H, L, S) becomes attention_bias (N, H, L, S) with -inf and -1e9 "
            "kept; key_padding_mask becomes the mask",
        )
        blocked = rng.random((5, 5)) < 0.3
        converted = attention_inputs_from_torch(2, 5, 5, blocked)
        check(
            converted["attention_bias"] is None
            and np.array_equal(converted["attention_mask"], ~blocked),
            "a bool attn_mask (L, S) is inverted into attention_mask (T, S)",
        )
        for bad, what in (
            (np.zeros((7, 5, 5), dtype=bool), "(N*H, L, S) whose N*H is not 2*3"),
            (np.zeros((5, 5), dtype=np.int64), "an integer attn_mask"),
        ):
            try:
                attention_inputs_from_torch(2, 5, 5, bad, num_heads=3)
                check(False, f"{what} is refused")
            except ExportError as error:
                check("attn_mask" in str(error), f"{what} is refused ({error})")

        # 3. A random Keras-layout layer through sdmha-run, against the numpy reference.
        if sdmha_run is None:
            print("skip sdmha-run comparison (pass --sdmha-run PATH)")
        else:
            heads, key_dim, value_dim, eq, ek, ev, out = 3, 4, 5, 6, 7, 8, 9
            weights = {
                "query/kernel": rng.standard_normal((eq, heads, key_dim)) * 0.3,
                "query/bias": rng.standard_normal((heads, key_dim)) * 0.1,
                "key/kernel": rng.standard_normal((ek, heads, key_dim)) * 0.3,
                "key/bias": rng.standard_normal((heads, key_dim)) * 0.1,
                "value/kernel": rng.standard_normal((ev, heads, value_dim)) * 0.3,
                "value/bias": rng.standard_normal((heads, value_dim)) * 0.1,
                "attention_output/kernel": rng.standard_normal((heads, value_dim, out)) * 0.3,
                "attention_output/bias": rng.standard_normal((out,)) * 0.1,
            }
            metadata = {
                "num_heads": str(heads),
                "key_dim": str(key_dim),
                "value_dim": str(value_dim),
                "layout": "keras",
                "use_causal_mask": "true",
            }
            inputs = inputs_tensors(
                dense,
                value=rng.standard_normal((2, 5, ev)),
                key=rng.standard_normal((2, 5, ek)),
                attention_mask=rng.random((2, 5, 5)) < 0.8,
            )
            torch_mask = rng.standard_normal((2 * heads, 5, 5))
            torch_mask[rng.random(torch_mask.shape) < 0.2] = -np.inf
            torch_mask[:, :, 0] = 0.0  # no row blocked by the bias alone
            bias_inputs = inputs_tensors(
                dense,
                value=inputs["value"],
                key=inputs["key"],
                **attention_inputs_from_torch(
                    2, 5, 5, torch_mask, rng.random((2, 5)) < 0.3, num_heads=heads
                ),
            )
            weights_path = os.path.join(directory, "weights.safetensors")
            write_safetensors(weights_path, weights, metadata)
            for suffix, writer, inputs in (
                (".safetensors", write_safetensors, inputs),
                (".npz", write_npz, inputs),
                ("_bias.safetensors", write_safetensors, bias_inputs),
            ):
                inputs_path = os.path.join(directory, "inputs" + suffix)
                writer(inputs_path, inputs)
                out_path = os.path.join(directory, "out.safetensors")
                run = subprocess.run(
                    [
                        sdmha_run,
                        "--weights",
                        weights_path,
                        "--inputs",
                        inputs_path,
                        "--out",
                        out_path,
                        "--scores",
                    ],
                    capture_output=True,
                    text=True,
                )
                check(
                    run.returncode == 0,
                    f"sdmha-run on {suffix} inputs exits 0 {run.stderr.strip()}",
                )
                if run.returncode == 0:
                    result, result_metadata = read_safetensors(out_path)
                    expected_output, expected_scores = _reference_attention(
                        {**weights, **inputs}, metadata, True
                    )
                    error = max(
                        np.max(np.abs(result["output"] - expected_output)),
                        np.max(np.abs(result["attention_scores"] - expected_scores)),
                    )
                    check(
                        error < 1e-12,
                        f"sdmha-run agrees with the numpy reference (max |error| = {error:.2e})",
                    )
                    check(
                        result_metadata.get("use_causal_mask") == "true",
                        "the causal flag came from the metadata",
                    )
                    # sdmha's writer and this one lay out the same tensors byte for byte.
                    rewritten = os.path.join(directory, "rewritten.safetensors")
                    write_safetensors(rewritten, result, result_metadata)
                    check(
                        open(rewritten, "rb").read() == open(out_path, "rb").read(),
                        "write_safetensors writes sdmha-run's output byte for byte",
                    )

        # 4. The exporters' names and metadata, on stand-ins that carry a golden case's weights the
        # way a Keras layer and a torch module hold them (Keras and PyTorch are not needed).
        goldens = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "goldens"
        )
        if sdmha_run is None or not os.path.isdir(goldens):
            print(
                "skip the exporters through sdmha-run "
                "(pass --sdmha-run PATH; needs tests/data/goldens)"
            )
        else:

            class Holder:
                def __init__(self, **fields):
                    self.__dict__.update(fields)

            def run_and_compare(weights_path, golden_path, label):
                out_path = os.path.join(directory, "exported_out.safetensors")
                run = subprocess.run(
                    [
                        sdmha_run,
                        "--weights",
                        weights_path,
                        "--inputs",
                        golden_path,
                        "--out",
                        out_path,
                        "--scores",
                    ],
                    capture_output=True,
                    text=True,
                )
                if run.returncode != 0:
                    check(False, f"{label}: sdmha-run failed: {run.stderr.strip()}")
                    return
                result, _ = read_safetensors(out_path)
                expected, _ = read_safetensors(golden_path)
                error = np.max(np.abs(result["output"] - expected["expected/output"]))
                check(
                    error < 1e-10,
                    f"{label}: sdmha-run matches the golden (max |error| = {error:.2e})",
                )

            golden_path = os.path.join(goldens, "keras_basic_f64.safetensors")
            golden, _ = read_safetensors(golden_path)
            dense_layer = {
                name: Holder(kernel=golden[f"{name}/kernel"], bias=golden[f"{name}/bias"])
                for name in ("query", "key", "value", "attention_output")
            }
            keras_layer = Holder(
                _query_dense=dense_layer["query"],
                _key_dense=dense_layer["key"],
                _value_dense=dense_layer["value"],
                _output_dense=dense_layer["attention_output"],
                _num_heads=golden["query/kernel"].shape[1],
            )
            exported = os.path.join(directory, "keras_weights.safetensors")
            metadata = export_keras(keras_layer, exported, prefix="multi_head_attention/")
            names = set(read_safetensors(exported)[0])
            check(
                "multi_head_attention/query/kernel" in names
                and len(names) == 8
                and metadata["layout"] == "keras"
                and metadata["num_heads"] == "2",
                "export_keras writes the eight prefixed Keras names and their metadata",
            )
            run_and_compare(exported, golden_path, "export_keras")

            golden_path = os.path.join(goldens, "torch_packed_f64.safetensors")
            golden, _ = read_safetensors(golden_path)
            torch_module = Holder(
                num_heads=4,
                in_proj_weight=golden["in_proj_weight"],
                in_proj_bias=golden["in_proj_bias"],
                bias_k=None,
                bias_v=None,
                add_zero_attn=False,
                out_proj=Holder(weight=golden["out_proj.weight"], bias=golden["out_proj.bias"]),
            )
            exported = os.path.join(directory, "torch_weights.safetensors")
            metadata = export_torch(torch_module, exported)
            check(
                metadata["layout"] == "torch"
                and metadata["num_heads"] == "4"
                and set(read_safetensors(exported)[0])
                == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"},
                "export_torch writes the packed PyTorch names and their metadata",
            )
            run_and_compare(exported, golden_path, "export_torch")

            sparse = Holder(
                indices=golden["query/indices"][::-1],
                values=golden["query/values"][::-1],
                dense_shape=golden["query/dense_shape"],
            )
            query = sparse_query_tensors(sparse)
            check(
                all(np.array_equal(query[n], golden[n]) for n in query),
                "sparse_query_tensors(SparseTensor-like, unordered) gives the golden's query",
            )

    print(f"{len(failures)} failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-check", action="store_true", help="check the numpy-only parts")
    parser.add_argument(
        "--sdmha-run", help="also run this sdmha-run binary against a numpy reference"
    )
    arguments = parser.parse_args()
    if not arguments.self_check:
        parser.print_help()
        sys.exit(0)
    sys.exit(_self_check(arguments.sdmha_run))
