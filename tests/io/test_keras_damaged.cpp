// Tests of sdmha/io/keras_isolated.hpp on damaged Keras files that crash or hang libhdf5 in
// process: the regression inputs of tests/data/keras/damaged/all_ones_words.txt, each a test file
// with one 8-byte word set to all ones (in a .keras file, a word of its model.weights.h5, the
// archive written again with a correct CRC). Through the isolated reader each must end in a
// layer or a typed sdmha::Error, never a signal in this process or a hang past the time limit.
#include <gtest/gtest.h>
#include <zip.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io_test.hpp"

#ifdef SDMHA_HAS_KERAS_IO
#include <sdmha/io/keras_isolated.hpp>

namespace sdmha_test {
namespace {

// One line of all_ones_words.txt: the test file, the word's byte offset (in the file, or in a
// .keras file's model.weights.h5), the layer to load, and what libhdf5 did in process.
struct DamagedFile {
  std::string fixture;
  std::size_t offset = 0;
  std::string layer;
  std::string in_process;
};

std::vector<DamagedFile> damaged_files() {
  std::ifstream list(test_data("keras/damaged/all_ones_words.txt"));
  std::vector<DamagedFile> files;
  for (std::string line; std::getline(list, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    DamagedFile file;
    fields >> file.fixture >> file.offset >> file.layer >> file.in_process;
    if (file.layer == "-") file.layer.clear();
    files.push_back(file);
  }
  return files;
}

bool is_keras_zip(const std::string& name) {
  return name.size() > 6 && name.compare(name.size() - 6, 6, ".keras") == 0;
}

std::vector<std::uint8_t> zip_member(const std::string& archive_path, const char* name) {
  zip_t* archive = zip_open(archive_path.c_str(), ZIP_RDONLY, nullptr);
  EXPECT_NE(archive, nullptr);
  zip_stat_t stat;
  EXPECT_EQ(zip_stat(archive, name, 0, &stat), 0);
  std::vector<std::uint8_t> bytes(stat.size);
  zip_file_t* member = zip_fopen(archive, name, 0);
  EXPECT_EQ(zip_fread(member, bytes.data(), bytes.size()), zip_int64_t(bytes.size()));
  zip_fclose(member);
  zip_discard(archive);
  return bytes;
}

// `fixture` (a .keras file) with its model.weights.h5 replaced by `weights`, stored, as Keras
// stores it.
void write_keras_with_weights(const std::string& fixture, const std::vector<std::uint8_t>& weights,
                              const std::string& path) {
  zip_t* source = zip_open(fixture.c_str(), ZIP_RDONLY, nullptr);
  zip_t* target = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, nullptr);
  ASSERT_TRUE(source != nullptr && target != nullptr);
  for (const char* name : {"metadata.json", "config.json"})
    zip_file_add(target, name,
                 zip_source_zip(target, source, zip_name_locate(source, name, 0), 0, 0, -1), 0);
  // zip_source_buffer with freep = 1 releases the copy with free().
  void* copy = std::malloc(weights.size());
  std::memcpy(copy, weights.data(), weights.size());
  const zip_int64_t index = zip_file_add(target, "model.weights.h5",
                                         zip_source_buffer(target, copy, weights.size(), 1), 0);
  zip_set_file_compression(target, zip_uint64_t(index), ZIP_CM_STORE, 0);
  ASSERT_EQ(zip_close(target), 0);
  zip_discard(source);
}

// The damaged file, written under `scratch`.
std::string make_damaged(const DamagedFile& damaged, const ScratchDirectory& scratch) {
  const std::string fixture = test_data("keras/" + damaged.fixture);
  const bool keras = is_keras_zip(damaged.fixture);
  std::vector<std::uint8_t> bytes =
      keras ? zip_member(fixture, "model.weights.h5") : read_bytes(fixture);
  EXPECT_LE(damaged.offset + 8, bytes.size()) << damaged.fixture;
  if (damaged.offset + 8 > bytes.size()) return std::string();
  for (std::size_t i = 0; i < 8; ++i) bytes[damaged.offset + i] = 0xff;
  const std::string path = scratch.file(std::to_string(damaged.offset) + "_" + damaged.fixture);
  if (keras)
    write_keras_with_weights(fixture, bytes, path);
  else
    write_bytes(path, bytes);
  return path;
}

TEST(KerasRegression, TheListHoldsCrashesAndHangsOfBothKinds) {
  const auto files = damaged_files();
  ASSERT_GE(files.size(), 10u);
  ASSERT_LE(files.size(), 24u);
  int keras = 0, hangs = 0, signals = 0;
  for (const auto& file : files) {
    keras += is_keras_zip(file.fixture);
    hangs += file.in_process == "hang";
    signals += file.in_process == "SIGSEGV" || file.in_process == "SIGABRT";
  }
  EXPECT_GT(keras, 0);
  EXPECT_GT(hangs, 0);
  EXPECT_EQ(hangs + signals, int(files.size())) << "outcomes are SIGSEGV, SIGABRT or hang";
}

TEST(KerasRegression, EveryDamagedFileEndsInALayerOrATypedErrorWithinTheLimit) {
  const ScratchDirectory scratch;
  sdmha::io::KerasReadOptions options;  // `seconds` the default 60: a small file gets 3 s
  options.isolation.small_file_seconds = 3.0;
  options.isolation.memory_bytes = std::size_t(1) << 30;
  for (const auto& damaged : damaged_files()) {
    const std::string path = make_damaged(damaged, scratch);
    if (path.empty()) continue;
    SCOPED_TRACE(damaged.fixture + " word at " + std::to_string(damaged.offset) + " (" +
                 damaged.in_process + " in process)");
    const auto start = std::chrono::steady_clock::now();
    try {
      const auto layer = sdmha::io::load_keras_layer_isolated<double>(path, damaged.layer, options);
      EXPECT_GT(layer.weights.query_kernel.size(), 0);
    } catch (const sdmha::IoError& error) {
      EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
    } catch (const sdmha::Error&) {
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, options.isolation.small_file_seconds + 2.0);
  }
}

}  // namespace
}  // namespace sdmha_test
#endif  // SDMHA_HAS_KERAS_IO
