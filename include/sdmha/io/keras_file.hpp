// sdmha/io/keras_file.hpp — a MultiHeadAttention layer read from a Keras 3 file: the HDF5 file of
// `model.save_weights("x.weights.h5")`, or the `.keras` zip of `model.save("x.keras")`
// (config.json, metadata.json, model.weights.h5), or the directory of `saving_lib.save_model(...,
// zipped=False)`.
//
//   const auto keras = sdmha::io::load_keras_layer<float>("model.keras", "attention");
//   const sdmha::SparseDenseMHA<float> layer(keras.config, keras.weights);
//
// Where Keras 3 puts the weights, as read from its source (docs/keras_files.md has the details):
//   <layer>                          the layer's HDF5 group. A layer of a Functional or Sequential
//                                    model is `layers/<class>`, <class> the snake_case class name
//                                    (naming.to_snake_case), `<class>_1`, `<class>_2`, ... for the
//                                    model's 2nd, 3rd layer of that class; a nested model nests the
//                                    same way: `layers/functional/layers/multi_head_attention`
//                                    (saving_lib.py: _walk_saveable, _save_container_state)
//   <layer>/vars                     the layer's own variables (none for MultiHeadAttention); from
//                                    Keras 3.6 on its attribute `name` holds the layer's name
//                                    (saving_lib.py: _save_state, H5IOStore.make)
//   <layer>/query_dense/vars/0       query kernel (Eq, H, Dk)   einsum_dense.py:
//   <layer>/query_dense/vars/1       query bias (H, Dk)         EinsumDense.save_own_variables,
//   <layer>/key_dense/vars/0, 1      (Ek, H, Dk), (H, Dk)       "0" the kernel, "1" the bias
//   <layer>/value_dense/vars/0, 1    (Ev, H, Dv), (H, Dv)       when use_bias
//   <layer>/output_dense/vars/0, 1   (H, Dv, O), (O)
// The sublayer groups carry the names of MultiHeadAttention's public properties query_dense,
// key_dense, value_dense and output_dense (multi_head_attention.py), which _walk_saveable visits
// before the private _query_dense, ... that `build` assigns. Keras 3.0.0 to 3.0.2 had no such
// properties and wrote `<layer>/_query_dense/vars/0`, ...: both spellings are read.
//
// Finding the layer called `layer_name`, in this order:
//   1. in config.json (a .keras file): the layer tree is walked as saving_lib walks the model,
//      which gives each MultiHeadAttention's group; the configuration (num_heads, key_dim,
//      value_dim, use_bias, output_shape, and the build shapes) comes from the layer's entry;
//   2. by the `name` attribute of `<layer>/vars` (files from Keras >= 3.6, either kind);
//   3. as an HDF5 group path such as "layers/multi_head_attention" (any file; the way to pick a
//      layer from a .weights.h5 written before Keras 3.6, which holds no layer names).
//   An empty layer_name takes the file's only MultiHeadAttention.
// Without config.json the configuration is the MhaConfig the caller gives (checked against every
// shape), or else what the kernels' shapes say. The layer's shapes are checked before any data
// is read, and no dataset may claim more bytes than its file stores.
//
// Errors: IoError when the file cannot be read; FormatError when it is not what Keras writes (not
// a zip or HDF5 file, truncated, a missing group or dataset, a shape or dtype that disagrees with
// the configuration, a soft or external link, an option sdmha does not implement), naming the
// file, the HDF5 path and what was expected; ConfigError for an invalid MhaConfig argument.
// A missing or unusable metadata.json is no error: keras_version stays empty and
// no_keras_version_reason says why (a FormatError under KerasReadOptions::require_keras_version).
//
// Dependencies: HDF5's C library (Debian: libhdf5-dev; pkg-config `hdf5`), libzip and
// nlohmann/json (CMake: sdmha::io_keras). The HDF5 calls made here hold a process-wide mutex, and
// HDF5's automatic error printing is off while they run (and restored after).
//
// The parts, under io/detail/: hdf5.hpp (handles, groups, datasets), keras_archive.hpp (the three
// kinds of file), keras_config.hpp (config.json), keras_locate.hpp (finding the layer's group);
// this header checks the shapes and reads the weights. It includes io/npy.hpp, as it always has.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/hdf5.hpp"
#include "sdmha/io/detail/finite_weights.hpp"
#include "sdmha/io/detail/keras_archive.hpp"
#include "sdmha/io/detail/keras_config.hpp"
#include "sdmha/io/detail/keras_locate.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/keras_layer.hpp"
#include "sdmha/io/npy.hpp"
#include "sdmha/weights.hpp"

