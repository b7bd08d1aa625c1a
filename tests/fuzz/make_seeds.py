#!/usr/bin/env python3
"""Writes the crafted seeds of tests/fuzz/corpus/: small valid files and corrupt variants.

The seeds are checked in; rerun this (standard library only) after changing it:
    python3 tests/fuzz/make_seeds.py
Files are written under tests/fuzz/corpus/<target>/crafted_*.
"""
import json
import os
import struct
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def out(target, name, data):
    directory = os.path.join(HERE, "corpus", target)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "crafted_" + name), "wb") as f:
        f.write(data)


# ---- safetensors ----

def safetensors(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw bytes); laid out in order, header padded to 8."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def f64(values):
    return struct.pack("<%dd" % len(values), *values)


def i64(values):
    return struct.pack("<%dq" % len(values), *values)


def ramp(count, scale=0.1):
    return [((i * 7) % 11 - 5) * scale for i in range(count)]


def keras_layer(eq=3, ek=3, ev=3, heads=2, dk=2, dv=2, o=3, bias=True):
    tensors = [
        ("query/kernel", "F64", [eq, heads, dk], f64(ramp(eq * heads * dk))),
        ("key/kernel", "F64", [ek, heads, dk], f64(ramp(ek * heads * dk))),
        ("value/kernel", "F64", [ev, heads, dv], f64(ramp(ev * heads * dv))),
        ("attention_output/kernel", "F64", [heads, dv, o], f64(ramp(heads * dv * o))),
    ]
    if bias:
        tensors += [
            ("query/bias", "F64", [heads, dk], f64(ramp(heads * dk))),
            ("key/bias", "F64", [heads, dk], f64(ramp(heads * dk))),
            ("value/bias", "F64", [heads, dv], f64(ramp(heads * dv))),
            ("attention_output/bias", "F64", [o], f64(ramp(o))),
        ]
    return tensors


def inputs(dense_shape, indices, values, value_shape, mask=None):
    tensors = [
        ("query/dense_shape", "I64", [3], i64(dense_shape)),
        ("query/indices", "I64", [len(indices), 3], i64([c for entry in indices for c in entry])),
        ("query/values", "F64", [len(values)], f64(values)),
    ]
    count = 1
    for d in value_shape:
        count *= d
    tensors.append(("value", "F64", value_shape, f64(ramp(count))))
    if mask is not None:
        tensors.append(("attention_mask", "BOOL", [len(mask), len(mask[0]), len(mask[0][0])],
                        bytes(int(x) for plane in mask for row in plane for x in row)))
    return tensors


