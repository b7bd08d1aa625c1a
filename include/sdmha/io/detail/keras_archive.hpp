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
  std::string no_keras_version_reason;  // why keras_version is empty; empty when it is known
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

// metadata.json's keras_version, or why there is none. metadata.json describes the file (Keras
// writes {"keras_version": ..., "date_saved": ...}) and holds nothing the layer needs, so a
// missing or unusable one leaves the version unknown, with the reason in
// no_keras_version_reason, rather than refusing weights that are otherwise whole;
// KerasReadOptions::require_keras_version makes it a FormatError. Keras writes a flat object:
// bytes that nest deeper than kMetadataNesting never reach the recursive parse (detail/json.hpp).
struct KerasVersion {
  std::string version;
  std::string unknown_reason;
};

inline KerasVersion keras_version_of(const std::vector<std::uint8_t>& bytes) {
  constexpr int kMetadataNesting = 8;
  KerasVersion result;
  if (const auto offset = excess_json_nesting(bytes.data(), bytes.size(), kMetadataNesting)) {
    result.unknown_reason = "metadata.json nests JSON more than " +
                            std::to_string(kMetadataNesting) + " levels deep at byte " +
                            std::to_string(*offset) + "; expected Keras' flat object";
    return result;
  }
  const json metadata = json::parse(bytes.begin(), bytes.end(), nullptr, false);
  const json* version = metadata.is_object() && metadata.contains("keras_version")
                            ? &metadata["keras_version"]
                            : nullptr;
  if (metadata.is_discarded())
    result.unknown_reason = "metadata.json is not valid JSON";
  else if (!metadata.is_object())
    result.unknown_reason =
        std::string("metadata.json is a JSON ") + metadata.type_name() + "; expected an object";
  else if (!version)
    result.unknown_reason = "metadata.json has no 'keras_version'";
  else if (!version->is_string() || version->get<std::string>().empty())
    result.unknown_reason = "metadata.json's keras_version is " +
                            (version->is_string() ? std::string("empty")
                                                  : std::string("a JSON ") + version->type_name()) +
                            "; expected a version string";
  else
    result.version = version->get<std::string>();
  return result;
}

inline void set_keras_version(KerasFile& file, const KerasVersion& version) {
  file.keras_version = version.version;
  file.no_keras_version_reason = version.unknown_reason;
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
    set_keras_version(file, keras_version_of(archive.read(kWhere, *metadata, "metadata.json")));
  else
    file.no_keras_version_reason = "the archive has no member 'metadata.json'";
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
    set_keras_version(file, keras_version_of(read_file_bytes(kWhere, metadata)));
  else
    file.no_keras_version_reason = "the directory has no file 'metadata.json'";
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
  file.no_keras_version_reason = "a .weights.h5 file holds no metadata.json";
  file.h5 = open_hdf5_file(path, size);
  return file;
}

}  // namespace sdmha::detail::keras