namespace sdmha::detail::keras {

// The datasets of one sublayer: "0" the kernel, "1" the bias, nothing else.
struct SublayerData {
  std::string vars;
  Dataset kernel;
  std::optional<Dataset> bias;
};

inline SublayerData open_sublayer(const H5Source& source, const std::string& layer, int which) {
  const Sublayer& sub = kSublayers[which];
  SublayerData data;
  data.vars = sublayer_vars(source, layer, which);
  if (data.vars.empty())
    fail<FormatError>(kWhere, "'", source.name, "': no group '", join_path(layer, sub.property),
                      "/vars' (nor '", join_path(layer, sub.attribute), "/vars'); expected the ",
                      sub.keras_name, " projection's variables");
  const H5Object vars = open_path(source, data.vars);
  for (const std::string& name : link_names(source, vars.id.get(), data.vars))
    if (name != "0" && name != "1")
      fail<FormatError>(kWhere, "'", source.name, "': unexpected dataset '", data.vars, "/", name,
                        "'; expected only 0 (kernel) and 1 (bias): quantized layers are not read");
  data.kernel = open_dataset(source, data.vars + "/0",
                             std::string(sub.keras_name) + " kernel " + sub.kernel_shape);
  if (open_path(source, data.vars + "/1").kind != H5Kind::missing)
    data.bias = open_dataset(source, data.vars + "/1",
                             std::string(sub.keras_name) + " bias " + sub.bias_shape);
  return data;
}

inline void expect_shape(const H5Source& source, const Dataset& dataset, const char* meaning,
                         const std::vector<std::int64_t>& expected, const std::string& why) {
  bool ok = dataset.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i)
    ok = dataset.shape[i] > 0 && (expected[i] < 0 || expected[i] == dataset.shape[i]);
  if (!ok)
    fail<FormatError>(kWhere, "'", source.name, "': dataset '", dataset.path, "' has shape ",
                      format_shape(dataset.shape, ShapeNotation::tuple), "; expected ", meaning,
                      " = ", format_shape(expected, ShapeNotation::tuple),
                      ", every dimension > 0 (", why, ")");
}

// The widths, from the expectations where given, from the kernels where not.
struct Widths {
  std::int64_t heads, key_dim, value_dim, output_dim, query, key, value;
  bool use_bias;
};

inline Widths check_shapes(const H5Source& source, const SublayerData (&sub)[4],
                           const Expected& expected) {
  const std::string why = expected.source.empty() ? "from the query kernel" : expected.source;
  auto dim = [&](const Dataset& d, std::size_t axis) {
    return d.shape.size() > axis ? d.shape[axis] : std::int64_t(-1);
  };
  Widths w{};
  w.heads = expected.heads.value_or(dim(sub[0].kernel, 1));
  w.key_dim = expected.key_dim.value_or(dim(sub[0].kernel, 2));
  w.value_dim = expected.value_dim.value_or(dim(sub[2].kernel, 2));
  expect_shape(source, sub[0].kernel, "(Eq, num_heads, key_dim)",
               {expected.query_width.value_or(-1), w.heads, w.key_dim}, why);
  expect_shape(source, sub[1].kernel, "(Ek, num_heads, key_dim)",
               {expected.key_width.value_or(-1), w.heads, w.key_dim}, why);
  expect_shape(source, sub[2].kernel, "(Ev, num_heads, value_dim)",
               {expected.value_width.value_or(-1), w.heads, w.value_dim}, why);
  w.query = sub[0].kernel.shape[0];
  w.key = sub[1].kernel.shape[0];
  w.value = sub[2].kernel.shape[0];
  const std::int64_t output = expected.output_dim.value_or(-1);
  expect_shape(source, sub[3].kernel, "(num_heads, value_dim, O)",
               {w.heads, w.value_dim, output == 0 ? w.query : output},
               output == 0 ? why + "; O = Eq without output_shape" : why);
  w.output_dim = sub[3].kernel.shape[2];
  w.use_bias = expected.use_bias.value_or(sub[0].bias.has_value());
  const std::vector<std::int64_t> bias_shapes[4] = {
      {w.heads, w.key_dim}, {w.heads, w.key_dim}, {w.heads, w.value_dim}, {w.output_dim}};
  for (int i = 0; i < 4; ++i) {
    const std::string bias = sub[i].vars + "/1";
    if (w.use_bias && !sub[i].bias)
      fail<FormatError>(kWhere, "'", source.name, "': no dataset '", bias, "'; expected the ",
                        kSublayers[i].keras_name, " bias, since use_bias is true (",
                        expected.use_bias ? why : "the query projection has a bias", ")");
    if (!w.use_bias && sub[i].bias)
      fail<FormatError>(kWhere, "'", source.name, "': dataset '", bias, "' is present; expected ",
                        "no bias, since use_bias is false (",
                        expected.use_bias ? why : "the query projection has none", ")");
    if (sub[i].bias)
      expect_shape(source, *sub[i].bias, kSublayers[i].bias_shape, bias_shapes[i], why);
  }
  return w;
}

template <typename Scalar>
RowMatrix<Scalar> read_kernel(const H5Source& source, const Dataset& dataset, Index rows,
                              Index cols) {
  const std::vector<Scalar> values = read_values<Scalar>(source, dataset);
  return Eigen::Map<const RowMatrix<Scalar>>(values.data(), rows, cols);
}

