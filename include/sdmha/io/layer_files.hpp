// sdmha/io/layer_files.hpp — a layer's weights and inputs from safetensors or .npz files, in the
// names of tests/data/goldens/README.md (the names Keras and PyTorch export).
//
// Weights, Keras layout (an optional layer prefix such as "multi_head_attention/" may precede):
//   query/kernel (Eq, H, Dk)  query/bias (H, Dk)  key/kernel (Ek, H, Dk)  key/bias (H, Dk)
//   value/kernel (Ev, H, Dv)  value/bias (H, Dv)  attention_output/kernel (H, Dv, O)
//   attention_output/bias (O)
// Weights, PyTorch nn.MultiheadAttention layout (used as x·Wᵀ + b; E = H·head_dim):
//   in_proj_weight (3E, E) rows q, k, v — or q_proj_weight (E, Eq), k_proj_weight (E, Ek),
//   v_proj_weight (E, Ev) when kdim/vdim differ — in_proj_bias (3E), out_proj.weight (E, E),
//   out_proj.bias (E). num_heads comes from the metadata or the caller.
// Inputs: query/indices (nnz, 3) int64, query/values (nnz), query/dense_shape (3) int64,
//   key (B, S, Ek) optional (Keras: key = value), value (B, S, Ev), attention_mask bool and
//   attention_bias F32/F64 (both optional), each (T, S), (B', T, S) or (B', H', T, S) with
//   B' ∈ {1, B}, H' ∈ {1, H}: True = may attend; the bias is added to the scaled scores.
// __metadata__ (strings): num_heads, key_dim, value_dim, layout (keras|torch), use_causal_mask,
// causal_alignment (top_left|bottom_right), scale (a decimal number; absent: 1/sqrt(key_dim)),
// fully_masked_rows (zeros|uniform).
//
// TensorSource, the face these readers take over either format, is in io/tensor_source.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "sdmha/broadcast_ref.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/finite_weights.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/dtype.hpp"
#include "sdmha/io/npy.hpp"
#include "sdmha/io/safetensors.hpp"
#include "sdmha/io/tensor_source.hpp"
#include "sdmha/options.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::io {

enum class WeightLayout { keras, torch };

// What the caller may impose over the file's metadata.
struct LayerFileOptions {
  std::optional<WeightLayout> layout;   // default: metadata "layout", else detected from the names
  std::optional<Index> num_heads;       // default: metadata "num_heads" (required for torch)
  std::optional<bool> use_causal_mask;  // default: metadata "use_causal_mask", else false
  std::optional<std::string> prefix;    // Keras layer prefix; default: found from the names
  // A NaN or ±Inf weight is a FormatError naming the tensor and its first such entry, unless set.
  bool allow_non_finite_weights = false;
};

// A layer read from a file: what makes the layer (config, weights) and the attention settings
// the file carries, which belong to every call of it: attention_options() hands them over.
template <typename Scalar>
struct LayerFile {
  MhaConfig config;
  MhaWeights<Scalar> weights;
  WeightLayout layout = WeightLayout::keras;
  bool use_causal_mask = false;
  CausalAlignment causal_alignment = CausalAlignment::top_left;
  std::optional<double> scale;  // absent: 1/sqrt(key_dim)
  FullyMaskedRows fully_masked_rows = FullyMaskedRows::zeros;

  // Options for forward and backward with the file's settings (use_causal_mask,
  // causal_alignment, scale, fully_masked_rows) and every other member at its default: start
  // from these, then add the masks, threads and the rest of the call.
  AttentionOptions<Scalar> attention_options() const {
    AttentionOptions<Scalar> options;
    options.use_causal_mask = use_causal_mask;
    options.causal_alignment = causal_alignment;
    options.scale = scale;
    options.fully_masked_rows = fully_masked_rows;
    return options;
  }
};

}  // namespace sdmha::io

namespace sdmha::detail {

inline std::optional<Index> metadata_integer(const io::TensorSource& source, const char* key) {
  const auto text = source.metadata_value(key);
  if (!text) return std::nullopt;
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text->size() || text->empty())
    fail<FormatError>("io", source.source(), ": metadata '", key, "' = '", *text,
                      "'; expected an integer");
  return static_cast<Index>(value);
}