def write_safetensors_seeds():
    t = "fuzz_safetensors"
    small = inputs([2, 2, 3], [[0, 0, 1], [0, 1, 2], [1, 0, 0], [1, 0, 0]], [1.0, -2.0, 0.5, 0.25], [2, 3, 3],
                   mask=[[[1, 0, 1], [0, 0, 0]], [[1, 1, 1], [1, 1, 0]]])
    out(t, "small_layer.safetensors", safetensors(keras_layer() + small, {"use_causal_mask": "true"}))
    out(t, "small_no_bias.safetensors", safetensors(keras_layer(bias=False) + small))
    torch_e = 4
    out(t, "small_torch.safetensors", safetensors([
        ("in_proj_weight", "F64", [3 * torch_e, torch_e], f64(ramp(3 * torch_e * torch_e))),
        ("in_proj_bias", "F64", [3 * torch_e], f64(ramp(3 * torch_e))),
        ("out_proj.weight", "F64", [torch_e, torch_e], f64(ramp(torch_e * torch_e))),
        ("out_proj.bias", "F64", [torch_e], f64(ramp(torch_e))),
    ] + inputs([1, 2, 4], [[0, 1, 3]], [2.0], [1, 2, 4]), {"num_heads": "2", "layout": "torch"}))
    # Zero-size dimensions next to huge ones: shape products that must not overflow anywhere.
    big = 2 ** 32
    empty = lambda shape: ("F64", shape, b"")
    out(t, "heads_overflow.safetensors", safetensors([
        ("query/kernel",) + empty([0, big, big]), ("key/kernel",) + empty([0, big, big]),
        ("value/kernel",) + empty([0, big, 1]), ("attention_output/kernel",) + empty([big, 1, 0])]))
    no_entries = [("query/indices", "I64", [0, 3], b""), ("query/values", "F64", [0], b"")]
    out(t, "zero_batch_huge_steps.safetensors", safetensors(keras_layer() + [
        ("query/dense_shape", "I64", [3], i64([0, 2 ** 63 - 1, 3]))] + no_entries + [
        ("value", "F64", [0, 3, 3], b"")]))
    out(t, "huge_batch_zero_steps.safetensors", safetensors(keras_layer() + [
        ("query/dense_shape", "I64", [3], i64([2 ** 62, 0, 3]))] + no_entries + [
        ("value", "F64", [2 ** 62, 0, 3], b"")]))
    out(t, "zero_batch_huge_key_steps.safetensors", safetensors(keras_layer() + [
        ("query/dense_shape", "I64", [3], i64([0, 5, 3]))] + no_entries + [
        ("value", "F64", [0, 2 ** 62, 3], b"")]))
    out(t, "huge_dense_shape.safetensors", safetensors(keras_layer() + inputs(
        [2, 10 ** 9, 3], [[0, 0, 1]], [1.0], [2, 3, 3])))
    # Corrupt containers.
    valid = safetensors(keras_layer())
    out(t, "truncated.safetensors", valid[:len(valid) // 2])
    out(t, "huge_header_length.safetensors", b"\xff" * 7 + b"\x7f{}")
    out(t, "not_json.safetensors", struct.pack("<Q", 16) + b'{"a": {"dtype"\n:')
    overlap = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    out(t, "overlap.safetensors", struct.pack("<Q", len(overlap)) + overlap + bytes(8))
    nested = b'{"a":{"dtype":"F64","shape":[[[[[[1]]]]]],"data_offsets":[[[0]]]}}'
    out(t, "nested_shape.safetensors", struct.pack("<Q", len(nested)) + nested)
    out(t, "bool_bytes.safetensors", safetensors([("attention_mask", "BOOL", [1, 1, 3], b"\x00\x01\x07")]))


# ---- .npy and .npz ----

def npy(descr, shape, raw, fortran=False, version=(1, 0)):
    shape_text = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape_text)
    prefix = 10 if version[0] == 1 else 12
    header += " " * (64 - (prefix + len(header) + 1) % 64) + "\n"
    length = struct.pack("<H", len(header)) if version[0] == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes(version) + length + header.encode() + raw


def write_npy_seeds():
    t = "fuzz_npy"
    out(t, "fortran_3d.npy", npy("<i4", [2, 3, 2], struct.pack("<12i", *range(12)), fortran=True))
    out(t, "zero_huge.npy", npy("<f8", [0, 2 ** 62, 2 ** 62], b""))
    out(t, "overflow_shape.npy", npy("<f8", [2 ** 32, 2 ** 32], b""))
    out(t, "truncated_data.npy", npy("<f8", [4], f64([1, 2])))
    out(t, "bool_byte_7.npy", npy("|b1", [3], b"\x00\x01\x07"))
    out(t, "v3_f32.npy", npy("<f4", [1], struct.pack("<f", 1.0), version=(3, 0)))
    # An .npz with a stored member, a deflated member and a member that is not an array.
    path = os.path.join(HERE, "corpus", t, "crafted_mixed.npz")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a.npy", npy("<f8", [2], f64([1.5, -2.0])), compress_type=zipfile.ZIP_STORED)
        archive.writestr("b.npy", npy("<i8", [2, 2], i64([1, 2, 3, 4])), compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr("__metadata__/num_heads.npy", npy("|u1", [1], b"2"))
        archive.writestr("readme.txt", b"not an array")
    with open(path, "rb") as f:
        data = f.read()
    # The same archive with its first member's bytes corrupted (CRC mismatch).
    corrupt = bytearray(data)
    at = corrupt.find(b"\x93NUMPY")
    corrupt[at + 60] ^= 0xFF
    out(t, "crc_mismatch.npz", bytes(corrupt))


if __name__ == "__main__":
    write_safetensors_seeds()
    write_npy_seeds()
