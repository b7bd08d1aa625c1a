#!/usr/bin/python3
"""Regenerates the Keras 3 fixtures in tests/data/keras/ that tests/io/test_io_keras.cpp reads.

Usage (needs numpy and h5py; on Debian, python3-numpy and python3-h5py):

    /usr/bin/python3 tools/testdata/make_keras_test_files.py

(`/usr/bin/python3`: Debian's h5py is installed for Debian's Python, not for another one on PATH.)

These files are NOT written by Keras: Keras 3 cannot be installed here (Debian packages neither
TensorFlow nor Keras 3; `apt-cache search python3-keras` finds only python3-keras-applications
and python3-keras-preprocessing). They follow the layout that Keras' own saving code writes, as
read from its source and described in docs/keras_files.md:

  - keras/src/saving/saving_lib.py: `_save_state` gives each saveable the HDF5 group
    `<inner_path>/vars`, whose datasets are what the saveable's `save_own_variables` stores
    (Keras >= 3.6 also sets the attribute `name` = the layer's name on every `vars` group, and
    creates the group even when it holds nothing); `_walk_saveable` visits the `layers` of a
    Functional or Sequential model first, then the attributes in `sorted(dir(...))` order with
    private ones (`_x`) last; `_save_container_state` names a list's members by
    `naming.to_snake_case(class name)`, `_1`, `_2`, ... for repeats of the same class.
  - keras/src/layers/attention/multi_head_attention.py: `build` makes the EinsumDense sublayers
    `_query_dense` ("abc,cde->abde": kernel (Eq, H, Dk), bias (H, Dk)), `_key_dense`,
    `_value_dense` (kernel (Ev, H, Dv)) and `_output_dense` ("abcd,cde->abe": kernel (H, Dv, O),
    bias (O)); the public properties `query_dense`, `key_dense`, `value_dense`, `output_dense`
    (Keras >= 3.0.3) are visited before the private names, so the groups are
    `<layer>/query_dense/vars`, ...; Keras 3.0.0 to 3.0.2 had no such properties and wrote
    `<layer>/_query_dense/vars`, ...
  - keras/src/layers/core/einsum_dense.py: `save_own_variables` stores the kernel as "0" and the
    bias, when there is one, as "1".
  - a .keras file is a zip (stored, not deflated) of metadata.json, config.json (the model's
    `serialize_keras_object`) and model.weights.h5 (`_save_model_to_fileobj`).

Every array is drawn from fixed seeds; the weights are float32 (Keras' default variable dtype)
and the expected outputs are float64, computed here with Keras' math from those float32 values:
Q = query·Wq + bq, K = key·Wk + bk, V = value·Wv + bv with kernels (E, H, D); Q scaled by
1/sqrt(key_dim); scores Q·Kᵀ per head; softmax over the keys; P·V; output = Σ_h ctx_h·Wo[h] + bo
with Wo (H, Dv, O). Regenerate only together with tests/io/test_io_keras.cpp.

Files:
    functional_bias.weights.h5   model.save_weights of a Functional model (Keras >= 3.6 layout,
                                 `name` attributes): MultiHeadAttention "attention" with bias,
                                 num_heads 2, key_dim 3, value_dim 4, output_shape 7; Eq 5,
                                 Ek 4, Ev 6; followed by a Dense "head"
    functional_bias.keras        model.save of the same model: config.json, metadata.json and
                                 the same weights as model.weights.h5
    functional_bias.expected.npz query (2, 3, 5), key (2, 4, 4), value (2, 4, 6) and the layer's
                                 output (2, 3, 7), float64
    nested.keras                 Keras 3.5 layout (no `name` attributes): a Functional model with
                                 a MultiHeadAttention "outer_attention" (bias, value_dim = key_dim,
                                 no output_shape) and a nested Functional "encoder" holding
                                 "decoy" then "attention" (no bias, value_dim 4, output_shape 7),
                                 so "attention" lives at layers/functional/layers/
                                 multi_head_attention_1
    nested_attention.expected.npz, nested_outer_attention.expected.npz   their inputs and outputs
    legacy_private.weights.h5    Keras 3.0.0-3.0.2 layout (`_query_dense`, ..., no `name`
                                 attributes): "attention" with bias, num_heads 2, key_dim 3,
                                 value_dim 3, no output_shape
    legacy_private.expected.npz  its inputs and output
    bad_shape.keras              config.json says key_dim 3, the query kernel is (5, 2, 4)
    bomb.weights.h5              the query kernel claims (2^24, 2, 3) float32, chunked, nothing
                                 stored
"""