inline std::optional<bool> metadata_bool(const io::TensorSource& source, const char* key) {
  const auto text = source.metadata_value(key);
  if (!text) return std::nullopt;
  if (*text == "true" || *text == "True" || *text == "1") return true;
  if (*text == "false" || *text == "False" || *text == "0") return false;
  fail<FormatError>("io", source.source(), ": metadata '", key, "' = '", *text,
                    "'; expected true or false");
}

inline std::optional<double> metadata_number(const io::TensorSource& source, const char* key) {
  const auto text = source.metadata_value(key);
  if (!text) return std::nullopt;
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text->size() || text->empty() || !std::isfinite(value))
    fail<FormatError>("io", source.source(), ": metadata '", key, "' = '", *text,
                      "'; expected a finite decimal number");
  return value;
}

inline CausalAlignment metadata_causal_alignment(const io::TensorSource& source) {
  const auto text = source.metadata_value("causal_alignment");
  if (!text || *text == "top_left") return CausalAlignment::top_left;
  if (*text == "bottom_right") return CausalAlignment::bottom_right;
  fail<FormatError>("io", source.source(), ": metadata 'causal_alignment' = '", *text,
                    "'; expected top_left or bottom_right");
}

inline FullyMaskedRows metadata_fully_masked_rows(const io::TensorSource& source) {
  const auto text = source.metadata_value("fully_masked_rows");
  if (!text || *text == "zeros") return FullyMaskedRows::zeros;
  if (*text == "uniform") return FullyMaskedRows::uniform;
  fail<FormatError>("io", source.source(), ": metadata 'fully_masked_rows' = '", *text,
                    "'; expected zeros or uniform");
}

inline std::string keras_prefix(const io::TensorSource& source) {
  const std::string suffix = "query/kernel";
  std::optional<std::string> found;
  for (const auto& name : source.names()) {
    if (name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string prefix = name.substr(0, name.size() - suffix.size());
    if (!prefix.empty() && prefix.back() != '/') continue;
    if (found && *found != prefix)
      fail<FormatError>("io", source.source(), ": several layers ('", *found, "', '", prefix,
                        "') hold a query/kernel; expected one, or a prefix given by the caller");
    found = prefix;
  }
  if (!found)
    fail<FormatError>(
        "io", source.source(),
        ": no tensor named '[prefix/]query/kernel'; expected Keras MultiHeadAttention weights");
  return *found;
}

// Checks `shape` against `expected`, where a negative expected entry accepts any size.
inline void expect_dims(const io::TensorSource& source, const std::string& name,
                        const std::vector<std::int64_t>& shape,
                        const std::vector<std::int64_t>& expected) {
  bool ok = shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < shape.size(); ++i)
    ok = expected[i] < 0 || shape[i] == expected[i];
  if (!ok)
    fail<ShapeError>("io", source.source(), ": tensor '", name, "' has shape ", format_shape(shape),
                     "; expected ", format_shape(expected), " (-1 = any)");
}

template <typename Scalar>
RowMatrix<Scalar> read_matrix(const io::TensorSource& source, const std::string& name, Index rows,
                              Index cols) {
  const auto data = source.read<Scalar>(name);
  SDMHA_ASSERT(Index(data.size()) == rows * cols);
  return Eigen::Map<const RowMatrix<Scalar>>(data.data(), rows, cols);
}

template <typename Scalar>
Vector<Scalar> read_vector(const io::TensorSource& source, const std::string& name) {
  const auto data = source.read<Scalar>(name);
  return Eigen::Map<const Vector<Scalar>>(data.data(), Index(data.size()));
}

