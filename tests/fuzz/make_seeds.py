#!/usr/bin/env python3
"""Writes the crafted seeds of tests/fuzz/corpus/: small valid files and corrupt variants, and
fuzz_forward inputs long enough to decode a whole problem.

The seeds are checked in; rerun this (standard library only) after changing it:
    python3 tests/fuzz/make_seeds.py
Files are written under tests/fuzz/corpus/<target>/crafted_*.
"""
import json
import os
import random
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
    # Each member with a fixed time stamp and mode, so that running this again writes the same bytes.
    def member(name, compress_type=zipfile.ZIP_STORED):
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = compress_type
        info.external_attr = 0o600 << 16
        return info

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member("a.npy"), npy("<f8", [2], f64([1.5, -2.0])))
        archive.writestr(member("b.npy", zipfile.ZIP_DEFLATED), npy("<i8", [2, 2], i64([1, 2, 3, 4])))
        archive.writestr(member("__metadata__/num_heads.npy"), npy("|u1", [1], b"2"))
        archive.writestr(member("readme.txt"), b"not an array")
    with open(path, "rb") as f:
        data = f.read()
    # The same archive with its first member's bytes corrupted (CRC mismatch).
    corrupt = bytearray(data)
    at = corrupt.find(b"\x93NUMPY")
    corrupt[at + 60] ^= 0xFF
    out(t, "crc_mismatch.npz", bytes(corrupt))


# ---- fuzz_forward ----
#
# FuzzedDataProvider takes integers from the end of the input, and every draw of fuzz_forward's
# decode is one byte, value = min + byte % (max - min + 1): an input is its draws in reverse
# order. The first twenty draws come in a fixed order (decode, up to decode_masks); the rest
# (masks, bias entries, key padding, weights, query entries, the poison flag, key and value) are
# random bytes here, exactly as many as decode takes: an input that runs out decodes the rest to
# the ranges' minimums (every mask entry blocked, every weight -1/2, every input -4), and
# libFuzzer's 60 s runs grow the older seeds (2 to 17 bytes) to about 25 bytes only.

def forward_head(mask=0, bias=0, semantics=0, long_steps=False, batch=1, steps=1, key_steps=1,
                 query_dim=1, key_in_dim=1, value_in_dim=1, heads=1, key_dim=1, value_dim=1,
                 output_dim=1, use_bias=True, causal=False, padding=False, strategy=0, threads=1,
                 logits16=False):
    """The fixed draws, in order. semantics: bit 0 bottom-right, bit 1 uniform, bits 2-4 the
    scale's index, bits 5-6 the -inf pattern, bit 7 the bfloat16 leg; strategy: 0 automatic,
    1 project_first, 2 sparse_regrouped."""
    # A draw from a range of one value takes no byte: H with long steps (H = 1).
    heads_draw = [] if long_steps else [heads - 1]
    return ([mask, bias, semantics, 1 - int(long_steps), batch, steps - (60 if long_steps else 0),
             key_steps, query_dim - 1, key_in_dim - 1, value_in_dim - 1] + heads_draw +
            [key_dim - 1, value_dim - 1, output_dim - 1, int(use_bias), int(causal), int(padding),
             strategy, threads - 1, int(logits16)])


def forward_seed(name, seed, poison=False, **fields):
    """The fixed draws, then random bytes for the rest; with poison, the draw that turns poison
    on in key and value rows that no query may see (after the masks, the bias, the padding,
    the weights and the query entries) is set."""
    head = forward_head(**fields)
    b, t, s, h = fields["batch"], fields["steps"], fields["key_steps"], fields["heads"]
    eq, ek, ev = fields["query_dim"], fields["key_in_dim"], fields["value_in_dim"]
    hk, hv, o = h * fields["key_dim"], h * fields["value_dim"], fields["output_dim"]
    # The entries of a mask or bias of broadcast code `code` (fuzz_forward's broadcast_shape).
    def entries(code):
        if code == 0:
            return 0
        return ((b if code in (2, 4, 5) else 1) * (h if code in (5, 6) else 1)) * t * s
    draws = len(head) + entries(fields.get("mask", 0)) + entries(fields.get("bias", 0))
    draws += b * s if fields.get("padding", False) else 0
    draws += (eq + ek) * hk + ev * hv + hv * o
    draws += 2 * hk + hv + o if fields.get("use_bias", True) else 0
    rng = random.Random(seed)
    rest = [rng.randrange(256) for _ in range(draws - len(head))]
    # The query: as many entries as it may have (at most 96), each a draw of (b, t, feature)
    # where their range has more than one value, and a value; then poison's flag.
    count = min(3 * b * t, 96)
    per_entry = (b > 1) + (t > 1) + (eq > 1) + 1
    rest += [count] + [rng.randrange(256) for _ in range(per_entry * count)] + [int(poison)]
    rest += [rng.randrange(256) for _ in range(b * s * (ek + ev))]
    out("fuzz_forward", name, bytes(head + rest)[::-1])


def write_forward_seeds():
    bfloat16 = 0x80
    scale = {"default": 0, "0.5": 1, "-0.25": 2, "1.5": 3, "0.125": 4, "2": 6}
    # Per-head mask (B, H, T, S), a (T, S) bias, 1/sqrt(3), padded keys with poison behind them.
    forward_seed("bfloat16_heads", 1, poison=True, mask=5, bias=1, semantics=bfloat16, batch=2,
                 steps=3, key_steps=4, query_dim=6, key_in_dim=5, value_in_dim=4, heads=2,
                 key_dim=3, value_dim=2, output_dim=3, padding=True, threads=2)
    # Logits of about 1e4, scale 1.5, causal bottom-right, a (1, H, T, S) bias.
    forward_seed("bfloat16_logits", 2, mask=2, bias=6,
                 semantics=bfloat16 | scale["1.5"] << 2 | 1, batch=2, steps=3, key_steps=4,
                 query_dim=5, key_in_dim=6, value_in_dim=3, heads=2, key_dim=2, value_dim=3,
                 output_dim=4, causal=True, strategy=1, threads=3, logits16=True)
    # The uniform policy, rows blocked by -inf biases on even rows, scale -1/4, no biases.
    forward_seed("bfloat16_uniform", 3, mask=1, bias=7,
                 semantics=bfloat16 | 2 | scale["-0.25"] << 2 | 2 << 5, batch=1, steps=4,
                 key_steps=3, query_dim=5, key_in_dim=4, value_in_dim=6, heads=1, key_dim=2,
                 value_dim=3, output_dim=4, use_bias=False)
    # T = 62 across query tiles; sparse_regrouped, refused in bfloat16 (project_first instead).
    forward_seed("bfloat16_long", 4, bias=3, semantics=bfloat16 | scale["0.125"] << 2,
                 long_steps=True, batch=1, steps=62, key_steps=3, query_dim=4, key_in_dim=3,
                 value_in_dim=3, heads=1, key_dim=2, value_dim=2, output_dim=2, padding=True,
                 strategy=2, threads=2)
    # Large logits, scale 2, a (B, 1, T, S) mask, causal, poison behind padded keys.
    forward_seed("bfloat16_poison", 5, poison=True, mask=4, semantics=bfloat16 | scale["2"] << 2,
                 batch=2, steps=2, key_steps=5, query_dim=4, key_in_dim=6, value_in_dim=6,
                 heads=2, key_dim=1, value_dim=3, output_dim=5, causal=True, padding=True,
                 threads=2, logits16=True)


if __name__ == "__main__":
    write_safetensors_seeds()
    write_npy_seeds()
    write_forward_seeds()
