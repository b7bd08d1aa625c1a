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
//
// Dependencies: HDF5's C library (Debian: libhdf5-dev; pkg-config `hdf5`), libzip and
// nlohmann/json. The HDF5 calls made here hold a process-wide mutex, and HDF5's automatic error
// printing is off while they run (and restored after).
#pragma once

#include <hdf5.h>
#include <zip.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/npy.hpp"
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
  std::string keras_version;  // from metadata.json; empty for a .weights.h5
};

// One MultiHeadAttention of a Keras file, as keras_attention_layers lists it.
struct KerasLayerInfo {
  std::string name;   // empty when the file does not say (a .weights.h5 from Keras < 3.6)
  std::string group;  // the HDF5 group, which load_keras_layer also accepts as the layer name
};

}  // namespace sdmha::io

namespace sdmha::detail::keras {

using json = nlohmann::json;

constexpr const char* kWhere = "load_keras_layer";
constexpr std::int64_t kMaxDimension = std::int64_t(1) << 24;  // as layer_files.hpp's load_keras
constexpr int kMaxModelNesting = 32;  // models within models in config.json
constexpr int kMaxJsonNesting = 512;  // [ and { levels in config.json
constexpr int kMaxGroupDepth = 64;    // HDF5 group levels searched
constexpr std::size_t kMaxGroupsVisited = 200000;
constexpr std::size_t kMaxLinksPerGroup = 1000000;
constexpr std::size_t kMaxNameLength = 4096;
constexpr std::uint64_t kMaxExpansion = 1032;  // deflate's bound; Keras' own guard uses 1000

// ---- HDF5 handles, errors and the session ------------------------------------------------------

inline std::mutex& hdf5_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Holds the mutex and keeps HDF5 from printing its error stack to stderr; restores both.
class Hdf5Session {
 public:
  Hdf5Session() : lock_(hdf5_mutex()) {
    H5Eget_auto2(H5E_DEFAULT, &function_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~Hdf5Session() { H5Eset_auto2(H5E_DEFAULT, function_, data_); }
  Hdf5Session(const Hdf5Session&) = delete;
  Hdf5Session& operator=(const Hdf5Session&) = delete;

 private:
  std::lock_guard<std::mutex> lock_;
  H5E_auto2_t function_ = nullptr;
  void* data_ = nullptr;
};

inline herr_t collect_hdf5_error(unsigned, const H5E_error2_t* error, void* data) {
  auto& texts = *static_cast<std::vector<std::string>*>(data);
  if (error != nullptr && error->desc != nullptr && error->desc[0] != '\0' && texts.size() < 2)
    texts.emplace_back(error->desc);
  return 0;
}

// The innermost entries of HDF5's error stack (what went wrong first), then clears it.
inline std::string hdf5_error_text() {
  std::vector<std::string> texts;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, collect_hdf5_error, &texts);
  H5Eclear2(H5E_DEFAULT);
  if (texts.empty()) return "HDF5 gives no detail";
  std::string text = "HDF5: " + texts[0];
  for (std::size_t i = 1; i < texts.size(); ++i) text += "; " + texts[i];
  return text;
}

// An HDF5 identifier closed by its own close function.
class H5Id {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Id() = default;
  H5Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  H5Id(H5Id&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = -1; }
  H5Id& operator=(H5Id&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = other.id_;
      closer_ = other.closer_;
      other.id_ = -1;
    }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }

 private:
  void reset() {
    if (id_ >= 0 && closer_ != nullptr) closer_(id_);
    id_ = -1;
  }
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

// An open HDF5 file, named for messages, with its size in bytes for the allocation guards.
struct H5Source {
  H5Id file;
  std::string name;  // the path, or "<archive>[model.weights.h5]"
  std::uint64_t size = 0;
};

// A file access property list: read-only habits (no file locking), all objects closed with the
// file.
inline H5Id file_access_list(const std::string& source) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.valid() || H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG) < 0)
    fail<FormatError>(kWhere, "'", source, "': cannot set up HDF5 file access (", hdf5_error_text(),
                      ")");
#if H5_VERSION_GE(1, 10, 7)
  H5Pset_file_locking(fapl.get(), false, true);
#endif
  return fapl;
}

inline H5Source open_hdf5(const std::string& name, hid_t fapl, std::uint64_t size,
                          const char* expected) {
  H5Source source;
  source.name = name;
  source.size = size;
  source.file = H5Id(H5Fopen(name.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose);
  if (!source.file.valid())
    fail<FormatError>(kWhere, "'", name, "' is not a readable HDF5 file (", hdf5_error_text(),
                      "); expected ", expected);
  return source;
}

// Checks that `path` is a regular file this process can read; returns its size. IoError if not.
inline std::uint64_t readable_file_size(const std::string& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error) fail<IoError>(kWhere, "cannot open '", path, "': ", error.message());
  if (!std::filesystem::is_regular_file(status))
    fail<IoError>(kWhere, "cannot read '", path, "': not a regular file");
  const std::uintmax_t size = std::filesystem::file_size(path, error);
  if (error) fail<IoError>(kWhere, "cannot read the size of '", path, "': ", error.message());
  std::ifstream stream(path, std::ios::binary);
  if (!stream) fail<IoError>(kWhere, "cannot open '", path, "' for reading");
  return static_cast<std::uint64_t>(size);
}

inline H5Source open_hdf5_file(const std::string& path, std::uint64_t size) {
  const H5Id fapl = file_access_list(path);
  return open_hdf5(path, fapl.get(), size, "a Keras .weights.h5 file or a .keras zip archive");
}