template <typename Scalar>
void load_keras(const io::TensorSource& source, const std::string& prefix,
                io::LayerFile<Scalar>& layer) {
  const std::string q = prefix + "query/", k = prefix + "key/", v = prefix + "value/",
                    o = prefix + "attention_output/";
  const auto query_shape = source.expect_rank(q + "kernel", 3);
  // Every width must stay far from overflow once multiplied (H·Dk, Eq·H·Dk, H·Dv·O), even for
  // kernels that hold no bytes: see kMaxLayerDimension.
  for (const char* kernel :
       {"query/kernel", "key/kernel", "value/kernel", "attention_output/kernel"}) {
    const std::string name = prefix + kernel;
    for (const std::int64_t dimension : source.expect_rank(name, 3))
      if (dimension > kMaxLayerDimension)
        fail<ShapeError>("io", source.source(), ": tensor '", name, "' has a dimension of ",
                         dimension, "; expected at most 2^24");
  }
  const std::int64_t Eq = query_shape[0], H = query_shape[1], Dk = query_shape[2];
  const auto key_shape = source.expect_rank(k + "kernel", 3);
  expect_dims(source, k + "kernel", key_shape, {-1, H, Dk});
  const auto value_shape = source.expect_rank(v + "kernel", 3);
  expect_dims(source, v + "kernel", value_shape, {-1, H, -1});
  const std::int64_t Ek = key_shape[0], Ev = value_shape[0], Dv = value_shape[2];
  const auto output_shape = source.expect_rank(o + "kernel", 3);
  expect_dims(source, o + "kernel", output_shape, {H, Dv, -1});
  const std::int64_t O = output_shape[2];

  layer.config.num_heads = H;
  layer.config.key_dim = Dk;
  layer.config.value_dim = Dv;
  layer.config.output_dim = O;
  auto& w = layer.weights;
  w.query_kernel = read_matrix<Scalar>(source, q + "kernel", Eq, H * Dk);
  w.key_kernel = read_matrix<Scalar>(source, k + "kernel", Ek, H * Dk);
  w.value_kernel = read_matrix<Scalar>(source, v + "kernel", Ev, H * Dv);
  w.output_kernel = read_matrix<Scalar>(source, o + "kernel", H * Dv, O);

  const bool has_bias[4] = {source.contains(q + "bias"), source.contains(k + "bias"),
                            source.contains(v + "bias"), source.contains(o + "bias")};
  layer.config.use_bias = has_bias[0];
  for (bool present : has_bias)
    if (present != layer.config.use_bias)
      fail<FormatError>("io", source.source(),
                        ": some projections have a bias and others not; expected all four "
                        "(query, key, value, attention_output) or none");
  if (layer.config.use_bias) {
    expect_dims(source, q + "bias", source.shape(q + "bias"), {H, Dk});
    expect_dims(source, k + "bias", source.shape(k + "bias"), {H, Dk});
    expect_dims(source, v + "bias", source.shape(v + "bias"), {H, Dv});
    expect_dims(source, o + "bias", source.shape(o + "bias"), {O});
    w.query_bias = read_vector<Scalar>(source, q + "bias");
    w.key_bias = read_vector<Scalar>(source, k + "bias");
    w.value_bias = read_vector<Scalar>(source, v + "bias");
    w.output_bias = read_vector<Scalar>(source, o + "bias");
  }
}

