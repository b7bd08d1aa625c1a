// sdmha/io/keras_isolated.hpp — load_keras_layer_isolated: io/keras_file.hpp's loader run in a
// child process (detail/child_process.hpp), for Keras files that may be damaged or hostile.
//
// The Keras reader hands the file to libhdf5, which crashes, hangs or corrupts its heap on some
// damaged files under every check sdmha can make first (docs/bad_input.md, "Trust boundary").
// Here the child reads the layer and sends it back over a pipe; the caller decodes it again with
// every size checked against the bytes that came, and validates the weights against the
// configuration. A crash, a hang past limits.seconds or an allocation past limits.memory_bytes in
// the child is an IoError naming the file; the errors the loader throws (FormatError, IoError,
// ConfigError, ShapeError) arrive with their type and message. The in-process load_keras_layer
// is for trusted files only.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>

#include "sdmha/io/detail/child_process.hpp"
#include "sdmha/io/keras_file.hpp"

namespace sdmha::detail::keras {

// The layer as the child sends it: integers as int64, strings and matrices with their sizes.
class LayerWriter {
 public:
  void integer(std::int64_t value) { raw(&value, sizeof value); }
  void text(const std::string& value) {
    integer(std::int64_t(value.size()));
    raw(value.data(), value.size());
  }
  template <typename Scalar>
  void matrix(const Scalar* data, Index rows, Index cols) {
    integer(rows);
    integer(cols);
    raw(data, std::size_t(rows * cols) * sizeof(Scalar));
  }
  std::string bytes;

 private:
  void raw(const void* data, std::size_t size) {
    bytes.append(static_cast<const char*>(data), size);
  }
};

// Reads what LayerWriter wrote, refusing any size that the bytes received do not hold.
class LayerReader {
 public:
  LayerReader(const std::string& bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  std::int64_t integer() {
    std::int64_t value = 0;
    raw(&value, sizeof value);
    return value;
  }
  std::string text() {
    const std::size_t size = length(integer(), 1);
    std::string value(size, '\0');
    raw(value.data(), size);
    return value;
  }
  template <typename Scalar>
  RowMatrix<Scalar> matrix() {
    const std::int64_t rows = integer(), cols = integer();
    if (rows < 0 || cols < 0 || (rows > 0 && cols > (std::int64_t(1) << 40) / rows)) bad("matrix");
    RowMatrix<Scalar> value(rows, cols);
    raw(value.data(), length(rows * cols, sizeof(Scalar)));
    return value;
  }
  template <typename Scalar>
  Vector<Scalar> vector() {
    const RowMatrix<Scalar> column = matrix<Scalar>();
    return Eigen::Map<const Vector<Scalar>>(column.data(), column.size());
  }
  void expect_end() const {
    if (offset_ != bytes_.size()) bad("end");
  }

 private:
  std::size_t length(std::int64_t count, std::size_t item) const {
    if (count < 0 || std::uint64_t(count) > (bytes_.size() - offset_) / item) bad("size");
    return std::size_t(count) * item;
  }
  void raw(void* data, std::size_t size) {
    if (size > bytes_.size() - offset_) bad("data");
    if (size != 0) std::memcpy(data, bytes_.data() + offset_, size);
    offset_ += size;
  }
  [[noreturn]] void bad(const char* part) const {
    fail<IoError>("load_keras_layer_isolated", path_,
                  ": the isolated reader's reply is malformed (", part, " at byte ", offset_,
                  " of ", bytes_.size(), ")");
  }
  const std::string& bytes_;
  const std::string& path_;
  std::size_t offset_ = 0;
};

template <typename Scalar>
std::string encode(const io::KerasLayer<Scalar>& layer) {
  LayerWriter out;
  const MhaConfig& config = layer.config;
  for (const Index value : {config.num_heads, config.key_dim, config.value_dim, config.output_dim})
    out.integer(value);
  out.integer(config.use_bias ? 1 : 0);
  out.text(layer.name);
  out.text(layer.group);
  out.text(layer.keras_version);
  out.text(layer.no_keras_version_reason);
  const MhaWeights<Scalar>& w = layer.weights;
  for (const RowMatrix<Scalar>* kernel :
       {&w.query_kernel, &w.key_kernel, &w.value_kernel, &w.output_kernel})
    out.matrix(kernel->data(), kernel->rows(), kernel->cols());
  for (const Vector<Scalar>* bias : {&w.query_bias, &w.key_bias, &w.value_bias, &w.output_bias})
    out.matrix(bias->data(), bias->size(), 1);
  return std::move(out.bytes);
}

template <typename Scalar>
io::KerasLayer<Scalar> decode(const std::string& bytes, const std::string& path) {
  LayerReader in(bytes, path);
  io::KerasLayer<Scalar> layer;
  MhaConfig& config = layer.config;
  for (Index* value : {&config.num_heads, &config.key_dim, &config.value_dim, &config.output_dim})
    *value = Index(in.integer());
  config.use_bias = in.integer() != 0;
  layer.name = in.text();
  layer.group = in.text();
  layer.keras_version = in.text();
  layer.no_keras_version_reason = in.text();
  MhaWeights<Scalar>& w = layer.weights;
  for (RowMatrix<Scalar>* kernel :
       {&w.query_kernel, &w.key_kernel, &w.value_kernel, &w.output_kernel})
    *kernel = in.matrix<Scalar>();
  for (Vector<Scalar>* bias : {&w.query_bias, &w.key_bias, &w.value_bias, &w.output_bias})
    *bias = in.vector<Scalar>();
  in.expect_end();
  config.validate();                      // ConfigError
  layer.dims = w.validate(layer.config);  // ShapeError: checked again on arrival
  return layer;
}

// The bytes the reader of `path` reads: the file, or a directory's model.weights.h5 (0 when it
// cannot tell: the reader then says why).
inline std::uint64_t keras_file_bytes(const std::string& path) {
  std::error_code error;
  const bool directory = std::filesystem::is_directory(path, error);
  const std::uintmax_t size =
      std::filesystem::file_size(directory ? path + "/model.weights.h5" : path, error);
  return error ? 0 : std::uint64_t(size);
}

template <typename Scalar>
io::KerasLayer<Scalar> load_isolated(const std::string& path, const std::string& layer_name,
                                     const MhaConfig* config, const io::KerasReadOptions& options) {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "load_keras_layer_isolated reads float or double weights");
  if (config) config->validate();  // before the fork: a bad argument costs no child
  io::KerasReadOptions in_child = options;
  in_child.allow_non_finite_weights = true;  // checked here, on what arrives
  io::IsolationLimits limits = options.isolation;
  limits.seconds = io::reader_seconds(limits, double(keras_file_bytes(path)));
  const std::string reply = run_in_child("load_keras_layer_isolated", path, limits, [&] {
    return encode(load<Scalar>(path, layer_name, config, in_child));
  });
  auto layer = decode<Scalar>(reply, path);
  if (!options.allow_non_finite_weights)
    check_finite_weights("load_keras_layer_isolated", "'" + path + "'", layer.weights);
  return layer;
}

}  // namespace sdmha::detail::keras