// Opens HDF5 bytes held in memory: the core driver with a file image (H5Pset_file_image copies
// the bytes), nothing written to disk.
inline H5Source open_hdf5_image(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  if (bytes.empty()) fail<FormatError>(kWhere, "'", name, "' is empty; expected an HDF5 file");
  const H5Id fapl = file_access_list(name);
  if (H5Pset_fapl_core(fapl.get(), 1 << 16, false) < 0 ||
      H5Pset_file_image(fapl.get(), const_cast<std::uint8_t*>(bytes.data()), bytes.size()) < 0)
    fail<FormatError>(kWhere, "'", name, "': cannot hand the bytes to HDF5 (", hdf5_error_text(),
                      ")");
  return open_hdf5(name, fapl.get(), bytes.size(), "the HDF5 file model.weights.h5");
}

// ---- Walking groups by hard links only --------------------------------------------------------

enum class H5Kind { missing, group, dataset, other };

struct H5Object {
  H5Id id;
  H5Kind kind = H5Kind::missing;
};

inline std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  while (begin <= path.size()) {
    const std::size_t end = std::min(path.find('/', begin), path.size());
    if (end > begin) parts.push_back(path.substr(begin, end - begin));
    begin = end + 1;
  }
  return parts;
}

inline std::string join_path(const std::string& parent, const std::string& child) {
  return parent.empty() ? child : parent + "/" + child;
}

// Opens the child `name` of `parent` (whose path is `parent_path`) through a hard link, as
// Keras' safe_get_h5_group and safe_get_h5_dataset insist; missing if there is no such link.
inline H5Object open_child(const H5Source& source, hid_t parent, const std::string& parent_path,
                           const std::string& name) {
  H5Object object;
  if (name.empty() || name == "." || name.size() > kMaxNameLength) return object;
  const htri_t exists = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
  if (exists <= 0) {
    if (exists < 0) H5Eclear2(H5E_DEFAULT);
    return object;
  }
  const std::string path = join_path(parent_path, name);
  H5L_info_t info;
  if (H5Lget_info(parent, name.c_str(), &info, H5P_DEFAULT) < 0)
    fail<FormatError>(kWhere, "'", source.name, "': cannot read the link '", path, "' (",
                      hdf5_error_text(), ")");
  if (info.type != H5L_TYPE_HARD)
    fail<FormatError>(kWhere, "'", source.name, "': '", path, "' is ",
                      info.type == H5L_TYPE_SOFT ? "a soft" : "an external or user-defined",
                      " link; expected a hard link (Keras refuses other links too)");
  object.id = H5Id(H5Oopen(parent, name.c_str(), H5P_DEFAULT), H5Oclose);
  if (!object.id.valid())
    fail<FormatError>(kWhere, "'", source.name, "': cannot open '", path, "' (", hdf5_error_text(),
                      ")");
  const H5I_type_t type = H5Iget_type(object.id.get());
  object.kind = type == H5I_GROUP     ? H5Kind::group
                : type == H5I_DATASET ? H5Kind::dataset
                                      : H5Kind::other;
  return object;
}

// Opens `path` ('/'-separated, relative to the root group); kind missing if any part is absent
// or a part before the last is not a group.
inline H5Object open_path(const H5Source& source, const std::string& path) {
  H5Object current;
  current.id = H5Id(H5Oopen(source.file.get(), "/", H5P_DEFAULT), H5Oclose);
  if (!current.id.valid())
    fail<FormatError>(kWhere, "'", source.name, "': cannot open the root group (",
                      hdf5_error_text(), ")");
  current.kind = H5Kind::group;
  std::string walked;
  for (const std::string& part : split_path(path)) {
    if (current.kind != H5Kind::group) return H5Object{};
    H5Object next = open_child(source, current.id.get(), walked, part);
    if (next.kind == H5Kind::missing) return next;
    walked = join_path(walked, part);
    current = std::move(next);
  }
  return current;
}

inline bool is_group(const H5Source& source, const std::string& path) {
  return open_path(source, path).kind == H5Kind::group;
}

// The names of a group's links, in name order.
inline std::vector<std::string> link_names(const H5Source& source, hid_t group,
                                           const std::string& path) {
  H5G_info_t info;
  if (H5Gget_info(group, &info) < 0)
    fail<FormatError>(kWhere, "'", source.name, "': cannot list group '", path, "' (",
                      hdf5_error_text(), ")");
  if (info.nlinks > kMaxLinksPerGroup)
    fail<FormatError>(kWhere, "'", source.name, "': group '", path, "' holds ", info.nlinks,
                      " links; expected at most ", kMaxLinksPerGroup);
  std::vector<std::string> names;
  for (hsize_t index = 0; index < info.nlinks; ++index) {
    const ssize_t length =
        H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, index, nullptr, 0, H5P_DEFAULT);
    if (length < 0 || std::size_t(length) > kMaxNameLength)
      fail<FormatError>(kWhere, "'", source.name, "': link ", index, " of group '", path,
                        "' has no readable name of at most ", kMaxNameLength, " bytes");
    std::string name(std::size_t(length) + 1, '\0');
    H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, index, name.data(), name.size(),
                       H5P_DEFAULT);
    name.resize(std::size_t(length));
    names.push_back(std::move(name));
  }
  return names;
}

// A scalar string attribute (variable or fixed length), or nothing if absent or not a string.
inline std::optional<std::string> string_attribute(hid_t object, const char* attribute) {
  if (H5Aexists(object, attribute) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return std::nullopt;
  }
  const H5Id handle(H5Aopen(object, attribute, H5P_DEFAULT), H5Aclose);
  const H5Id type(handle.valid() ? H5Aget_type(handle.get()) : -1, H5Tclose);
  const H5Id space(handle.valid() ? H5Aget_space(handle.get()) : -1, H5Sclose);
  std::optional<std::string> value;
  if (type.valid() && space.valid() && H5Tget_class(type.get()) == H5T_STRING &&
      H5Sget_simple_extent_npoints(space.get()) == 1) {
    if (H5Tis_variable_str(type.get()) > 0) {
      const H5Id memory(H5Tcopy(H5T_C_S1), H5Tclose);
      char* text = nullptr;
      if (memory.valid() && H5Tset_size(memory.get(), H5T_VARIABLE) >= 0 &&
          H5Tset_cset(memory.get(), H5Tget_cset(type.get())) >= 0 &&
          H5Aread(handle.get(), memory.get(), &text) >= 0 && text != nullptr) {
        value = std::string(text, strnlen(text, kMaxNameLength));
        H5free_memory(text);
      }
    } else {
      const std::size_t size = H5Tget_size(type.get());
      std::string text(size, '\0');
      if (size > 0 && size <= kMaxNameLength && H5Aread(handle.get(), type.get(), text.data()) >= 0)
        value = text.substr(0, strnlen(text.data(), size));
    }
  }
  H5Eclear2(H5E_DEFAULT);
  return value;
}