template <typename Scalar>
Vector<Scalar> read_bias(const H5Source& source, const std::optional<Dataset>& dataset) {
  if (!dataset) return Vector<Scalar>();
  const std::vector<Scalar> values = read_values<Scalar>(source, *dataset);
  return Eigen::Map<const Vector<Scalar>>(values.data(), Index(values.size()));
}

template <typename Scalar>
io::KerasLayer<Scalar> read_layer(const KerasFile& file, const Location& location,
                                  const Expected& expected) {
  const H5Source& source = file.h5;
  const SublayerData sub[4] = {
      open_sublayer(source, location.group, 0), open_sublayer(source, location.group, 1),
      open_sublayer(source, location.group, 2), open_sublayer(source, location.group, 3)};
  const Widths w = check_shapes(source, sub, expected);
  io::KerasLayer<Scalar> layer;
  layer.name = location.name;
  layer.group = location.group;
  layer.keras_version = file.keras_version;
  layer.no_keras_version_reason = file.no_keras_version_reason;
  layer.config.num_heads = w.heads;
  layer.config.key_dim = w.key_dim;
  layer.config.value_dim = w.value_dim;
  layer.config.output_dim = w.output_dim;
  layer.config.use_bias = w.use_bias;
  auto& weights = layer.weights;
  weights.query_kernel = read_kernel<Scalar>(source, sub[0].kernel, w.query, w.heads * w.key_dim);
  weights.key_kernel = read_kernel<Scalar>(source, sub[1].kernel, w.key, w.heads * w.key_dim);
  weights.value_kernel = read_kernel<Scalar>(source, sub[2].kernel, w.value, w.heads * w.value_dim);
  weights.output_kernel =
      read_kernel<Scalar>(source, sub[3].kernel, w.heads * w.value_dim, w.output_dim);
  weights.query_bias = read_bias<Scalar>(source, sub[0].bias);
  weights.key_bias = read_bias<Scalar>(source, sub[1].bias);
  weights.value_bias = read_bias<Scalar>(source, sub[2].bias);
  weights.output_bias = read_bias<Scalar>(source, sub[3].bias);
  layer.dims = weights.validate(layer.config);
  return layer;
}

template <typename Scalar>
io::KerasLayer<Scalar> load(const std::string& path, const std::string& layer_name,
                            const MhaConfig* config, const io::KerasReadOptions& options) {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "load_keras_layer reads float or double weights");
  if (config) config->validate();
  Hdf5Session session;
  const KerasFile file = open_keras_file(path);
  if (options.require_keras_version && file.keras_version.empty())
    fail<FormatError>(kWhere, "'", path, "': ", file.no_keras_version_reason,
                      "; expected metadata.json with a keras_version string "
                      "(KerasReadOptions::require_keras_version)");
  const Location location = locate(file, layer_name);
  Expected expected;
  if (location.entry) {
    const std::vector<ConfigLayer> layers = config_layers(file);
    for (const auto& layer : layers)
      if (layer.entry == location.entry) expected = config_expectations(file, layer);
    if (config) check_agreement(file.config_name, expected, caller_expectations(*config));
  } else if (config) {
    expected = caller_expectations(*config);
  }
  auto layer = read_layer<Scalar>(file, location, expected);
  if (!options.allow_non_finite_weights)
    check_finite_weights("load_keras_layer", "'" + file.h5.name + "'", layer.weights);
  return layer;
}

}  // namespace sdmha::detail::keras

namespace sdmha::io {

// The MultiHeadAttention called `layer_name` (a Keras layer name, an HDF5 group path, or empty
// for the file's only one) from a .keras file, its unzipped directory, or a .weights.h5 file. The
// configuration comes from config.json, or else from the kernels' shapes.
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer(const std::string& path, const std::string& layer_name,
                                    const KerasReadOptions& options = {}) {
  return detail::keras::load<Scalar>(path, layer_name, nullptr, options);
}

// The same with the configuration given, for a .weights.h5 file (which holds none): every shape
// is checked against it (value_dim 0 = key_dim, output_dim 0 = Eq, use_bias decides whether the
// bias datasets must be present). With config.json as well, the two must agree.
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer(const std::string& path, const std::string& layer_name,
                                    const MhaConfig& config, const KerasReadOptions& options = {}) {
  return detail::keras::load<Scalar>(path, layer_name, &config, options);
}

// Every MultiHeadAttention of a Keras file: from config.json when there is one, else every HDF5
// group that holds the four projections.
inline std::vector<KerasLayerInfo> keras_attention_layers(const std::string& path) {
  detail::keras::Hdf5Session session;
  const detail::keras::KerasFile file = detail::keras::open_keras_file(path);
  return detail::keras::attention_layers(file, detail::keras::config_layers(file));
}

}  // namespace sdmha::io
