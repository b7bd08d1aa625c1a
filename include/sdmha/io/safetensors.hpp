// sdmha/io/safetensors.hpp — reads and writes safetensors files: named, typed, shaped tensors.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON (tensor name → {"dtype",
// "shape", "data_offsets": [begin, end)}, plus an optional "__metadata__" of string → string),
// then the data buffer that the offsets index. Files are untrusted input: the header is checked
// in full when the file is opened (detail/safetensors_header.hpp), so that every later read stays
// inside the bytes the file holds.
//
// DType and the element conversions, which the .npy reader shares, are in io/dtype.hpp and
// io/detail/elements.hpp; the atomic file write is in io/detail/file.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/bytes.hpp"
#include "sdmha/io/detail/elements.hpp"
#include "sdmha/io/detail/file.hpp"
#include "sdmha/io/detail/safetensors_header.hpp"
#include "sdmha/io/detail/shape_format.hpp"
#include "sdmha/io/dtype.hpp"

namespace sdmha {
namespace io {

// A safetensors file held in memory, its header validated on open.
//
// Every tensor's byte range lies inside the data buffer, matches its shape and dtype exactly and
// overlaps no other tensor and the tensors cover the data buffer without holes. Reads copy into a
// std::vector and work at any alignment; data_if_aligned gives a zero-copy view when the bytes
// allow one.
class SafetensorsFile {
 public:
  // The limit the reference implementation puts on the header; a larger one is not a model file.
  static constexpr std::uint64_t max_header_bytes = 100'000'000;

  // Reads the whole file into memory; IoError if it cannot, FormatError if it is malformed.
  static SafetensorsFile open(const std::string& path) {
    return parse("SafetensorsFile::open", detail::read_file_bytes("SafetensorsFile::open", path),
                 path);
  }

  // Parses bytes already in memory; `source_name` stands for the file in error messages.
  static SafetensorsFile from_bytes(std::vector<std::uint8_t> bytes,
                                    std::string source_name = "<buffer>") {
    return parse("SafetensorsFile::from_bytes", std::move(bytes), std::move(source_name));
  }

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    return find("SafetensorsFile::info", name);
  }

  // Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> result;
    result.reserve(tensors_.size());
    for (const auto& entry : tensors_) result.push_back(entry.first);
    return result;
  }

  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  std::optional<std::string> metadata_value(const std::string& key) const {
    const auto it = metadata_.find(key);
    if (it == metadata_.end()) return std::nullopt;
    return it->second;
  }

  // The path, or the source name given to from_bytes.
  const std::string& source() const { return source_; }

  // Copies a tensor out as T: float and double from F16, BF16, F32, F64 (halves widen exactly,
  // F64 → float rounds to nearest); int64 from I32, I64, U8, BOOL; int32 from I32; uint8 and bool
  // from U8 and BOOL (whose bytes must be 0 or 1 for bool). FormatError otherwise.
  template <typename T>
  std::vector<T> read(const std::string& name) const {
    const TensorInfo& tensor = find("SafetensorsFile::read", name);
    return detail::decode_elements<T>("SafetensorsFile::read", source_, "tensor '" + name + "'",
                                      tensor.dtype, tensor_bytes(tensor),
                                      static_cast<std::size_t>(tensor.element_count()));
  }

  // ShapeError unless the tensor has exactly this shape.
  void expect_shape(const std::string& name, const std::vector<std::int64_t>& shape) const {
    const TensorInfo& tensor = find("SafetensorsFile::expect_shape", name);
    if (tensor.shape != shape) {
      detail::fail<ShapeError>("SafetensorsFile::expect_shape", source_, ": tensor '", name,
                               "' has shape ", detail::format_shape(tensor.shape), "; expected ",
                               detail::format_shape(shape));
    }
  }

  // ShapeError unless the tensor has this many dimensions.
  void expect_rank(const std::string& name, std::size_t rank) const {
    const TensorInfo& tensor = find("SafetensorsFile::expect_rank", name);
    if (tensor.shape.size() != rank) {
      detail::fail<ShapeError>("SafetensorsFile::expect_rank", source_, ": tensor '", name,
                               "' has rank ", tensor.shape.size(), " (shape ",
                               detail::format_shape(tensor.shape), "); expected rank ", rank);
    }
  }

  // A view of the tensor's bytes as T when its dtype is exactly T's and the address is aligned for
  // T, else nullptr (fall back to read). Valid while this object lives. Not offered for bool: a
  // BOOL byte other than 0 or 1 read through a bool is undefined; read<bool> checks every byte.
  template <typename T>
  const T* data_if_aligned(const std::string& name) const {
    static_assert(detail::IsIoElement<T>::value && !std::is_same_v<T, bool>,
                  "data_if_aligned serves float, double, int64_t, int32_t and uint8_t; "
                  "read<bool> validates BOOL bytes instead");
    const TensorInfo& tensor = find("SafetensorsFile::data_if_aligned", name);
    if (tensor.dtype != detail::IoElement<T>::dtype) return nullptr;
    const std::uint8_t* bytes = tensor_bytes(tensor);
    if (reinterpret_cast<std::uintptr_t>(bytes) % alignof(T) != 0) return nullptr;
    return reinterpret_cast<const T*>(bytes);
  }

 private:
  SafetensorsFile() = default;

  static SafetensorsFile parse(const char* where, std::vector<std::uint8_t> bytes,
                               std::string source) {
    SafetensorsFile file;
    file.bytes_ = std::move(bytes);
    file.source_ = std::move(source);
    detail::SafetensorsHeader header =
        detail::SafetensorsHeaderParser(file.bytes_, file.source_, max_header_bytes).parse(where);
    file.data_start_ = header.data_start;
    file.tensors_ = std::move(header.tensors);
    file.metadata_ = std::move(header.metadata);
    return file;
  }