// ---- Datasets -----------------------------------------------------------------------------------

// A dataset opened and checked: its shape, within kMaxDimension per axis, stored in the file.
struct Dataset {
  H5Id id;
  std::string path;
  std::vector<std::int64_t> shape;
};

inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += shape[i] < 0 ? std::string("any") : std::to_string(shape[i]);
  }
  return text + (shape.size() == 1 ? ",)" : ")");
}

inline std::vector<std::int64_t> dataset_shape(const H5Source& source, hid_t dataset,
                                               const std::string& path) {
  const H5Id space(H5Dget_space(dataset), H5Sclose);
  const int rank = space.valid() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (rank < 0 || rank > H5S_MAX_RANK)
    fail<FormatError>(kWhere, "'", source.name, "': dataset '", path, "' has no readable shape (",
                      hdf5_error_text(), ")");
  if (H5Sget_simple_extent_type(space.get()) == H5S_NULL)
    fail<FormatError>(kWhere, "'", source.name, "': dataset '", path,
                      "' has a null dataspace; expected an array");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0)
    fail<FormatError>(kWhere, "'", source.name, "': dataset '", path, "' has no readable shape (",
                      hdf5_error_text(), ")");
  std::vector<std::int64_t> shape;
  for (const hsize_t dimension : dims) {
    if (dimension > hsize_t(kMaxDimension))
      fail<FormatError>(kWhere, "'", source.name, "': dataset '", path, "' has a dimension of ",
                        dimension, "; expected at most 2^24");
    shape.push_back(std::int64_t(dimension));
  }
  return shape;
}

// Refuses what Keras' safe_get_h5_dataset refuses (external and virtual storage) and any dataset
// whose declared size the file cannot hold: a contiguous dataset stores exactly its bytes, and a
// chunked one cannot inflate by more than deflate's 1032:1.
inline void check_storage(const H5Source& source, const Dataset& dataset, hid_t file_type) {
  const H5Id plist(H5Dget_create_plist(dataset.id.get()), H5Pclose);
  const H5D_layout_t layout = plist.valid() ? H5Pget_layout(plist.get()) : H5D_LAYOUT_ERROR;
  const std::string subject = "'" + source.name + "': dataset '" + dataset.path + "'";
  if (layout == H5D_LAYOUT_ERROR || layout == H5D_VIRTUAL)
    fail<FormatError>(kWhere, subject, " has ", layout == H5D_VIRTUAL ? "a virtual" : "no readable",
                      " layout; expected data stored in the file");
  if (H5Pget_external_count(plist.get()) != 0)
    fail<FormatError>(kWhere, subject, " keeps its data in external files; expected it stored in",
                      " the file (Keras refuses external datasets too)");
  std::uint64_t declared = H5Tget_size(file_type);  // saturating: any rank, dimensions <= 2^24
  for (const std::int64_t dimension : dataset.shape)
    declared = dimension == 0 ? 0
               : declared > std::numeric_limits<std::uint64_t>::max() / std::uint64_t(dimension)
                   ? std::numeric_limits<std::uint64_t>::max()
                   : declared * std::uint64_t(dimension);
  const std::uint64_t stored = H5Dget_storage_size(dataset.id.get());
  if (stored > source.size)
    fail<FormatError>(kWhere, subject, " claims ", stored, " stored bytes in a file of ",
                      source.size, "; expected at most the file's size");
  const bool chunked = layout == H5D_CHUNKED;
  if ((!chunked && stored != declared) ||
      (chunked && declared > stored * kMaxExpansion + (std::uint64_t(1) << 16)))
    fail<FormatError>(kWhere, subject, " declares ", declared, " bytes, shape ",
                      shape_text(dataset.shape), ", but stores ", stored, "; expected ",
                      chunked ? "at most 1032 declared bytes per stored byte" : "equal sizes",
                      " (a truncated, unwritten or forged dataset)");
}

// Opens the dataset at `path` and checks its type and storage; FormatError if it is missing.
inline Dataset open_dataset(const H5Source& source, const std::string& path,
                            const std::string& meaning) {
  H5Object object = open_path(source, path);
  if (object.kind != H5Kind::dataset)
    fail<FormatError>(kWhere, "'", source.name,
                      "': ", object.kind == H5Kind::missing ? "no dataset '" : "'", path,
                      object.kind == H5Kind::missing ? "'" : "' is not a dataset",
                      "; expected the ", meaning);
  Dataset dataset{std::move(object.id), path, {}};
  dataset.shape = dataset_shape(source, dataset.id.get(), path);
  const H5Id type(H5Dget_type(dataset.id.get()), H5Tclose);
  const H5T_class_t type_class = type.valid() ? H5Tget_class(type.get()) : H5T_NO_CLASS;
  if (type_class != H5T_FLOAT) {
    const auto declared = string_attribute(dataset.id.get(), "dtype");
    fail<FormatError>(kWhere, "'", source.name, "': dataset '", path, "' (the ", meaning,
                      ") is not floating point (HDF5 type class ", int(type_class),
                      declared ? ", Keras dtype " + *declared : std::string(),
                      "); expected float16, float32 or float64 (quantized and bfloat16 "
                      "variables are not supported)");
  }
  check_storage(source, dataset, type.get());
  return dataset;
}

