// tests/fuzz/fuzz_keras.cpp — the Keras reader's own code on arbitrary bytes, with libhdf5 behind
// the isolation.
//
// The bytes are a whole Keras file (a .keras zip or a .weights.h5), written to a temporary file:
//  1. in this process, instrumented and coverage-guided, what is sdmha's own: is_keras_file; for
//     a zip the archive (ZipArchive: the directory, every member's sizes and CRC), config.json
//     (parse_config), metadata.json (keras_version_of), the layer tree walked as Keras' saving_lib
//     walks it (config_layers, to_snake_case), each MultiHeadAttention's configuration
//     (config_expectations) and the layer-name walk (locate, by name and with no name, up to its
//     first HDF5 call, which fails on the absent weights and ends it with a FormatError);
//  2. the whole loader through load_keras_layer_isolated: libhdf5 reads the weights in a forked
//     child, where a crash or hang is an IoError, not a finding (docs/bad_input.md, "Trust
//     boundary"). The child's code is not coverage-guided, and a sanitizer report there ends the
//     child like any crash: step 1 is where sdmha's parsing is fuzzed, step 2 checks that the
//     isolated reader answers every input with a layer or an sdmha::Error.
// Each step either succeeds with consistent results or throws an sdmha::Error.
#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <sdmha/io/keras_isolated.hpp>

#include "fuzz_support.hpp"

namespace {

namespace keras = sdmha::detail::keras;

// One temporary file per process (libFuzzer runs inputs one after another), removed at exit.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* directory = std::getenv("TMPDIR");
    std::string result = std::string(directory != nullptr ? directory : "/tmp") +
                         "/sdmha_fuzz_keras_" + std::to_string(::getpid()) + ".keras";
    std::atexit([] { std::remove(scratch_path().c_str()); });
    return result;
  }();
  return path;
}

void check_version(const keras::KerasVersion& version) {
  // Known, or unknown with a reason: never both, never neither.
  SDMHA_FUZZ_CHECK(version.version.empty() != version.unknown_reason.empty());
}

// The layer tree of config.json, each MultiHeadAttention's configuration, and the name walk.
void walk_config(const keras::KerasFile& file) {
  std::vector<keras::ConfigLayer> layers;
  if (!sdmha_fuzz::accepts([&] { layers = keras::config_layers(file); })) return;
  for (const auto& layer : layers) {
    // A layer's group is `layers/<snake_case class>[_n]` below its container's.
    SDMHA_FUZZ_CHECK(layer.entry != nullptr);
    SDMHA_FUZZ_CHECK(&layer == &layers.front() || layer.group.find("layers/") != std::string::npos);
    for (const char c : keras::to_snake_case(layer.class_name))
      SDMHA_FUZZ_CHECK(!std::isupper(static_cast<unsigned char>(c)));
    if (layer.class_name != "MultiHeadAttention") continue;
    sdmha_fuzz::accepts([&] {
      const keras::Expected expected = keras::config_expectations(file, layer);
      SDMHA_FUZZ_CHECK(*expected.heads > 0 && *expected.key_dim > 0 && *expected.value_dim > 0);
    });
  }
  keras::Hdf5Session session;  // the walk's HDF5 calls fail on the absent weights, quietly
  for (const std::string& name : {std::string(), std::string("attention"),
                                  layers.empty() ? std::string("x") : layers.back().name})
    sdmha_fuzz::accepts([&] { keras::locate(file, name); });
}

// What a .keras zip holds, read as open_keras_zip reads it, but without handing the weights to
// libhdf5.
void read_archive(const std::string& path, std::size_t size) {
  std::optional<sdmha::detail::ZipArchive> archive;
  if (!sdmha_fuzz::accepts([&] {
        archive.emplace(
            sdmha::detail::ZipArchive::open(keras::kWhere, path, size, "a .keras file"));
      }))
    return;
  keras::KerasFile file;
  file.config_name = path + "[config.json]";
  if (const auto metadata = archive->locate("metadata.json")) {
    sdmha_fuzz::accepts([&] {
      check_version(keras::keras_version_of(archive->read(keras::kWhere, *metadata, "m")));
    });
  }
  if (const auto weights = archive->locate("model.weights.h5"))
    sdmha_fuzz::accepts([&] { archive->read(keras::kWhere, *weights, "model.weights.h5"); });
  const auto config = archive->locate("config.json");
  if (!config) return;
  if (sdmha_fuzz::accepts([&] {
        file.config = keras::parse_config(archive->read(keras::kWhere, *config, "config.json"),
                                          file.config_name);
      }))
    walk_config(file);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = scratch_path();
  {
    std::FILE* file = std::fopen(path.c_str(), "wb");
    SDMHA_FUZZ_CHECK(file != nullptr);
    SDMHA_FUZZ_CHECK(size == 0 || std::fwrite(data, 1, size, file) == size);
    SDMHA_FUZZ_CHECK(std::fclose(file) == 0);
  }
  // metadata.json's reader on the raw bytes too: most inputs are not zips.
  check_version(keras::keras_version_of(std::vector<std::uint8_t>(data, data + size)));
  const bool keras_file = sdmha::io::is_keras_file(path);
  if (size >= 4 && data[0] == 'P' && data[1] == 'K') read_archive(path, size);
  if (!keras_file) return 0;
  sdmha::io::KerasReadOptions options;
  // libhdf5 loops forever on some files: an IoError after 1 s, where a whole load of a file of
  // the corpus's sizes takes a few milliseconds (the fuzzer's own time goes to the hangs).
  options.isolation.small_file_seconds = 1.0;
  options.isolation.memory_bytes = std::size_t(1) << 30;
  sdmha_fuzz::accepts([&] {
    const auto layer = sdmha::io::load_keras_layer_isolated<float>(path, "", options);
    SDMHA_FUZZ_CHECK(layer.weights.query_kernel.size() > 0);
    SDMHA_FUZZ_CHECK(layer.keras_version.empty() != layer.no_keras_version_reason.empty());
  });
  return 0;
}
