// sdmha/io/tensor_source.hpp — one face over a safetensors file or an .npz archive: tensor names,
// shapes, dtypes, typed reads and string metadata, whichever format holds them. An .npz carries
// metadata as uint8 arrays named "__metadata__/<key>", since numpy.savez has none of its own.
//
// Not thread-safe: an .npz member is decompressed on first use and cached.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/dtype.hpp"
#include "sdmha/io/npy.hpp"
#include "sdmha/io/safetensors.hpp"

namespace sdmha::io {

// A uniform face over a safetensors file or an .npz archive: names, shapes, typed reads, metadata.
class TensorSource {
 public:
  explicit TensorSource(SafetensorsFile file) : safetensors_(std::move(file)) {}
  explicit TensorSource(NpzFile archive, std::map<std::string, std::string> metadata = {})
      : npz_(std::move(archive)), npz_metadata_(std::move(metadata)) {}

  // Opens `path` as .npz when it ends in ".npz", as safetensors otherwise.
  static TensorSource open(const std::string& path) {
    const bool is_npz = path.size() >= 4 && path.compare(path.size() - 4, 4, ".npz") == 0;
    if (is_npz) {
      NpzFile archive = NpzFile::open(path);
      std::map<std::string, std::string> metadata;
      // numpy.savez has no metadata; a string array "__metadata__/<key>" of uint8 may carry it.
      for (const auto& name : archive.names()) {
        const std::string prefix = "__metadata__/";
        if (name.compare(0, prefix.size(), prefix) == 0) {
          const auto bytes = archive.read(name).as<std::uint8_t>();
          metadata[name.substr(prefix.size())] = std::string(bytes.begin(), bytes.end());
        }
      }
      TensorSource result(std::move(archive), std::move(metadata));
      result.npz_source_ = path;
      return result;
    }
    return TensorSource(SafetensorsFile::open(path));
  }

  const std::string& source() const { return safetensors_ ? safetensors_->source() : npz_source_; }
  bool contains(const std::string& name) const {
    return safetensors_ ? safetensors_->contains(name) : npz_->contains(name);
  }
  std::vector<std::string> names() const {
    return safetensors_ ? safetensors_->names() : npz_->names();
  }
  std::vector<std::int64_t> shape(const std::string& name) const {
    require(name);
    return safetensors_ ? safetensors_->info(name).shape : npz_member(name).shape;
  }
  DType dtype(const std::string& name) const {
    require(name);
    return safetensors_ ? safetensors_->info(name).dtype : npz_member(name).dtype;
  }
  template <typename T>
  std::vector<T> read(const std::string& name) const {
    require(name);
    return safetensors_ ? safetensors_->template read<T>(name) : npz_member(name).template as<T>();
  }
  std::optional<std::string> metadata_value(const std::string& key) const {
    if (safetensors_) return safetensors_->metadata_value(key);
    const auto found = npz_metadata_.find(key);
    if (found == npz_metadata_.end()) return std::nullopt;
    return found->second;
  }

  // Fails unless `name` exists with exactly `rank` dimensions; returns its shape.
  std::vector<std::int64_t> expect_rank(const std::string& name, std::size_t rank) const {
    auto dims = shape(name);
    if (dims.size() != rank)
      detail::fail<ShapeError>("io", source(), ": tensor '", name, "' has rank ", dims.size(),
                               "; expected rank ", rank);
    return dims;
  }

  void require(const std::string& name) const {
    if (!contains(name))
      detail::fail<FormatError>("io", source(), ": tensor '", name, "' is missing");
  }

 private:
  // An .npz member is decompressed once, on first use, and kept (not thread-safe, like the rest).
  const NpyArray& npz_member(const std::string& name) const {
    auto found = npz_cache_.find(name);
    if (found == npz_cache_.end()) found = npz_cache_.emplace(name, npz_->read(name)).first;
    return found->second;
  }

  std::optional<SafetensorsFile> safetensors_;
  mutable std::map<std::string, NpyArray> npz_cache_;
  std::optional<NpzFile> npz_;
  std::map<std::string, std::string> npz_metadata_;
  std::string npz_source_ = "<npz>";
};

}  // namespace sdmha::io