template <typename Scalar>
std::vector<Scalar> read_values(const H5Source& source, const Dataset& dataset) {
  std::size_t count = 1;
  for (const std::int64_t dimension : dataset.shape) count *= std::size_t(dimension);
  std::vector<Scalar> values(count);
  const hid_t memory_type =
      std::is_same<Scalar, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  if (count > 0 &&
      H5Dread(dataset.id.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0)
    fail<FormatError>(kWhere, "'", source.name, "': cannot read dataset '", dataset.path, "' (",
                      hdf5_error_text(), ")");
  return values;
}

// ---- The .keras archive ------------------------------------------------------------------------

// Reads one member whole, checking its sizes against the archive before allocating (as
// NpzFile::read does) and its CRC at the end.
inline std::vector<std::uint8_t> read_member(zip_t* archive, const std::string& path,
                                             std::uint64_t archive_size, zip_int64_t index,
                                             const std::string& member) {
  zip_stat_t stat;
  zip_stat_init(&stat);
  if (zip_stat_index(archive, zip_uint64_t(index), 0, &stat) != 0)
    fail_zip(zip_error_code_zip(zip_get_error(archive)), kWhere, "'", path,
             "': cannot stat member '", member, "': ", zip_strerror(archive));
  constexpr zip_uint64_t needed = ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_COMP_METHOD;
  const std::string subject = "'" + path + "': member '" + member + "'";
  if ((stat.valid & needed) != needed)
    fail<FormatError>(kWhere, subject, " does not record its sizes and compression method");
  if (stat.comp_size > archive_size)
    fail<FormatError>(kWhere, subject, " claims ", stat.comp_size,
                      " compressed bytes; expected at most the archive's ", archive_size);
  const bool stored = stat.comp_method == ZIP_CM_STORE;
  if (!stored && stat.comp_method != ZIP_CM_DEFLATE)
    fail<FormatError>(kWhere, subject, " uses compression method ", stat.comp_method,
                      "; expected stored (0) or deflated (8)");
  if ((stored && stat.size != stat.comp_size) ||
      (!stored && stat.size > stat.comp_size * kMaxExpansion + 1024))
    fail<FormatError>(
        kWhere, subject, " claims ", stat.size, " bytes from ", stat.comp_size,
        stored ? " stored; expected equal sizes" : " deflated; expected at most 1032x");
  if (stat.size > std::numeric_limits<std::size_t>::max() / 2)
    fail<FormatError>(kWhere, subject, " is ", stat.size, " bytes, more than this platform holds");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(stat.size));
  std::unique_ptr<zip_file_t, ZipMemberCloser> file(
      zip_fopen_index(archive, zip_uint64_t(index), 0));
  if (!file)
    fail_zip(zip_error_code_zip(zip_get_error(archive)), kWhere, subject,
             ": cannot be opened: ", zip_strerror(archive));
  std::size_t total = 0;
  std::uint8_t extra = 0;
  while (true) {  // one read past the end makes libzip check the CRC
    const bool done = total == bytes.size();
    const zip_int64_t got = done
                                ? zip_fread(file.get(), &extra, 1)
                                : zip_fread(file.get(), bytes.data() + total, bytes.size() - total);
    if (got < 0)
      fail_zip(zip_error_code_zip(zip_file_get_error(file.get())), kWhere, subject,
               ": cannot be read: ", zip_error_strerror(zip_file_get_error(file.get())));
    if (done && got > 0)
      fail<FormatError>(kWhere, subject, " is longer than its declared ", bytes.size(), " bytes");
    if (got == 0 && !done)
      fail<FormatError>(kWhere, subject, " ends after ", total, " bytes; expected ", bytes.size(),
                        " (truncated)");
    if (done) break;
    total += std::size_t(got);
  }
  return bytes;
}

// What a Keras file holds: the weights, and for a .keras file its config.json tree.
struct KerasFile {
  H5Source h5;
  std::optional<json> config;
  std::string config_name;  // "<path>[config.json]" in messages
  std::string keras_version;
};

// Refuses deeper nesting before parsing: building and destroying a million nested arrays
// exhausts the stack. Keras configs nest a few levels per model.
inline void check_json_nesting(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const char c = static_cast<char>(bytes[i]);
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonNesting)
        fail<FormatError>(kWhere, "'", name, "' nests JSON more than ", kMaxJsonNesting,
                          " levels deep at byte ", i, "; expected a Keras config");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

inline json parse_json(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  check_json_nesting(bytes, name);
  try {
    json value = json::parse(bytes.begin(), bytes.end());
    if (!value.is_object())
      fail<FormatError>(kWhere, "'", name, "' is a JSON ", value.type_name(),
                        "; expected an object");
    return value;
  } catch (const json::exception& error) {
    fail<FormatError>(kWhere, "'", name, "' is not valid JSON (", error.what(), ")");
  }
}

inline std::string keras_version_of(const std::vector<std::uint8_t>& bytes) {
  const json metadata = json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (metadata.is_object() && metadata.contains("keras_version") &&
      metadata["keras_version"].is_string())
    return metadata["keras_version"].get<std::string>();
  return std::string();
}

