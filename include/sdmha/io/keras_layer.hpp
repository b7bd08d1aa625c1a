// sdmha/io/keras_layer.hpp — what io/keras_file.hpp returns: a MultiHeadAttention layer read from
// a Keras file (its configuration and weights), how to read it, and the list entry of one such
// layer.
#pragma once

#include <string>

#include "sdmha/io/isolation.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::io {

// A MultiHeadAttention layer read from a Keras file.
template <typename Scalar>
struct KerasLayer {
  MhaConfig config;            // value_dim and output_dim resolved (never 0)
  MhaWeights<Scalar> weights;  // Keras' kernels flattened: (E, H, D) → E × H·D
  LayerDims dims;              // every width, Eq, Ek and Ev included
  std::string name;            // the Keras layer name; empty when the file does not say
  std::string group;  // its HDF5 group, e.g. "layers/functional/layers/multi_head_attention_1"
  std::string keras_version;            // from metadata.json; empty when unknown, and then
  std::string no_keras_version_reason;  // says why (docs/keras_files.md, "metadata.json")
};

// How a Keras file is read. A NaN or ±Inf weight is a FormatError naming the tensor and its first
// such entry unless allow_non_finite_weights. A file without a usable metadata.json (a
// .weights.h5 has none) loads with keras_version empty and the reason in no_keras_version_reason,
// unless require_keras_version, which makes it a FormatError naming the file and the reason.
// `isolation` bounds load_keras_layer_isolated's child process.
struct KerasReadOptions {
  bool allow_non_finite_weights = false;
  bool require_keras_version = false;
  IsolationLimits isolation;
};

// One MultiHeadAttention of a Keras file, as keras_attention_layers lists it.
struct KerasLayerInfo {
  std::string name;   // empty when the file does not say (a .weights.h5 from Keras < 3.6)
  std::string group;  // the HDF5 group, which load_keras_layer also accepts as the layer name
};

}  // namespace sdmha::io