template <typename Scalar>
void load_torch(const io::TensorSource& source, Index heads, io::LayerFile<Scalar>& layer) {
  for (const char* unsupported : {"bias_k", "bias_v"})
    if (source.contains(unsupported))
      fail<FormatError>("io", source.source(), ": tensor '", unsupported,
                        "' (add_bias_kv) is not supported; expected add_bias_kv=False");
  const auto out_shape = source.expect_rank("out_proj.weight", 2);
  const std::int64_t E = out_shape[1];
  expect_dims(source, "out_proj.weight", out_shape, {E, E});
  if (E % heads != 0)
    fail<ShapeError>("io", source.source(), ": embed_dim ", E, " is not divisible by num_heads ",
                     heads, "; expected embed_dim = num_heads * head_dim");
  const Index head_dim = E / heads;
  layer.config.num_heads = heads;
  layer.config.key_dim = head_dim;
  layer.config.value_dim = head_dim;
  layer.config.output_dim = E;
  auto& w = layer.weights;
  // PyTorch computes x·Wᵀ: the Keras-layout kernel (input × H·D) is Wᵀ.
  if (source.contains("in_proj_weight")) {
    expect_dims(source, "in_proj_weight", source.shape("in_proj_weight"), {3 * E, E});
    const RowMatrix<Scalar> packed = read_matrix<Scalar>(source, "in_proj_weight", 3 * E, E);
    w.query_kernel = packed.topRows(E).transpose();
    w.key_kernel = packed.middleRows(E, E).transpose();
    w.value_kernel = packed.bottomRows(E).transpose();
  } else {
    const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
    RowMatrix<Scalar>* kernels[3] = {&w.query_kernel, &w.key_kernel, &w.value_kernel};
    for (int i = 0; i < 3; ++i) {
      if (!source.contains(names[i]))
        fail<FormatError>("io", source.source(), ": neither 'in_proj_weight' nor '", names[i],
                          "' is present; expected PyTorch nn.MultiheadAttention weights");
      const auto dims = source.expect_rank(names[i], 2);
      expect_dims(source, names[i], dims, {E, -1});
      *kernels[i] = read_matrix<Scalar>(source, names[i], E, dims[1]).transpose();
    }
  }
  w.output_kernel = read_matrix<Scalar>(source, "out_proj.weight", E, E).transpose();
  layer.config.use_bias = source.contains("in_proj_bias");
  if (layer.config.use_bias != source.contains("out_proj.bias"))
    fail<FormatError>(
        "io", source.source(),
        ": exactly one of 'in_proj_bias' and 'out_proj.bias' is present; expected both or neither");
  if (layer.config.use_bias) {
    expect_dims(source, "in_proj_bias", source.shape("in_proj_bias"), {3 * E});
    expect_dims(source, "out_proj.bias", source.shape("out_proj.bias"), {E});
    const Vector<Scalar> packed = read_vector<Scalar>(source, "in_proj_bias");
    w.query_bias = packed.segment(0, E);
    w.key_bias = packed.segment(E, E);
    w.value_bias = packed.segment(2 * E, E);
    w.output_bias = read_vector<Scalar>(source, "out_proj.bias");
  }
}

}  // namespace sdmha::detail

namespace sdmha::io {

// Reads a layer's configuration and weights, in either layout, and validates them.
template <typename Scalar>
LayerFile<Scalar> load_layer(const TensorSource& source, const LayerFileOptions& options = {}) {
  LayerFile<Scalar> layer;
  if (options.layout) {
    layer.layout = *options.layout;
  } else if (const auto text = source.metadata_value("layout")) {
    if (*text == "keras")
      layer.layout = WeightLayout::keras;
    else if (*text == "torch")
      layer.layout = WeightLayout::torch;
    else
      detail::fail<FormatError>("io", source.source(), ": metadata 'layout' = '", *text,
                                "'; expected keras or torch");
  } else {
    const bool torch = source.contains("out_proj.weight");
    layer.layout = torch ? WeightLayout::torch : WeightLayout::keras;
  }
  const auto metadata_heads = detail::metadata_integer(source, "num_heads");
  if (layer.layout == WeightLayout::keras) {
    detail::load_keras(source, options.prefix ? *options.prefix : detail::keras_prefix(source),
                       layer);
    const Index heads = options.num_heads ? *options.num_heads : layer.config.num_heads;
    if (heads != layer.config.num_heads)
      detail::fail<ShapeError>("io", source.source(), ": num_heads = ", heads,
                               " but the Keras kernels hold ", layer.config.num_heads, " heads");
  } else {
    const auto heads = options.num_heads ? options.num_heads : metadata_heads;
    if (!heads)
      detail::fail<FormatError>(
          "io", source.source(),
          ": num_heads is neither in the metadata nor given; PyTorch weights need it");
    if (*heads <= 0)
      detail::fail<ConfigError>("io", source.source(), ": num_heads = ", *heads, "; expected > 0");
    detail::load_torch(source, *heads, layer);
  }
  // Metadata that disagrees with the shapes is an error, not something to paper over.
  const std::pair<const char*, Index> declared[] = {{"num_heads", layer.config.num_heads},
                                                    {"key_dim", layer.config.key_dim},
                                                    {"value_dim", layer.config.value_dim}};
  for (const auto& [key, actual] : declared) {
    if (options.num_heads && std::string(key) == "num_heads") continue;
    const auto value = detail::metadata_integer(source, key);
    if (value && *value != actual)
      detail::fail<ShapeError>("io", source.source(), ": metadata '", key, "' = ", *value,
                               " but the weights' shapes give ", actual);
  }
  layer.use_causal_mask = options.use_causal_mask
                              ? *options.use_causal_mask
                              : detail::metadata_bool(source, "use_causal_mask").value_or(false);
  layer.causal_alignment = detail::metadata_causal_alignment(source);
  layer.scale = detail::metadata_number(source, "scale");
  layer.fully_masked_rows = detail::metadata_fully_masked_rows(source);
  layer.weights.validate(layer.config);
  if (!options.allow_non_finite_weights)
    detail::check_finite_weights("io", source.source(), layer.weights);
  return layer;
}

// A mask or a bias read from a file, kept as the rank-4 (B', H', T, S) tensor it broadcasts as,
// with the rank it was stored with. It binds to AttentionOptions' views,
//   options.attention_mask = inputs.attention_mask;
//   options.attention_bias = inputs.attention_bias;
// and the options then point into this object, which must outlive the call. Empty when absent.
template <typename T>
struct BroadcastTensor {
  Eigen::Tensor<T, 4, Eigen::RowMajor> tensor;  // (B', H', T, S); all dimensions 0 when absent
  int rank = 0;                                 // 2, 3 or 4 as stored; 0 when absent