inline KerasFile open_keras_zip(const std::string& path, std::uint64_t size) {
  int code = 0;
  std::unique_ptr<zip_t, ZipArchiveCloser> archive(zip_open(path.c_str(), ZIP_RDONLY, &code));
  if (!archive) {
    zip_error_t error;
    zip_error_init_with_code(&error, code);
    const std::string reason = zip_error_strerror(&error);
    zip_error_fini(&error);
    fail_zip(code, kWhere, "cannot open '", path, "' as a zip archive: ", reason,
             "; expected a .keras file");
  }
  auto locate = [&](const char* member) { return zip_name_locate(archive.get(), member, 0); };
  const zip_int64_t weights = locate("model.weights.h5"), config = locate("config.json");
  if (weights < 0)
    fail<FormatError>(kWhere, "'", path, "' has no member 'model.weights.h5'",
                      locate("model.weights.npz") >= 0 ? " (its weights are in model.weights.npz,"
                                                         " which is not supported)"
                                                       : "",
                      "; expected a .keras file with HDF5 weights");
  if (config < 0)
    fail<FormatError>(kWhere, "'", path, "' has no member 'config.json'; expected a .keras file");
  KerasFile file;
  file.config_name = path + "[config.json]";
  file.config =
      parse_json(read_member(archive.get(), path, size, config, "config.json"), file.config_name);
  const zip_int64_t metadata = locate("metadata.json");
  if (metadata >= 0)
    file.keras_version =
        keras_version_of(read_member(archive.get(), path, size, metadata, "metadata.json"));
  file.h5 = open_hdf5_image(read_member(archive.get(), path, size, weights, "model.weights.h5"),
                            path + "[model.weights.h5]");
  return file;
}

// The directory that saving_lib.save_model(..., zipped=False) writes.
inline KerasFile open_keras_directory(const std::string& path) {
  const std::string weights = path + "/model.weights.h5", config = path + "/config.json";
  KerasFile file;
  file.config_name = config;
  readable_file_size(config);
  file.config = parse_json(read_file_bytes(kWhere, config), config);
  const std::string metadata = path + "/metadata.json";
  std::error_code error;
  if (std::filesystem::is_regular_file(metadata, error))
    file.keras_version = keras_version_of(read_file_bytes(kWhere, metadata));
  file.h5 = open_hdf5_file(weights, readable_file_size(weights));
  return file;
}

inline KerasFile open_keras_file(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) return open_keras_directory(path);
  const std::uint64_t size = readable_file_size(path);
  char magic[4] = {};
  std::ifstream stream(path, std::ios::binary);
  stream.read(magic, sizeof magic);
  if (stream.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' &&
      ((magic[2] == 3 && magic[3] == 4) || (magic[2] == 5 && magic[3] == 6)))
    return open_keras_zip(path, size);
  if (size == 0) fail<FormatError>(kWhere, "'", path, "' is empty; expected a Keras file");
  KerasFile file;
  file.h5 = open_hdf5_file(path, size);
  return file;
}

// ---- config.json --------------------------------------------------------------------------------

// Keras' naming.to_snake_case: drop non-word characters, '_' before a capital that starts a
// lower-case run and between a lower-case letter and a capital, then lower-case.
inline std::string to_snake_case(const std::string& name) {
  std::string word;
  for (const char c : name)
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
        static_cast<unsigned char>(c) >= 0x80)
      word += c;
  auto upper = [&](std::size_t i) {
    return i < word.size() && std::isupper((unsigned char)word[i]);
  };
  auto lower = [&](std::size_t i) {
    return i < word.size() && std::islower((unsigned char)word[i]);
  };
  std::string first;  // re.sub("(.)([A-Z][a-z]+)", r"\1_\2", ...): non-overlapping, left to right
  for (std::size_t i = 0; i < word.size();) {
    if (upper(i + 1) && lower(i + 2)) {
      std::size_t end = i + 2;
      while (lower(end)) ++end;
      first += word.substr(i, 1) + "_" + word.substr(i + 1, end - i - 1);
      i = end;
    } else {
      first += word[i++];
    }
  }
  word.swap(first);
  std::string second;  // re.sub("([a-z])([A-Z])", r"\1_\2", ...)
  for (std::size_t i = 0; i < word.size();) {
    if (lower(i) && upper(i + 1)) {
      second += word.substr(i, 1) + "_" + word.substr(i + 1, 1);
      i += 2;
    } else {
      second += word[i++];
    }
  }
  for (char& c : second) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return second;
}

// A layer entry of config.json with the HDF5 group that saving_lib gives it.
struct ConfigLayer {
  std::string name;
  std::string class_name;
  std::string group;
  std::string location;  // where in config.json, for messages
  const json* entry = nullptr;
};

inline const json* member(const json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  const auto found = object.find(key);
  return found == object.end() || found->is_null() ? nullptr : &*found;
}

inline std::string entry_name(const json& entry) {
  const json* config = member(entry, "config");
  const json* name = config ? member(*config, "name") : nullptr;
  if (!name) name = member(entry, "name");
  return name && name->is_string() ? name->get<std::string>() : std::string();
}

// Walks a serialized object as saving_lib walks the model: the `layers` of a Functional or
// Sequential model (any config with a "layers" list) go to `<group>/layers/<class>[_n]`.
inline void collect_layers(const KerasFile& file, const json& entry, const std::string& group,
                           const std::string& location, int depth, std::vector<ConfigLayer>& out) {
  const json* class_name = member(entry, "class_name");
  if (!class_name || !class_name->is_string())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", location,
                      " has no string 'class_name'; expected a serialized Keras object");
  out.push_back({entry_name(entry), class_name->get<std::string>(), group, location, &entry});
  const json* config = member(entry, "config");
  const json* layers = config ? member(*config, "layers") : nullptr;
  if (!layers || !layers->is_array() || out.back().class_name == "MultiHeadAttention") return;
  if (depth >= kMaxModelNesting)
    fail<FormatError>(kWhere, "'", file.config_name, "': ", location, " nests models more than ",
                      kMaxModelNesting, " deep");
  std::map<std::string, int> used;  // saving_lib._get_unique_name
  for (std::size_t i = 0; i < layers->size(); ++i) {
    const json& child = (*layers)[i];
    const json* child_class = member(child, "class_name");
    const std::string child_location = location + ".config.layers[" + std::to_string(i) + "]";
    if (!child_class || !child_class->is_string())
      fail<FormatError>(kWhere, "'", file.config_name, "': ", child_location,
                        " has no string 'class_name'; expected a serialized Keras layer");
    const std::string snake = to_snake_case(child_class->get<std::string>());
    const auto [it, first] = used.emplace(snake, 0);
    const std::string unique = first ? snake : snake + "_" + std::to_string(++it->second);
    collect_layers(file, child, join_path(group, "layers/" + unique), child_location, depth + 1,
                   out);
  }
}