import io
import json
import pathlib
import zipfile

import h5py
import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "keras"

EQ, EK, EV = 5, 4, 6  # query, key and value feature widths
BATCH, STEPS, KEY_STEPS = 2, 3, 4


# ---------------------------------------------------------------------------------------------
# The layer: weights and Keras' math.


def make_weights(seed, heads, key_dim, value_dim, output_dim, use_bias):
    """Keras-shaped float32 weights: kernels (E, H, D), output (H, Dv, O), biases (H, D), (O)."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.uniform(-0.8, 0.8, size=shape).astype(np.float32)

    weights = {
        "query": [draw(EQ, heads, key_dim)],
        "key": [draw(EK, heads, key_dim)],
        "value": [draw(EV, heads, value_dim)],
        "attention_output": [draw(heads, value_dim, output_dim)],
    }
    if use_bias:
        weights["query"].append(draw(heads, key_dim))
        weights["key"].append(draw(heads, key_dim))
        weights["value"].append(draw(heads, value_dim))
        weights["attention_output"].append(draw(output_dim))
    return weights


def keras_mha(weights, key_dim, query, key, value):
    """MultiHeadAttention.call in float64 (default attention axes, no mask, no dropout)."""
    w = {name: [np.asarray(a, dtype=np.float64) for a in arrays] for name, arrays in weights.items()}

    def project(x, name, equation):
        y = np.einsum(equation, x, w[name][0])
        return y + w[name][1] if len(w[name]) > 1 else y

    q = project(query, "query", "bte,ehd->bthd") / np.sqrt(float(key_dim))
    k = project(key, "key", "bse,ehd->bshd")
    v = project(value, "value", "bse,ehd->bshd")
    scores = np.einsum("bshd,bthd->bhts", k, q)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probabilities = np.exp(scores)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    context = np.einsum("bhts,bshd->bthd", probabilities, v)
    return project(context, "attention_output", "bthd,hdo->bto")


def make_inputs(seed):
    rng = np.random.default_rng(seed)

    def draw(*shape):  # float32-representable, so the float32 test sees the same inputs
        return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32).astype(np.float64)

    return draw(BATCH, STEPS, EQ), draw(BATCH, KEY_STEPS, EK), draw(BATCH, KEY_STEPS, EV)


def write_expected(path, weights, key_dim, seed):
    query, key, value = make_inputs(seed)
    output = keras_mha(weights, key_dim, query, key, value)
    np.savez(path, query=query, key=key, value=value, output=output)


# ---------------------------------------------------------------------------------------------
# config.json entries, in the shape of serialize_keras_object's output.


def dtype_policy():
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"},
            "registered_name": None}


def keras_tensor(shape, history):
    return {"class_name": "__keras_tensor__",
            "config": {"shape": shape, "dtype": "float32", "keras_history": history}}


def input_layer_entry(name, width):
    return {"module": "keras.layers", "class_name": "InputLayer",
            "config": {"batch_shape": [None, None, width], "dtype": "float32", "sparse": False,
                       "ragged": False, "name": name, "optional": False},
            "registered_name": None, "name": name, "inbound_nodes": []}


def mha_entry(name, heads, key_dim, value_dim, output_shape, use_bias, inputs):
    query, value, key = inputs
    config = {
        "name": name, "trainable": True, "dtype": dtype_policy(), "num_heads": heads,
        "key_dim": key_dim, "value_dim": value_dim, "dropout": 0.0, "use_bias": use_bias,
        "output_shape": output_shape, "attention_axes": None,
        "kernel_initializer": {"module": "keras.initializers", "class_name": "GlorotUniform",
                               "config": {"seed": None}, "registered_name": None},
        "bias_initializer": {"module": "keras.initializers", "class_name": "Zeros", "config": {},
                             "registered_name": None},
        "kernel_regularizer": None, "bias_regularizer": None, "activity_regularizer": None,
        "kernel_constraint": None, "bias_constraint": None, "seed": None,
    }
    shapes = {"query_shape": [None, STEPS, EQ], "value_shape": [None, KEY_STEPS, EV],
              "key_shape": [None, KEY_STEPS, EK]}
    node = {"args": [keras_tensor([None, None, EQ], [query, 0, 0]),
                     keras_tensor([None, None, EV], [value, 0, 0])],
            "kwargs": {"key": keras_tensor([None, None, EK], [key, 0, 0])}}
    return {"module": "keras.layers", "class_name": "MultiHeadAttention", "config": config,
            "registered_name": None, "build_config": {"shapes_dict": shapes}, "name": name,
            "inbound_nodes": [node]}


def dense_entry(name, units, source, width):
    config = {"name": name, "trainable": True, "dtype": dtype_policy(), "units": units,
              "activation": "linear", "use_bias": True}
    return {"module": "keras.layers", "class_name": "Dense", "config": config,
            "registered_name": None, "build_config": {"input_shape": [None, STEPS, width]},
            "name": name,
            "inbound_nodes": [{"args": [keras_tensor([None, None, width], [source, 0, 0])],
                               "kwargs": {}}]}


def functional_entry(name, layers, inputs, outputs, nested=False):
    config = {"name": name, "trainable": True, "layers": layers,
              "input_layers": [[n, 0, 0] for n in inputs], "output_layers": outputs}
    entry = {"module": "keras.src.models.functional", "class_name": "Functional",
             "config": config, "registered_name": "Functional"}
    if nested:
        entry["name"] = name
        entry["inbound_nodes"] = []
    else:
        entry["build_config"] = {"input_shape": None}
    return entry


# ---------------------------------------------------------------------------------------------
# model.weights.h5, in saving_lib's layout.


def write_vars(h5, path, arrays=(), name=None):
    """`<path>/vars` with datasets "0", "1", ...; `name` set as Keras >= 3.6 does."""
    group = h5.create_group(f"{path}/vars" if path else "vars")
    if name is not None:
        group.attrs["name"] = name
    for index, array in enumerate(arrays):
        group[str(index)] = array


def write_mha(h5, path, weights, name=None, private=False):
    """A MultiHeadAttention at `path`: its own (empty) vars, then its sublayers."""
    write_vars(h5, path, name=name)
    prefix = "_" if private else ""
    sublayers = {"query": "query_dense", "key": "key_dense", "value": "value_dense",
                 "attention_output": "output_dense"}
    for keras_name, attribute in sublayers.items():
        write_vars(h5, f"{path}/{prefix}{attribute}", weights[keras_name],
                   name=keras_name if name is not None else None)
    # The weightless sublayers get (empty) groups too.
    write_vars(h5, f"{path}/_dropout_layer", name="dropout" if name is not None else None)
    write_vars(h5, f"{path}/_softmax", name="softmax" if name is not None else None)


def h5_bytes(fill):
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as h5:
        fill(h5)
    return buffer.getvalue()


def write_keras(path, config, weights_h5, keras_version):
    metadata = {"keras_version": keras_version, "date_saved": "2025-01-01@00:00:00"}
    with zipfile.ZipFile(path, "w") as archive:  # ZIP_STORED, as Keras writes it
        for member, text in (("metadata.json", json.dumps(metadata)),
                             ("config.json", json.dumps(config))):
            info = zipfile.ZipInfo(member, date_time=(2025, 1, 1, 0, 0, 0))
            archive.writestr(info, text)
        info = zipfile.ZipInfo("model.weights.h5", date_time=(2025, 1, 1, 0, 0, 0))
        archive.writestr(info, weights_h5)


# ---------------------------------------------------------------------------------------------
# The fixtures.


def functional_bias():
    weights = make_weights(11, heads=2, key_dim=3, value_dim=4, output_dim=7, use_bias=True)
    rng = np.random.default_rng(12)
    head = [rng.uniform(-1, 1, (7, 2)).astype(np.float32), np.zeros(2, np.float32)]

    def fill(h5):
        write_vars(h5, "", name="functional_bias")
        for index, layer in enumerate(("query", "value", "key")):
            write_vars(h5, "layers/input_layer" + (f"_{index}" if index else ""), name=layer)
        write_mha(h5, "layers/multi_head_attention", weights, name="attention")
        write_vars(h5, "layers/dense", head, name="head")

    layers = [input_layer_entry("query", EQ), input_layer_entry("value", EV),
              input_layer_entry("key", EK),
              mha_entry("attention", 2, 3, 4, [7], True, ("query", "value", "key")),
              dense_entry("head", 2, "attention", 7)]
    config = functional_entry("functional_bias", layers, ["query", "value", "key"],
                              [["head", 0, 0]])
    image = h5_bytes(fill)
    (OUT / "functional_bias.weights.h5").write_bytes(image)
    write_keras(OUT / "functional_bias.keras", config, image, "3.8.0")
    write_expected(OUT / "functional_bias.expected.npz", weights, 3, seed=13)


def nested():
    outer = make_weights(21, heads=2, key_dim=3, value_dim=3, output_dim=EQ, use_bias=True)
    decoy = make_weights(22, heads=2, key_dim=3, value_dim=4, output_dim=7, use_bias=False)
    target = make_weights(23, heads=2, key_dim=3, value_dim=4, output_dim=7, use_bias=False)

    def fill(h5):  # Keras 3.5: every saveable gets its vars group, none has a name attribute
        write_vars(h5, "")
        for index in range(3):
            write_vars(h5, "layers/input_layer" + (f"_{index}" if index else ""))
        write_mha(h5, "layers/multi_head_attention", outer)
        write_vars(h5, "layers/functional")
        for index in range(3):
            write_vars(h5, "layers/functional/layers/input_layer" + (f"_{index}" if index else ""))
        write_mha(h5, "layers/functional/layers/multi_head_attention", decoy)
        write_mha(h5, "layers/functional/layers/multi_head_attention_1", target)

    inner_inputs = ("enc_query", "enc_value", "enc_key")
    inner = functional_entry(
        "encoder",
        [input_layer_entry("enc_query", EQ), input_layer_entry("enc_value", EV),
         input_layer_entry("enc_key", EK),
         mha_entry("decoy", 2, 3, 4, [7], False, inner_inputs),
         mha_entry("attention", 2, 3, 4, 7, False, inner_inputs)],
        list(inner_inputs), [["decoy", 0, 0], ["attention", 0, 0]], nested=True)
    layers = [input_layer_entry("query", EQ), input_layer_entry("value", EV),
              input_layer_entry("key", EK),
              mha_entry("outer_attention", 2, 3, 3, None, True, ("query", "value", "key")),
              inner]
    config = functional_entry("nested", layers, ["query", "value", "key"],
                              [["outer_attention", 0, 0], ["encoder", 0, 1]])
    write_keras(OUT / "nested.keras", config, h5_bytes(fill), "3.5.0")
    write_expected(OUT / "nested_attention.expected.npz", target, 3, seed=24)
    write_expected(OUT / "nested_outer_attention.expected.npz", outer, 3, seed=25)


def legacy_private():
    weights = make_weights(31, heads=2, key_dim=3, value_dim=3, output_dim=EQ, use_bias=True)

    def fill(h5):  # Keras 3.0.0-3.0.2: private sublayer names, no name attributes
        write_vars(h5, "")
        for index in range(3):
            write_vars(h5, "layers/input_layer" + (f"_{index}" if index else ""))
        write_mha(h5, "layers/multi_head_attention", weights, private=True)

    (OUT / "legacy_private.weights.h5").write_bytes(h5_bytes(fill))
    write_expected(OUT / "legacy_private.expected.npz", weights, 3, seed=32)


def bad_shape():
    weights = make_weights(41, heads=2, key_dim=3, value_dim=3, output_dim=EQ, use_bias=True)
    weights["query"][0] = np.zeros((EQ, 2, 4), np.float32)  # key_dim 4 where config.json says 3

    def fill(h5):
        write_vars(h5, "", name="bad_shape")
        write_mha(h5, "layers/multi_head_attention", weights, name="attention")

    layers = [input_layer_entry("query", EQ), input_layer_entry("value", EV),
              input_layer_entry("key", EK),
              mha_entry("attention", 2, 3, 3, None, True, ("query", "value", "key"))]
    config = functional_entry("bad_shape", layers, ["query", "value", "key"],
                              [["attention", 0, 0]])
    write_keras(OUT / "bad_shape.keras", config, h5_bytes(fill), "3.8.0")


def bomb():
    weights = make_weights(51, heads=2, key_dim=3, value_dim=3, output_dim=EQ, use_bias=False)

    def fill(h5):
        write_vars(h5, "", name="bomb")
        write_mha(h5, "layers/multi_head_attention", weights, name="attention")
        group = h5["layers/multi_head_attention/query_dense/vars"]
        del group["0"]
        # 2^24 x 2 x 3 float32 = 384 MiB declared, chunked, no chunk ever written.
        group.create_dataset("0", shape=(1 << 24, 2, 3), dtype=np.float32, chunks=(1024, 2, 3))

    (OUT / "bomb.weights.h5").write_bytes(h5_bytes(fill))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    functional_bias()
    nested()
    legacy_private()
    bad_shape()
    bomb()
    for path in sorted(OUT.iterdir()):
        print(f"{path.relative_to(OUT.parent.parent.parent)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
