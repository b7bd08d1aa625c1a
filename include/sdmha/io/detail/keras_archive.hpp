// sdmha/io/detail/keras_archive.hpp — a Keras file opened for reading, whichever of the three
// kinds it is: the .keras zip of model.save (config.json, metadata.json and model.weights.h5,
// which is opened from memory), the directory of saving_lib.save_model(..., zipped=False), or a
// bare .weights.h5. Which kind is decided by the path (a directory) and the first four bytes (a
// zip signature); anything else is opened as HDF5.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "sdmha/errors.hpp"
#include "sdmha/io/detail/file.hpp"
#include "sdmha/io/detail/hdf5.hpp"
#include "sdmha/io/detail/json.hpp"
#include "sdmha/io/detail/zip.hpp"

namespace sdmha::detail::keras {

using json = nlohmann::json;

// Keras configs nest a few levels per model; far deeper nesting is refused before the parse.
constexpr int kMaxJsonNesting = 512;

// What a Keras file holds: the weights, and for a .keras file its config.json tree.
struct KerasFile {
  H5Source h5;
  std::optional<json> config;
  std::string config_name;  // "<path>[config.json]" in messages
  std::string keras_version;
};

// config.json, which must be a JSON object.
inline json parse_config(const std::vector<std::uint8_t>& bytes, const std::string& name) {
  json value = parse_json(
      bytes.data(), bytes.size(), kMaxJsonNesting,
      [&](std::size_t offset) {
        fail<FormatError>(kWhere, "'", name, "' nests JSON more than ", kMaxJsonNesting,
                          " levels deep at byte ", offset, "; expected a Keras config");
      },
      [&](const json::exception& error) {
        fail<FormatError>(kWhere, "'", name, "' is not valid JSON (", error.what(), ")");
      });
  if (!value.is_object())
    fail<FormatError>(kWhere, "'", name, "' is a JSON ", value.type_name(), "; expected an object");
  return value;
}

// The keras_version of metadata.json, or empty: the version is only reported, never checked.
// Bytes that nest deeper than metadata ever does (Keras writes a flat object) count as no
// version rather than reaching the recursive parse (detail/json.hpp).
inline std::string keras_version_of(const std::vector<std::uint8_t>& bytes) {
  constexpr int kMetadataNesting = 8;
  if (excess_json_nesting(bytes.data(), bytes.size(), kMetadataNesting)) return std::string();
  const json metadata = json::parse(bytes.begin(), bytes.end(), nullptr, false);
  if (metadata.is_object() && metadata.contains("keras_version") &&
      metadata["keras_version"].is_string())
    return metadata["keras_version"].get<std::string>();
  return std::string();
}

inline KerasFile open_keras_zip(const std::string& path, std::uint64_t size) {
  const ZipArchive archive = ZipArchive::open(kWhere, path, size, "a .keras file");
  const auto weights = archive.locate("model.weights.h5"), config = archive.locate("config.json");
  if (!weights)
    fail<FormatError>(kWhere, "'", path, "' has no member 'model.weights.h5'",
                      archive.locate("model.weights.npz")
                          ? " (its weights are in model.weights.npz,"
                            " which is not supported)"
                          : "",
                      "; expected a .keras file with HDF5 weights");
  if (!config)
    fail<FormatError>(kWhere, "'", path, "' has no member 'config.json'; expected a .keras file");
  KerasFile file;
  file.config_name = path + "[config.json]";
  file.config = parse_config(archive.read(kWhere, *config, "config.json"), file.config_name);
  if (const auto metadata = archive.locate("metadata.json"))
    file.keras_version = keras_version_of(archive.read(kWhere, *metadata, "metadata.json"));
  file.h5 = open_hdf5_image(archive.read(kWhere, *weights, "model.weights.h5"),
                            path + "[model.weights.h5]");
  return file;
}

// The directory that saving_lib.save_model(..., zipped=False) writes.
inline KerasFile open_keras_directory(const std::string& path) {
  const std::string weights = path + "/model.weights.h5", config = path + "/config.json";
  KerasFile file;
  file.config_name = config;
  readable_file_size(kWhere, config);
  file.config = parse_config(read_file_bytes(kWhere, config), config);
  const std::string metadata = path + "/metadata.json";
  std::error_code error;
  if (std::filesystem::is_regular_file(metadata, error))
    file.keras_version = keras_version_of(read_file_bytes(kWhere, metadata));
  file.h5 = open_hdf5_file(weights, readable_file_size(kWhere, weights));
  return file;
}

inline KerasFile open_keras_file(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) return open_keras_directory(path);
  const std::uint64_t size = readable_file_size(kWhere, path);
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

}  // namespace sdmha::detail::keras