inline std::vector<ConfigLayer> config_layers(const KerasFile& file) {
  std::vector<ConfigLayer> layers;
  if (file.config) collect_layers(file, *file.config, "", "config.json", 0, layers);
  return layers;
}

// ---- Finding the layer in the HDF5 file ---------------------------------------------------------

struct Sublayer {
  const char* keras_name;    // the EinsumDense's name
  const char* property;      // MultiHeadAttention's public property, the group since Keras 3.0.3
  const char* attribute;     // the private attribute, the group in Keras 3.0.0-3.0.2
  const char* kernel_shape;  // for messages
  const char* bias_shape;
};

constexpr Sublayer kSublayers[4] = {
    {"query", "query_dense", "_query_dense", "(Eq, num_heads, key_dim)", "(num_heads, key_dim)"},
    {"key", "key_dense", "_key_dense", "(Ek, num_heads, key_dim)", "(num_heads, key_dim)"},
    {"value", "value_dense", "_value_dense", "(Ev, num_heads, value_dim)",
     "(num_heads, value_dim)"},
    {"attention_output", "output_dense", "_output_dense", "(num_heads, value_dim, O)", "(O,)"}};

// `<layer>/query_dense/vars` or `<layer>/_query_dense/vars`; empty if neither is a group.
inline std::string sublayer_vars(const H5Source& source, const std::string& layer, int which) {
  for (const char* name : {kSublayers[which].property, kSublayers[which].attribute}) {
    const std::string vars = join_path(layer, std::string(name) + "/vars");
    if (is_group(source, vars)) return vars;
  }
  return std::string();
}

inline bool holds_attention(const H5Source& source, const std::string& layer) {
  for (int which = 0; which < 4; ++which)
    if (sublayer_vars(source, layer, which).empty()) return false;
  return true;
}

inline std::optional<std::string> group_name(const H5Source& source, const std::string& layer) {
  const H5Object vars = open_path(source, join_path(layer, "vars"));
  if (vars.kind != H5Kind::group) return std::nullopt;
  return string_attribute(vars.id.get(), "name");
}

// Every group that holds a MultiHeadAttention's sublayers, with its `name` attribute if any.
inline void scan_groups(const H5Source& source, hid_t group, const std::string& path, int depth,
                        std::size_t& visited, std::vector<io::KerasLayerInfo>& out) {
  if (++visited > kMaxGroupsVisited)
    fail<FormatError>(kWhere, "'", source.name, "' has more than ", kMaxGroupsVisited,
                      " groups (or links that revisit them); expected a Keras weights file");
  if (!path.empty() && holds_attention(source, path)) {
    out.push_back({group_name(source, path).value_or(std::string()), path});
    return;
  }
  if (depth >= kMaxGroupDepth) return;
  for (const std::string& name : link_names(source, group, path)) {
    if (name == "vars") continue;
    const H5Object child = open_child(source, group, path, name);
    if (child.kind == H5Kind::group)
      scan_groups(source, child.id.get(), join_path(path, name), depth + 1, visited, out);
  }
}

inline std::vector<io::KerasLayerInfo> scan_attention_groups(const H5Source& source) {
  const H5Object root = open_path(source, "");
  std::vector<io::KerasLayerInfo> found;
  std::size_t visited = 0;
  scan_groups(source, root.id.get(), "", 0, visited, found);
  return found;
}

struct Location {
  std::string name;
  std::string group;
  const json* entry = nullptr;  // the layer's config.json entry, when there is one
};

inline std::string describe(const std::vector<io::KerasLayerInfo>& layers) {
  std::string text;
  for (const auto& layer : layers)
    text += (text.empty() ? "" : ", ") +
            (layer.name.empty() ? std::string() : "'" + layer.name + "' at ") + "'" + layer.group +
            "'";
  return text.empty() ? std::string("(none)") : text;
}

// The group of a config.json layer in the weights file: its own, or, for files that Keras 2.13+
// wrote, the same with `_layer_checkpoint_dependencies` for `layers` (H5IOStore.get).
inline Location config_location(const KerasFile& file, const ConfigLayer& layer) {
  std::string group = layer.group;
  if (!holds_attention(file.h5, group)) {
    std::string legacy;
    for (const std::string& part : split_path(group))
      legacy = join_path(legacy, part == "layers" ? "_layer_checkpoint_dependencies" : part);
    if (!legacy.empty() && holds_attention(file.h5, legacy))
      group = legacy;
    else
      fail<FormatError>(kWhere, "'", file.h5.name, "': config.json places MultiHeadAttention '",
                        layer.name, "' at group '", group, "', which does not hold '", group,
                        "/query_dense/vars', '", group, "/key_dense/vars', '", group,
                        "/value_dense/vars' and '", group, "/output_dense/vars'");
  }
  const auto stored = group_name(file.h5, group);
  if (stored && *stored != layer.name)
    fail<FormatError>(kWhere, "'", file.h5.name, "': group '", group, "' is named '", *stored,
                      "' but config.json places '", layer.name, "' there");
  return {layer.name, group, layer.entry};
}

inline std::vector<io::KerasLayerInfo> attention_layers(const KerasFile& file,
                                                        const std::vector<ConfigLayer>& layers) {
  std::vector<io::KerasLayerInfo> found;
  for (const auto& layer : layers)
    if (layer.class_name == "MultiHeadAttention") found.push_back({layer.name, layer.group});
  return found.empty() ? scan_attention_groups(file.h5) : found;
}

