// sdmha/io/detail/hdf5.hpp — the HDF5 side of the Keras reader, over HDF5's C library: RAII
// identifiers (every error path closes what it opened), a session that serializes HDF5 calls and
// silences its error printing, files opened from disk or from bytes in memory, groups walked by
// hard links only, string attributes, and datasets checked before they are read.
//
// Every size a dataset declares is checked against what the file can store before anything is
// allocated: dimensions at most kMaxLayerDimension, contiguous data stored exactly, chunked data
// inflating at most kMaxDeflateRatio times. Errors are FormatError naming the file and HDF5 path.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/shape_format.hpp"

namespace sdmha::detail::keras {

constexpr const char* kWhere = "load_keras_layer";
constexpr std::size_t kMaxLinksPerGroup = 1000000;
constexpr std::size_t kMaxNameLength = 4096;

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

// A dataset opened and checked: its shape, within kMaxLayerDimension per axis, stored in the file.
struct Dataset {
  H5Id id;
  std::string path;
  std::vector<std::int64_t> shape;
};

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
    if (dimension > hsize_t(kMaxLayerDimension))
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
      (chunked && declared > stored * kMaxDeflateRatio + (std::uint64_t(1) << 16)))
    fail<FormatError>(kWhere, subject, " declares ", declared, " bytes, shape ",
                      format_shape(dataset.shape, ShapeNotation::tuple), ", but stores ", stored,
                      "; expected ",
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

}  // namespace sdmha::detail::keras