  bool empty() const { return rank == 0; }
  Index size() const { return tensor.size(); }
  Index dimension(int axis) const { return tensor.dimension(axis); }
  const T* data() const { return tensor.data(); }
  BroadcastRef<T> view() const& {
    if (empty()) return {};
    return BroadcastRef<T>(tensor.data(), tensor.dimension(0), tensor.dimension(1),
                           tensor.dimension(2), tensor.dimension(3), rank);
  }
  BroadcastRef<T> view() const&& = delete;              // the tensor would be gone
  operator BroadcastRef<T>() const& { return view(); }  // NOLINT: implicit by design
  // A temporary would be gone before the call reads the view.
  operator BroadcastRef<T>() const&& = delete;
};

template <typename Scalar>
struct LayerInputs {
  SparseQuery<Scalar> query;
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> key;  // equals value when the file has no key
  Eigen::Tensor<Scalar, 3, Eigen::RowMajor> value;
  BroadcastTensor<bool> attention_mask;    // (T, S), (B', T, S) or (B', H', T, S); may be empty
  BroadcastTensor<Scalar> attention_bias;  // the same shapes; may be empty
  bool has_key = false;
};

}  // namespace sdmha::io

namespace sdmha::detail {

// Reads `name` (attention_mask or attention_bias) when present: rank 2 (T, S), rank 3 (B', T, S)
// or rank 4 (B', H', T, S) with B' ∈ {1, B}. H' is checked by forward, which knows the heads.
template <typename T>
io::BroadcastTensor<T> read_broadcast(const io::TensorSource& source, const std::string& name,
                                      std::int64_t batch, std::int64_t steps,
                                      std::int64_t key_steps) {
  io::BroadcastTensor<T> result;
  if (!source.contains(name)) return result;
  const auto dims = source.shape(name);
  const std::size_t rank = dims.size();
  std::int64_t full[4] = {1, 1, -1, -1};  // (B', H', T, S)
  if (rank == 2) {
    full[2] = dims[0], full[3] = dims[1];
  } else if (rank == 3) {
    full[0] = dims[0], full[2] = dims[1], full[3] = dims[2];
  } else if (rank == 4) {
    for (int axis = 0; axis < 4; ++axis) full[axis] = dims[axis];
  }
  const bool ok = (rank >= 2 && rank <= 4) && (full[0] == 1 || full[0] == batch) && full[1] >= 1 &&
                  full[2] == steps && full[3] == key_steps;
  if (!ok) {
    const std::vector<std::int64_t> expected{batch, steps, key_steps};
    fail<ShapeError>("io", source.source(), ": tensor '", name, "' has shape ", format_shape(dims),
                     "; expected ", format_shape(expected), " or another of (T, S) = [", steps,
                     ", ", key_steps, "], (B, T, S), (B, H, T, S) with B = ", batch,
                     " or 1 and H the layer's heads or 1");
  }
  // A mask's dtype is read<bool>'s to check (BOOL or U8 of 0s and 1s); a bias is F32 or F64.
  if constexpr (!std::is_same<T, bool>::value) {
    const io::DType dtype = source.dtype(name);
    if (dtype != io::DType::F32 && dtype != io::DType::F64)
      fail<FormatError>("io", source.source(), ": tensor '", name, "' has dtype ",
                        io::dtype_name(dtype), "; expected F32 or F64");
  }
  const auto data = source.read<T>(name);
  result.tensor.resize(full[0], full[1], full[2], full[3]);
  SDMHA_ASSERT(Index(data.size()) == result.tensor.size());
  std::copy(data.begin(), data.end(), result.tensor.data());
  result.rank = int(rank);
  return result;
}

}  // namespace sdmha::detail