// By the name config.json gives the layer.
inline std::optional<Location> by_config_name(const KerasFile& file,
                                              const std::vector<ConfigLayer>& layers,
                                              const std::string& layer_name) {
  std::vector<const ConfigLayer*> named, attention;
  for (const auto& layer : layers)
    if (layer.name == layer_name) named.push_back(&layer);
  for (const ConfigLayer* layer : named)
    if (layer->class_name == "MultiHeadAttention") attention.push_back(layer);
  if (attention.size() > 1)
    fail<FormatError>(kWhere, "'", file.config_name, "': several MultiHeadAttention layers are ",
                      "named '", layer_name, "' (at '", attention[0]->group, "' and '",
                      attention[1]->group, "'); expected one, or the group path as the name");
  if (attention.size() == 1) return config_location(file, *attention[0]);
  if (!named.empty())
    fail<FormatError>(kWhere, "'", file.config_name, "': layer '", layer_name, "' (",
                      named[0]->location, ") is a ", named[0]->class_name,
                      "; expected a MultiHeadAttention");
  return std::nullopt;
}

// By the `name` attribute of the groups (Keras >= 3.6), when config.json does not describe the
// attention layers (there is none, or the model is subclassed).
inline std::optional<Location> by_group_name(const KerasFile& file,
                                             const std::vector<ConfigLayer>& layers,
                                             const std::string& layer_name) {
  for (const auto& layer : layers)
    if (layer.class_name == "MultiHeadAttention") return std::nullopt;
  std::vector<io::KerasLayerInfo> found;
  for (const auto& layer : scan_attention_groups(file.h5))
    if (layer.name == layer_name) found.push_back(layer);
  if (found.size() > 1)
    fail<FormatError>(kWhere, "'", file.h5.name, "': several MultiHeadAttention groups are named '",
                      layer_name, "': ", describe(found), "; expected one, or the group path");
  if (found.empty()) return std::nullopt;
  return Location{found[0].name, found[0].group, nullptr};
}

// The layer at `group`, with its config.json entry when there is one.
inline Location at_group(const KerasFile& file, const std::vector<ConfigLayer>& layers,
                         const std::string& group) {
  for (const auto& layer : layers)
    if (layer.group == group && layer.class_name == "MultiHeadAttention")
      return config_location(file, layer);
  return {group_name(file.h5, group).value_or(std::string()), group, nullptr};
}

inline Location locate(const KerasFile& file, const std::string& layer_name) {
  const std::vector<ConfigLayer> layers = config_layers(file);
  // Keras refuses '/' in layer names (ops/operation.py, Operation.__init__): such a name is a path.
  if (!layer_name.empty() && layer_name.find('/') == std::string::npos) {
    if (auto found = by_config_name(file, layers, layer_name)) return *found;
    if (auto found = by_group_name(file, layers, layer_name)) return *found;
  }
  std::string group;
  for (const auto& part : split_path(layer_name)) group = join_path(group, part);
  if (!group.empty() && holds_attention(file.h5, group)) return at_group(file, layers, group);
  const std::vector<io::KerasLayerInfo> all = attention_layers(file, layers);
  if (layer_name.empty() && all.size() == 1) return at_group(file, layers, all[0].group);
  fail<FormatError>(kWhere, "'", file.config ? file.config_name : file.h5.name, "': ",
                    layer_name.empty()
                        ? std::string("no layer name given and the file holds ") +
                              std::to_string(all.size()) + " MultiHeadAttention layers"
                        : "no MultiHeadAttention layer named '" + layer_name + "'",
                    "; expected one of: ", describe(all), " (a layer name, or an HDF5 group path)");
}

// ---- The configuration --------------------------------------------------------------------------

// What the configuration fixes; nothing = whatever the datasets say.
struct Expected {
  std::optional<std::int64_t> heads, key_dim, value_dim, output_dim;  // output_dim 0 = Eq
  std::optional<bool> use_bias;
  std::optional<std::int64_t> query_width, key_width, value_width;  // from build_config
  std::string source;  // "config.json" or "the MhaConfig given"
};

inline std::int64_t positive_integer(const KerasFile& file, const ConfigLayer& layer,
                                     const json& value, const char* key) {
  if (!value.is_number_integer() || value.get<std::int64_t>() <= 0 ||
      value.get<std::int64_t>() > kMaxDimension)
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config.", key, " = ",
                      value.dump(), "; expected an integer in [1, 2^24]");
  return value.get<std::int64_t>();
}

[[noreturn]] inline void unsupported(const KerasFile& file, const ConfigLayer& layer,
                                     const std::string& key, const json& value, const char* why) {
  fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config.", key, " = ",
                    value.dump(), " is not supported: ", why);
}

// The last dimension of a build shape such as [null, 3, 5]; checks the rank sdmha computes.
inline std::optional<std::int64_t> build_width(const KerasFile& file, const ConfigLayer& layer,
                                               const json& shapes, const char* key) {
  const json* shape = member(shapes, key);
  if (!shape) return std::nullopt;
  if (!shape->is_array() || shape->size() != 3 || !shape->back().is_number_integer())
    unsupported(file, layer, std::string("build_config.shapes_dict.") + key, *shape,
                "sdmha takes (batch, steps, features) inputs");
  return positive_integer(file, layer, shape->back(), key);
}

inline void check_supported(const KerasFile& file, const ConfigLayer& layer, const json& config) {
  if (const json* axes = member(config, "attention_axes")) {
    const json first = axes->is_array() && axes->size() == 1 ? (*axes)[0] : *axes;
    if (!first.is_number_integer() ||
        (first.get<std::int64_t>() != 1 && first.get<std::int64_t>() != -2))
      unsupported(file, layer, "attention_axes", *axes, "sdmha attends over axis 1 only");
  }
  if (const json* gate = member(config, "use_gate"); gate && *gate != json(false))
    unsupported(file, layer, "use_gate", *gate, "sdmha has no gated attention");
  if (const json* window = member(config, "sliding_window"))
    unsupported(file, layer, "sliding_window", *window, "give sdmha an attention_mask instead");
  const json* dtype = member(config, "dtype");
  const json* policy = dtype && dtype->is_object() ? member(*dtype, "config") : nullptr;
  const json* policy_name = policy ? member(*policy, "name") : dtype;
  if (policy_name && policy_name->is_string() &&
      policy_name->get<std::string>().find("_from_") != std::string::npos)
    unsupported(file, layer, "dtype", *dtype, "quantized layers are not read");
}