  const TensorInfo& find(const char* where, const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      std::string available;
      std::size_t listed = 0;
      for (const auto& entry : tensors_) {
        if (listed == 12) {
          available += ", ...";
          break;
        }
        available += (listed++ == 0 ? "'" : ", '") + entry.first + "'";
      }
      detail::fail<FormatError>(
          where, source_, ": no tensor named '", name, "'; expected one of ", tensors_.size(),
          " tensors: ", available.empty() ? std::string("(none)") : available);
    }
    return it->second;
  }

  const std::uint8_t* tensor_bytes(const TensorInfo& tensor) const {
    return bytes_.data() + data_start_ + tensor.begin;
  }

  std::vector<std::uint8_t> bytes_;
  std::string source_;
  std::size_t data_start_ = 0;  // offset of the data buffer in bytes_
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then serializes them as one safetensors file.
//
// Tensors are laid out largest element first (then by name), as the reference implementation
// does: with the header padded to a multiple of 8 bytes, every tensor then starts at an offset
// that is a multiple of its element size, so readers can map it without copying.
class SafetensorsWriter {
 public:
  // Adds a tensor from raw little-endian bytes; ShapeError unless bytes equals the shape's
  // element count times dtype_size(dtype), FormatError for a duplicate or reserved name.
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape, const void* data,
           std::size_t bytes) {
    constexpr const char* where = "SafetensorsWriter::add";
    const std::string subject = "tensor '" + name + "'";
    if (name == "__metadata__") {
      detail::fail<FormatError>(where, subject,
                                ": the name is reserved for the metadata; expected another name");
    }
    for (const Entry& entry : entries_) {
      if (entry.tensor.name == name) {
        detail::fail<FormatError>(where, subject,
                                  ": already added; expected each tensor name once");
      }
    }
    const std::size_t expected = detail::checked_byte_count(where, subject, shape, dtype);
    if (bytes != expected) {
      detail::fail<ShapeError>(where, subject, ": got ", bytes, " bytes for shape ",
                               detail::format_shape(shape), " of ", dtype_name(dtype),
                               "; expected ", expected);
    }
    if (data == nullptr && bytes > 0) {
      detail::fail<ShapeError>(where, subject, ": data is null; expected ", bytes, " bytes");
    }
    Entry entry;
    entry.tensor.name = name;
    entry.tensor.dtype = dtype;
    entry.tensor.shape = std::move(shape);
    const auto* first = static_cast<const std::uint8_t*>(data);
    entry.data.assign(first, first + bytes);
    entries_.push_back(std::move(entry));
  }

  // Adds a tensor of T (float → F32, double → F64, int64 → I64, int32 → I32, uint8 → U8,
  // bool → BOOL) holding product(shape) elements read from `data`.
  template <typename T>
  void add(const std::string& name, const std::vector<std::int64_t>& shape, const T* data) {
    static_assert(detail::IsIoElement<T>::value,
                  "SafetensorsWriter::add takes float, double, int64_t, int32_t, uint8_t or bool");
    static_assert(sizeof(T) == dtype_size(detail::IoElement<T>::dtype),
                  "the element type's size must match its dtype's");
    const std::size_t bytes = detail::checked_byte_count(
        "SafetensorsWriter::add", "tensor '" + name + "'", shape, detail::IoElement<T>::dtype);
    add(name, detail::IoElement<T>::dtype, shape, data, bytes);
  }

  // Sets one "__metadata__" entry, replacing an earlier value of the same key.
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  std::vector<std::uint8_t> to_bytes() const {
    std::vector<const Entry*> order;
    for (const Entry& entry : entries_) order.push_back(&entry);
    std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
      const std::size_t size_a = dtype_size(a->tensor.dtype);
      const std::size_t size_b = dtype_size(b->tensor.dtype);
      if (size_a != size_b) return size_a > size_b;
      return a->tensor.name < b->tensor.name;
    });

    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
      for (const auto& [key, value] : metadata_) metadata[key] = value;
      header["__metadata__"] = std::move(metadata);
    }
    std::size_t offset = 0;
    for (const Entry* entry : order) {
      const std::size_t end = offset + entry->data.size();
      header[entry->tensor.name] = {{"dtype", dtype_name(entry->tensor.dtype)},
                                    {"shape", entry->tensor.shape},
                                    {"data_offsets", {offset, end}}};
      offset = end;
    }
    std::string text;
    try {
      text = header.dump();
    } catch (const nlohmann::json::exception& error) {
      // dump rejects names and metadata that are not valid UTF-8.
      detail::fail<FormatError>("SafetensorsWriter::to_bytes", "cannot encode the header (",
                                error.what(), "); expected UTF-8 names and metadata");
    }
    text.append((8 - text.size() % 8) % 8, ' ');

    std::vector<std::uint8_t> bytes;
    bytes.reserve(8 + text.size() + offset);
    detail::append_little_endian(bytes, text.size(), 8);
    bytes.insert(bytes.end(), text.begin(), text.end());
    for (const Entry* entry : order) {
      bytes.insert(bytes.end(), entry->data.begin(), entry->data.end());
    }
    return bytes;
  }

  // Writes the file through a temporary and a rename: `path` is either untouched or complete.
  void write(const std::string& path) const {
    const std::vector<std::uint8_t> bytes = to_bytes();
    detail::write_file_atomically("SafetensorsWriter::write", path, {{bytes.data(), bytes.size()}});
  }

 private:
  struct Entry {
    TensorInfo tensor;  // begin and end are assigned when the file is laid out
    std::vector<std::uint8_t> data;
  };

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace io
}  // namespace sdmha