namespace sdmha::io {

// Whether `path` is, by its content, something load_keras_layer reads: an HDF5 file (a
// .weights.h5), a zip holding config.json or model.weights.h5 (a .keras file; an .npz holds
// .npy members instead), or a directory holding either. Reads the first bytes and the zip's
// directory, never the HDF5 file itself; a path that cannot be read is not one (the reader that
// opens it says why).
inline bool is_keras_file(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    return std::filesystem::exists(path + "/config.json", error) ||
           std::filesystem::exists(path + "/model.weights.h5", error);
  std::ifstream stream(path, std::ios::binary);
  char magic[8] = {};
  stream.read(magic, sizeof magic);
  if (stream.gcount() == 8 && std::memcmp(magic, "\x89HDF\r\n\x1a\n", 8) == 0) return true;
  if (stream.gcount() < 4 || magic[0] != 'P' || magic[1] != 'K') return false;
  try {
    const auto archive =
        detail::ZipArchive::open("is_keras_file", path, std::filesystem::file_size(path));
    return archive.locate("config.json").has_value() ||
           archive.locate("model.weights.h5").has_value();
  } catch (const Error&) {
    return false;
  } catch (const std::filesystem::filesystem_error&) {
    return false;
  }
}

// load_keras_layer(path, layer_name, options) in a child process under options.isolation: the
// same layer, or the same typed error, or an IoError when the reader crashed, hung or ran out of
// its memory.
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer_isolated(const std::string& path, const std::string& layer_name,
                                             const KerasReadOptions& options = {}) {
  return detail::keras::load_isolated<Scalar>(path, layer_name, nullptr, options);
}

// The same with the configuration given (see load_keras_layer).
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer_isolated(const std::string& path, const std::string& layer_name,
                                             const MhaConfig& config,
                                             const KerasReadOptions& options = {}) {
  return detail::keras::load_isolated<Scalar>(path, layer_name, &config, options);
}

}  // namespace sdmha::io