namespace sdmha::io {

// Reads query/indices, query/values, query/dense_shape, key (optional), value, attention_mask
// and attention_bias (optional). Shapes are checked here (the heads of a rank-4 mask or bias by
// forward); the query's indices by SparseQuery, whose rows are bounded by `limits` (a dense shape
// of three numbers must not allocate past it).
template <typename Scalar>
LayerInputs<Scalar> load_inputs(const TensorSource& source, const SparseQueryLimits& limits = {}) {
  LayerInputs<Scalar> inputs;
  const auto shape = source.expect_rank("query/dense_shape", 1);
  detail::expect_dims(source, "query/dense_shape", shape, {3});
  const auto dense_shape = source.read<std::int64_t>("query/dense_shape");
  const auto index_shape = source.expect_rank("query/indices", 2);
  detail::expect_dims(source, "query/indices", index_shape, {-1, 3});
  const auto value_shape = source.expect_rank("query/values", 1);
  detail::expect_dims(source, "query/values", value_shape, {index_shape[0]});
  const auto indices = source.read<std::int64_t>("query/indices");
  const auto values = source.read<Scalar>("query/values");
  using Coo = typename SparseQuery<Scalar>::CooIndices;
  // SparseQuery's own checks, with the file and the tensors named in front of its message.
  auto with_context = [&](const Error& error) {
    return std::string("sdmha: io: ") + source.source() +
           ": tensors 'query/indices', 'query/values', 'query/dense_shape': " + error.what();
  };
  try {
    inputs.query = SparseQuery<Scalar>::from_coo(
        dense_shape[0], dense_shape[1], dense_shape[2],
        Eigen::Map<const Coo>(indices.data(), index_shape[0], 3),
        Eigen::Map<const Vector<Scalar>>(values.data(), Index(values.size())), limits);
  } catch (const IndexError& error) {
    throw IndexError(with_context(error));
  } catch (const ShapeError& error) {
    throw ShapeError(with_context(error));
  }

  auto read_tensor = [&](const std::string& name) {
    const auto dims = source.expect_rank(name, 3);
    if (dims[0] != dense_shape[0])
      detail::fail<ShapeError>("io", source.source(), ": tensor '", name, "' has batch ", dims[0],
                               "; expected the query's batch ", dense_shape[0]);
    const auto data = source.read<Scalar>(name);
    Eigen::Tensor<Scalar, 3, Eigen::RowMajor> tensor(dims[0], dims[1], dims[2]);
    std::copy(data.begin(), data.end(), tensor.data());
    return tensor;
  };
  inputs.value = read_tensor("value");
  inputs.has_key = source.contains("key");
  inputs.key = inputs.has_key ? read_tensor("key") : inputs.value;
  const std::int64_t key_steps = inputs.value.dimension(1);
  inputs.attention_mask = detail::read_broadcast<bool>(source, "attention_mask", dense_shape[0],
                                                       dense_shape[1], key_steps);
  inputs.attention_bias = detail::read_broadcast<Scalar>(source, "attention_bias", dense_shape[0],
                                                         dense_shape[1], key_steps);
  return inputs;
}

}  // namespace sdmha::io