inline Expected config_expectations(const KerasFile& file, const ConfigLayer& layer) {
  const json* config = member(*layer.entry, "config");
  if (!config || !config->is_object())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location,
                      " has no 'config' object; expected MultiHeadAttention's configuration");
  Expected expected;
  expected.source = "config.json";
  auto required = [&](const char* key) {
    const json* value = member(*config, key);
    if (!value)
      fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location, ".config has no '",
                        key, "'; expected MultiHeadAttention's configuration");
    return positive_integer(file, layer, *value, key);
  };
  expected.heads = required("num_heads");
  expected.key_dim = required("key_dim");
  const json* value_dim = member(*config, "value_dim");
  expected.value_dim =
      value_dim ? positive_integer(file, layer, *value_dim, "value_dim") : *expected.key_dim;
  const json* use_bias = member(*config, "use_bias");
  if (use_bias && !use_bias->is_boolean())
    fail<FormatError>(kWhere, "'", file.config_name, "': ", layer.location,
                      ".config.use_bias = ", use_bias->dump(), "; expected true or false");
  expected.use_bias = use_bias ? use_bias->get<bool>() : true;
  expected.output_dim = 0;
  if (const json* output = member(*config, "output_shape")) {
    if (output->is_array() && output->size() > 1)
      unsupported(file, layer, "output_shape", *output, "sdmha's output is one vector per step");
    if (!output->is_array() || output->size() == 1)
      expected.output_dim = positive_integer(
          file, layer, output->is_array() ? (*output)[0] : *output, "output_shape");
  }
  check_supported(file, layer, *config);
  const json* build = member(*layer.entry, "build_config");
  const json* shapes = build ? member(*build, "shapes_dict") : nullptr;
  if (shapes && shapes->is_object()) {
    expected.query_width = build_width(file, layer, *shapes, "query_shape");
    expected.value_width = build_width(file, layer, *shapes, "value_shape");
    expected.key_width = build_width(file, layer, *shapes, "key_shape");
    if (!expected.key_width) expected.key_width = expected.value_width;  // key defaults to value
  }
  return expected;
}

inline Expected caller_expectations(const MhaConfig& config) {
  Expected expected;
  expected.source = "the MhaConfig given";
  expected.heads = config.num_heads;
  expected.key_dim = config.key_dim;
  expected.value_dim = config.resolved_value_dim();
  expected.output_dim = config.output_dim;
  expected.use_bias = config.use_bias;
  return expected;
}

// config.json and the caller's MhaConfig must agree where both speak; an output width of 0 (the
// query's width) is checked against the datasets instead.
inline void check_agreement(const std::string& file_name, Expected& file, const Expected& caller) {
  const std::pair<const char*, std::pair<std::optional<std::int64_t>, std::optional<std::int64_t>>>
      values[] = {{"num_heads", {file.heads, caller.heads}},
                  {"key_dim", {file.key_dim, caller.key_dim}},
                  {"value_dim", {file.value_dim, caller.value_dim}},
                  {"output_dim",
                   {file.output_dim != 0 && caller.output_dim != 0 ? file.output_dim : std::nullopt,
                    caller.output_dim}}};
  for (const auto& [key, pair] : values)
    if (pair.first && pair.second && *pair.first != *pair.second)
      fail<FormatError>(kWhere, "'", file_name, "': config.json gives ", key, " = ", *pair.first,
                        " but the MhaConfig given says ", *pair.second, " (0 = default)");
  if (file.use_bias && caller.use_bias && *file.use_bias != *caller.use_bias)
    fail<FormatError>(kWhere, "'", file_name,
                      "': config.json gives use_bias = ", *file.use_bias ? "true" : "false",
                      " but the MhaConfig given says ", *caller.use_bias ? "true" : "false");
  if (file.output_dim == 0 && caller.output_dim != 0) {
    file.output_dim = caller.output_dim;
    file.source = "config.json and the MhaConfig given";
  }
}

// ---- Reading the weights ------------------------------------------------------------------------

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
                      shape_text(dataset.shape), "; expected ", meaning, " = ",
                      shape_text(expected), ", every dimension > 0 (", why, ")");
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
                            const MhaConfig* config) {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "load_keras_layer reads float or double weights");
  if (config) config->validate();
  Hdf5Session session;
  const KerasFile file = open_keras_file(path);
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
  return read_layer<Scalar>(file, location, expected);
}

}  // namespace sdmha::detail::keras

namespace sdmha::io {

// The MultiHeadAttention called `layer_name` (a Keras layer name, an HDF5 group path, or empty
// for the file's only one) from a .keras file, its unzipped directory, or a .weights.h5 file. The
// configuration comes from config.json, or else from the kernels' shapes.
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer(const std::string& path, const std::string& layer_name) {
  return detail::keras::load<Scalar>(path, layer_name, nullptr);
}

// The same with the configuration given, for a .weights.h5 file (which holds none): every shape
// is checked against it (value_dim 0 = key_dim, output_dim 0 = Eq, use_bias decides whether the
// bias datasets must be present). With config.json as well, the two must agree.
template <typename Scalar>
KerasLayer<Scalar> load_keras_layer(const std::string& path, const std::string& layer_name,
                                    const MhaConfig& config) {
  return detail::keras::load<Scalar>(path, layer_name, &config);
}

// Every MultiHeadAttention of a Keras file: from config.json when there is one, else every HDF5
// group that holds the four projections.
inline std::vector<KerasLayerInfo> keras_attention_layers(const std::string& path) {
  detail::keras::Hdf5Session session;
  const detail::keras::KerasFile file = detail::keras::open_keras_file(path);
  return detail::keras::attention_layers(file, detail::keras::config_layers(file));
}

}  // namespace sdmha::io
