// Tests for sdmha/io/keras_file.hpp: MultiHeadAttention layers read from Keras 3 files
// (.weights.h5, .keras) laid out as Keras' saving code lays them out, run end to end through
// SparseDenseMHA against float64 outputs computed with Keras' math; layers found by name, by group
// path and inside nested models; and every malformed input answered by a typed error, never a
// crash. The fixtures in tests/data/keras/ come from tools/testdata/make_keras_test_files.py; the
// corrupt variants are made here.
#include "test_support.hpp"

#include <hdf5.h>
#include <zip.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <typeinfo>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include <sdmha/io/detail/child_process.hpp>
#include <sdmha/io/keras_file.hpp>

#ifndef SDMHA_TEST_DATA_DIR
#error "SDMHA_TEST_DATA_DIR must be defined as the absolute path of tests/data"
#endif

// HDF5 1.10.8 loses memory on some corrupt object headers, in its own error paths: when a header's
// declared length runs past the file's end of allocation ("actual len exceeds EOA"), the H5O_t that
// H5O_protect took from HDF5's free lists (H5FL_reg_calloc under H5C_protect) is never given back
// (HDFGroup/hdf5 issue 3790, fixed upstream by pull request 4445), and HDF5's shutdown at exit then
// prints "HDF5: infinite loop closing library". CorruptBytesNeverCrash makes such files, so it
// loads each in a forked child (detail/child_process.hpp), which checks there that every
// identifier sdmha opened is closed and reports back; this process never gives libhdf5 a corrupt
// object header, needs no LeakSanitizer suppression, and exits silently.

namespace sdmha_test {
namespace {

namespace fs = std::filesystem;
using sdmha::FormatError;
using sdmha::IoError;
using sdmha::MhaConfig;
using sdmha::io::keras_attention_layers;
using sdmha::io::load_keras_layer;

std::string fixture(const std::string& name) {
  return std::string(SDMHA_TEST_DATA_DIR) + "/keras/" + name;
}

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(stream),
                                   std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream stream(path, std::ios::binary);
  stream.write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
}

// A scratch directory of this test, emptied first.
std::string scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("sdmha_test_io_keras_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// HDF5 identifiers of the kinds that outlive their file: open files (with what is open in them),
// and the dataspaces, datatypes and property lists sdmha opens (groups, datasets and attributes
// close with their file, which sdmha opens with H5F_CLOSE_STRONG). HDF5 numbers each kind's
// identifiers consecutively, so a fresh identifier of a kind taken at construction and another
// taken later bound every one made in between.
class OpenHdf5Ids {
 public:
  OpenHdf5Ids() : first_(probes()), files_(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL)) {}
  // What was opened since construction and is still open, "" when nothing.
  std::string left_open() const {
    const std::vector<hid_t> last = probes();
    std::size_t open = 0;
    for (std::size_t kind = 0; kind < last.size(); ++kind)
      for (hid_t id = first_[kind] + 1; id < last[kind]; ++id) open += H5Iis_valid(id) > 0;
    const ssize_t files = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
    std::string text;
    if (open != 0) text += std::to_string(open) + " dataspaces, datatypes or property lists; ";
    if (files != files_)
      text += std::to_string(files - files_) + " files or objects in them (H5Fget_obj_count)";
    return text;
  }

 private:
  // A fresh identifier of each kind, closed at once (-1 where HDF5 refused one, which then
  // bounds nothing and leaves nothing to find).
  static std::vector<hid_t> probes() {
    const hid_t space = H5Screate(H5S_SCALAR), type = H5Tcopy(H5T_NATIVE_INT);
    const hid_t list = H5Pcreate(H5P_FILE_ACCESS);
    H5Sclose(space);
    H5Tclose(type);
    H5Pclose(list);
    return {space, type, list};
  }
  std::vector<hid_t> first_;
  ssize_t files_;
};

// Fails the test when `body` leaves an HDF5 identifier open, whether it returns or throws.
template <typename Body>
void expect_no_open_hdf5_ids(Body&& body) {
  struct Check {
    OpenHdf5Ids ids;
    ~Check() { EXPECT_EQ(ids.left_open(), "") << "HDF5 identifiers left open"; }
  } check;
  body();
}

// Runs `body`, which must throw ErrorType with a message that contains every needle, and leave
// no HDF5 identifier open.
template <typename ErrorType, typename Body>
void expect_error(Body&& body, std::initializer_list<std::string> needles) {
  try {
    expect_no_open_hdf5_ids(body);
  } catch (const ErrorType& error) {
    const std::string message = error.what();
    for (const std::string& needle : needles)
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message: " << message << "\nlacks:   " << needle;
    return;
  }
  ADD_FAILURE() << "no exception thrown; expected one mentioning " << *needles.begin();
}

MhaConfig config_of(Index heads, Index key_dim, Index value_dim, Index output_dim, bool bias) {
  MhaConfig config;
  config.num_heads = heads;
  config.key_dim = key_dim;
  config.value_dim = value_dim;
  config.output_dim = output_dim;
  config.use_bias = bias;
  return config;
}

// The layer's forward on the fixture's inputs (the dense query given as the COO of all its
// entries) against the float64 output that tools/testdata/make_keras_test_files.py computed.
template <typename Scalar>
void expect_forward(const sdmha::io::KerasLayer<Scalar>& keras, const std::string& expected_npz,
                    double tolerance) {
  SCOPED_TRACE(expected_npz);
  const auto archive = sdmha::io::NpzFile::open(fixture(expected_npz));
  const auto query = archive.read("query"), key = archive.read("key");
  const auto value = archive.read("value"), output = archive.read("output");
  const auto q = query.as<double>();
  const Index batch = query.shape[0], steps = query.shape[1], features = query.shape[2];
  CooIndices indices(batch * steps * features, 3);
  sdmha::Vector<Scalar> values(indices.rows());
  for (Index i = 0; i < indices.rows(); ++i) {
    indices.row(i) << i / (steps * features), (i / features) % steps, i % features;
    values[i] = Scalar(q[std::size_t(i)]);
  }
  const auto sparse = sdmha::SparseQuery<Scalar>::from_coo(batch, steps, features, indices, values);
  auto tensor = [](const sdmha::io::NpyArray& array) {
    Tensor3<Scalar> result(array.shape[0], array.shape[1], array.shape[2]);
    const auto data = array.as<double>();
    for (Index i = 0; i < result.size(); ++i) result.data()[i] = Scalar(data[std::size_t(i)]);
    return result;
  };
  const sdmha::SparseDenseMHA<Scalar> layer(keras.config, keras.weights);
  const auto result = layer.forward(sparse, {tensor(key), tensor(value)}, {});
  const auto expected = output.as<double>();
  ASSERT_EQ(std::size_t(result.output.size()), expected.size());
  EXPECT_TRUE(all_near(result.output.data(), expected, tolerance));
}

template <typename Scalar>
double tolerance() {
  return std::is_same<Scalar, double>::value ? 1e-12 : 1e-5;
}

// ---- Loading and running ------------------------------------------------------------------------

template <typename Scalar>
class KerasFileTyped : public ::testing::Test {};
TYPED_TEST_SUITE(KerasFileTyped, ScalarTypes, );

TYPED_TEST(KerasFileTyped, WeightsH5FindsTheLayerByItsNameAttribute) {
  const auto keras =
      load_keras_layer<TypeParam>(fixture("functional_bias.weights.h5"), "attention");
  EXPECT_EQ(keras.name, "attention");
  EXPECT_EQ(keras.group, "layers/multi_head_attention");
  EXPECT_EQ(keras.keras_version, "");
  EXPECT_EQ(keras.config.num_heads, 2);
  EXPECT_EQ(keras.config.key_dim, 3);
  EXPECT_EQ(keras.config.value_dim, 4);
  EXPECT_EQ(keras.config.output_dim, 7);
  EXPECT_TRUE(keras.config.use_bias);
  EXPECT_EQ(keras.dims.query_dim, 5);
  EXPECT_EQ(keras.dims.key_in_dim, 4);
  EXPECT_EQ(keras.dims.value_in_dim, 6);
  expect_forward(keras, "functional_bias.expected.npz", tolerance<TypeParam>());
}

TYPED_TEST(KerasFileTyped, KerasArchiveReadsConfigJson) {
  const auto keras = load_keras_layer<TypeParam>(fixture("functional_bias.keras"), "attention");
  EXPECT_EQ(keras.group, "layers/multi_head_attention");
  EXPECT_EQ(keras.keras_version, "3.8.0");
  EXPECT_EQ(keras.config.value_dim, 4);
  EXPECT_EQ(keras.config.output_dim, 7);
  expect_forward(keras, "functional_bias.expected.npz", tolerance<TypeParam>());
}

TYPED_TEST(KerasFileTyped, NestedModelLayerByName) {
  const auto keras = load_keras_layer<TypeParam>(fixture("nested.keras"), "attention");
  EXPECT_EQ(keras.group, "layers/functional/layers/multi_head_attention_1");
  EXPECT_FALSE(keras.config.use_bias);
  EXPECT_EQ(keras.weights.query_bias.size(), 0);
  EXPECT_EQ(keras.config.output_dim, 7);
  expect_forward(keras, "nested_attention.expected.npz", tolerance<TypeParam>());

  const auto outer = load_keras_layer<TypeParam>(fixture("nested.keras"), "outer_attention");
  EXPECT_EQ(outer.group, "layers/multi_head_attention");
  EXPECT_EQ(outer.config.value_dim, 3);
  EXPECT_EQ(outer.config.output_dim, 5);  // output_shape null: the query's width
  expect_forward(outer, "nested_outer_attention.expected.npz", tolerance<TypeParam>());
}

TYPED_TEST(KerasFileTyped, LegacyPrivateGroupsByPathWithConfig) {
  const auto keras =
      load_keras_layer<TypeParam>(fixture("legacy_private.weights.h5"),
                                  "layers/multi_head_attention", config_of(2, 3, 0, 0, true));
  EXPECT_EQ(keras.name, "");
  EXPECT_EQ(keras.config.output_dim, 5);
  expect_forward(keras, "legacy_private.expected.npz", tolerance<TypeParam>());
}

TEST(KerasFile, ConfigGivenForWeightsH5MatchesTheShapes) {
  const auto keras = load_keras_layer<double>(fixture("functional_bias.weights.h5"), "attention",
                                              config_of(2, 3, 4, 7, true));
  expect_forward(keras, "functional_bias.expected.npz", 1e-12);
}

TEST(KerasFile, ConfigGivenForKerasFileMustAgreeWithConfigJson) {
  const auto keras = load_keras_layer<double>(fixture("functional_bias.keras"), "attention",
                                              config_of(2, 3, 4, 7, true));
  EXPECT_EQ(keras.config.output_dim, 7);
  expect_error<FormatError>(
      [] {
        load_keras_layer<double>(fixture("functional_bias.keras"), "attention",
                                 config_of(2, 4, 4, 7, true));
      },
      {"config.json gives key_dim = 3", "MhaConfig given says 4"});
  expect_error<FormatError>(
      [] {
        load_keras_layer<double>(fixture("nested.keras"), "outer_attention",
                                 config_of(2, 3, 0, 6, true));
      },
      {"layers/multi_head_attention/output_dense/vars/0", "(2, 3, 6)"});
}

TEST(KerasFile, OnlyLayerTakenWhenNoNameIsGiven) {
  const auto keras = load_keras_layer<double>(fixture("legacy_private.weights.h5"), "");
  EXPECT_EQ(keras.group, "layers/multi_head_attention");
  EXPECT_EQ(keras.config.num_heads, 2);  // from the shapes alone
  expect_forward(keras, "legacy_private.expected.npz", 1e-12);
  expect_error<FormatError>([] { load_keras_layer<double>(fixture("nested.keras"), ""); },
                            {"no layer name given", "3 MultiHeadAttention layers"});
}

TEST(KerasFile, GroupPathWorksInKerasFilesToo) {
  const auto keras = load_keras_layer<double>(fixture("nested.keras"),
                                              "/layers/functional/layers/multi_head_attention_1/");
  EXPECT_EQ(keras.name, "attention");
  EXPECT_FALSE(keras.config.use_bias);
}

TEST(KerasFile, ListsTheAttentionLayers) {
  const auto nested = keras_attention_layers(fixture("nested.keras"));
  ASSERT_EQ(nested.size(), 3u);
  EXPECT_EQ(nested[0].name, "outer_attention");
  EXPECT_EQ(nested[0].group, "layers/multi_head_attention");
  EXPECT_EQ(nested[1].name, "decoy");
  EXPECT_EQ(nested[1].group, "layers/functional/layers/multi_head_attention");
  EXPECT_EQ(nested[2].name, "attention");
  EXPECT_EQ(nested[2].group, "layers/functional/layers/multi_head_attention_1");
  const auto legacy = keras_attention_layers(fixture("legacy_private.weights.h5"));
  ASSERT_EQ(legacy.size(), 1u);
  EXPECT_EQ(legacy[0].name, "");
  EXPECT_EQ(legacy[0].group, "layers/multi_head_attention");
}

TEST(KerasFile, SnakeCaseMatchesKeras) {
  using sdmha::detail::keras::to_snake_case;
  EXPECT_EQ(to_snake_case("MultiHeadAttention"), "multi_head_attention");
  EXPECT_EQ(to_snake_case("Functional"), "functional");
  EXPECT_EQ(to_snake_case("InputLayer"), "input_layer");
  EXPECT_EQ(to_snake_case("EinsumDense"), "einsum_dense");
  EXPECT_EQ(to_snake_case("Conv2D"), "conv2d");
  EXPECT_EQ(to_snake_case("HTTPResponseLayer"), "http_response_layer");
  EXPECT_EQ(to_snake_case("My-Layer"), "my_layer");
}

// ---- Names and shapes that do not fit -----------------------------------------------------------

TEST(KerasFile, MissingLayerIsNamed) {
  for (const char* file : {"functional_bias.weights.h5", "functional_bias.keras", "nested.keras"}) {
    SCOPED_TRACE(file);
    expect_error<FormatError>([&] { load_keras_layer<double>(fixture(file), "no_such_layer"); },
                              {"no MultiHeadAttention layer named 'no_such_layer'", "'attention'"});
  }
  expect_error<FormatError>(
      [] { load_keras_layer<double>(fixture("functional_bias.keras"), "head"); },
      {"layer 'head'", "is a Dense", "expected a MultiHeadAttention"});
  // A .weights.h5 from before Keras 3.6 holds no names: the error offers the group paths.
  expect_error<FormatError>(
      [] { load_keras_layer<double>(fixture("legacy_private.weights.h5"), "attention"); },
      {"'attention'", "'layers/multi_head_attention'", "HDF5 group path"});
}

TEST(KerasFile, ShapeMismatchNamesTheDataset) {
  expect_error<FormatError>(
      [] { load_keras_layer<double>(fixture("bad_shape.keras"), "attention"); },
      {"layers/multi_head_attention/query_dense/vars/0", "(5, 2, 4)", "(5, 2, 3)", "config.json"});
  const std::string weights = fixture("functional_bias.weights.h5");
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(weights, "attention", config_of(3, 3, 4, 7, true)); },
      {"layers/multi_head_attention/query_dense/vars/0", "(5, 2, 3)", "MhaConfig given"});
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(weights, "attention", config_of(2, 3, 0, 7, true)); },
      {"layers/multi_head_attention/value_dense/vars/0", "(6, 2, 4)", "(any, 2, 3)"});
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(weights, "attention", config_of(2, 3, 4, 0, true)); },
      {"layers/multi_head_attention/output_dense/vars/0", "(2, 4, 7)", "O = Eq"});
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(weights, "attention", config_of(2, 3, 4, 7, false)); },
      {"layers/multi_head_attention/query_dense/vars/1", "use_bias is false"});
  expect_error<FormatError>(
      [] {
        load_keras_layer<double>(fixture("legacy_private.weights.h5"),
                                 "layers/multi_head_attention", config_of(2, 3, 0, 0, false));
      },
      {"layers/multi_head_attention/_query_dense/vars/1"});
  expect_error<sdmha::ConfigError>(
      [&] { load_keras_layer<double>(weights, "attention", config_of(0, 3, 4, 7, true)); },
      {"num_heads = 0"});
}

TEST(KerasFile, DatasetClaimingMoreThanItStoresIsRefused) {
  expect_error<FormatError>(
      [] { load_keras_layer<float>(fixture("bomb.weights.h5"), "attention"); },
      {"layers/multi_head_attention/query_dense/vars/0", "declares 402653184 bytes", "stores 0"});
}

// ---- Unreadable and corrupt files ---------------------------------------------------------------

TEST(KerasFile, UnreadablePathsAreIoErrors) {
  const std::string dir = scratch("unreadable");
  expect_error<IoError>([&] { load_keras_layer<double>(dir + "/absent.keras", "attention"); },
                        {"absent.keras"});
  // A directory is read as saving_lib.save_model(..., zipped=False) writes one.
  expect_error<IoError>([&] { load_keras_layer<double>(dir, "attention"); }, {"config.json"});
}

// The members of the fixture nested.keras, written into `dir` as an unzipped .keras directory.
void unzip_nested_keras(const std::string& dir) {
  zip_t* archive = zip_open(fixture("nested.keras").c_str(), ZIP_RDONLY, nullptr);
  ASSERT_NE(archive, nullptr);
  for (const char* member : {"config.json", "metadata.json", "model.weights.h5"}) {
    zip_stat_t stat;
    ASSERT_EQ(zip_stat(archive, member, 0, &stat), 0);
    std::vector<std::uint8_t> bytes(stat.size);
    zip_file_t* file = zip_fopen(archive, member, 0);
    ASSERT_EQ(zip_fread(file, bytes.data(), bytes.size()), zip_int64_t(bytes.size()));
    zip_fclose(file);
    write_bytes(dir + "/" + member, bytes);
  }
  zip_discard(archive);
}

TEST(KerasFile, UnzippedKerasDirectoryLoads) {
  const std::string dir = scratch("unzipped");
  unzip_nested_keras(dir);
  const auto keras = load_keras_layer<double>(dir, "attention");
  EXPECT_EQ(keras.keras_version, "3.5.0");
  expect_forward(keras, "nested_attention.expected.npz", 1e-12);
}

// ---- metadata.json ------------------------------------------------------------------------------

// nested.keras with its metadata.json member written as `member` holding `metadata`, or left out
// when `member` is empty (the other members copied as they are).
std::string keras_with_metadata(const std::string& dir, const std::string& member,
                                const std::string& metadata) {
  zip_t* source = zip_open(fixture("nested.keras").c_str(), ZIP_RDONLY, nullptr);
  const std::string path =
      dir + "/metadata_" + std::to_string(std::hash<std::string>()(member + metadata)) + ".keras";
  zip_t* target = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, nullptr);
  for (const char* name : {"config.json", "model.weights.h5"})
    zip_file_add(target, name,
                 zip_source_zip(target, source, zip_name_locate(source, name, 0), 0, 0, -1),
                 ZIP_FL_OVERWRITE);
  if (!member.empty()) {
    // zip_source_buffer with freep = 1 releases the copy with free() (an empty buffer is none).
    char* copy = metadata.empty() ? nullptr : static_cast<char*>(std::malloc(metadata.size()));
    if (copy) std::memcpy(copy, metadata.data(), metadata.size());
    zip_file_add(target, member.c_str(),
                 zip_source_buffer(target, copy, metadata.size(), copy ? 1 : 0), ZIP_FL_OVERWRITE);
  }
  EXPECT_EQ(zip_close(target), 0);
  zip_discard(source);
  return path;
}

// A .keras file without a usable metadata.json loads (the layer needs nothing from it) with
// keras_version empty and the reason given, and is a FormatError naming the file and the reason
// under require_keras_version; one with a version loads either way.
void expect_unknown_version(const std::string& path, const std::string& reason) {
  SCOPED_TRACE(path);
  const auto keras = load_keras_layer<double>(path, "attention");
  EXPECT_EQ(keras.keras_version, "");
  EXPECT_NE(keras.no_keras_version_reason.find(reason), std::string::npos)
      << keras.no_keras_version_reason;
  EXPECT_EQ(keras.group, "layers/functional/layers/multi_head_attention_1");
  sdmha::io::KerasReadOptions strict;
  strict.require_keras_version = true;
  expect_error<FormatError>([&] { load_keras_layer<double>(path, "attention", strict); },
                            {"'" + path + "'", reason, "require_keras_version"});
}

TEST(KerasMetadata, AVersionStringIsReportedWithNoReason) {
  sdmha::io::KerasReadOptions strict;
  strict.require_keras_version = true;
  const auto keras = load_keras_layer<double>(fixture("nested.keras"), "attention", strict);
  EXPECT_EQ(keras.keras_version, "3.5.0");
  EXPECT_EQ(keras.no_keras_version_reason, "");
  const std::string dir = scratch("metadata_valid");
  const auto other = load_keras_layer<double>(
      keras_with_metadata(dir, "metadata.json", R"({"date_saved": "x", "keras_version": "3.9.1"})"),
      "attention", strict);
  EXPECT_EQ(other.keras_version, "3.9.1");
}

TEST(KerasMetadata, MissingOrRenamedMetadataLeavesTheVersionUnknownWithTheReason) {
  const std::string dir = scratch("metadata_missing");
  const std::string reason = "the archive has no member 'metadata.json'";
  expect_unknown_version(keras_with_metadata(dir, "", ""), reason);
  expect_unknown_version(keras_with_metadata(dir, "Metadata.json", R"({"keras_version": "3.5.0"})"),
                         reason);
  const std::string unzipped = scratch("metadata_missing_unzipped");
  unzip_nested_keras(unzipped);
  fs::remove(unzipped + "/metadata.json");
  expect_unknown_version(unzipped, "the directory has no file 'metadata.json'");
}

TEST(KerasMetadata, MalformedMetadataLeavesTheVersionUnknownWithTheReason) {
  const std::string dir = scratch("metadata_malformed");
  const std::pair<std::string, std::string> cases[] = {
      {R"({"keras_version": "3.5.0")", "metadata.json is not valid JSON"},
      {"", "metadata.json is not valid JSON"},
      {R"(["3.5.0"])", "metadata.json is a JSON array; expected an object"},
      {R"({"date_saved": "2024"})", "metadata.json has no 'keras_version'"},
      {R"({"keras_version": 3.5})", "keras_version is a JSON number; expected a version string"},
      {R"({"keras_version": null})", "keras_version is a JSON null"},
      {R"({"keras_version": ["3.5.0"]})", "keras_version is a JSON array"},
      {R"({"keras_version": ""})", "keras_version is empty; expected a version string"},
      {"{\"keras_version\": " + std::string(9, '[') + std::string(9, ']') + "}",
       "metadata.json nests JSON more than 8 levels deep at byte 25"}};
  for (const auto& [metadata, reason] : cases)
    expect_unknown_version(keras_with_metadata(dir, "metadata.json", metadata), reason);
}

// Nested a million levels deep (which a recursive parse would not survive), in a directory.
TEST(KerasMetadata, DeeplyNestedMetadataLeavesTheVersionUnknownWithTheReason) {
  const std::string dir = scratch("deep_metadata");
  unzip_nested_keras(dir);
  write_bytes(dir + "/metadata.json", std::vector<std::uint8_t>(1000000, std::uint8_t('[')));
  expect_unknown_version(dir, "nests JSON more than 8 levels deep at byte 8");
  expect_forward(load_keras_layer<double>(dir, "attention"), "nested_attention.expected.npz",
                 1e-12);
}

TEST(KerasMetadata, AWeightsFileHasNoVersionAndSaysWhy) {
  const std::string path = fixture("functional_bias.weights.h5");
  const auto keras = load_keras_layer<double>(path, "attention");
  EXPECT_EQ(keras.keras_version, "");
  EXPECT_EQ(keras.no_keras_version_reason, "a .weights.h5 file holds no metadata.json");
  sdmha::io::KerasReadOptions strict;
  strict.require_keras_version = true;
  expect_error<FormatError>([&] { load_keras_layer<double>(path, "attention", strict); },
                            {"holds no metadata.json", "require_keras_version"});
}

// Loads `path` in a forked child, in process there; returns "" for a success or a FormatError /
// IoError that left no HDF5 identifier open, else what went wrong (another exception, identifiers
// left open, a crash or a hang of the child).
std::string load_in_child(const std::string& path) {
  sdmha::io::IsolationLimits limits;
  limits.seconds = 20.0;
  try {
    return sdmha::detail::run_in_child("test", path, limits, [&] {
      std::string outcome;
      OpenHdf5Ids ids;
      try {
        load_keras_layer<double>(path, "attention");
      } catch (const FormatError&) {
      } catch (const IoError&) {
      } catch (const std::exception& error) {
        outcome = std::string("threw ") + typeid(error).name() + ": " + error.what() + "; ";
      }
      const std::string open = ids.left_open();
      return outcome + (open.empty() ? "" : "left open: " + open);
    });
  } catch (const sdmha::Error& error) {
    return error.what();
  }
}

TEST(KerasFile, TruncatedFilesAreFormatErrors) {
  const std::string dir = scratch("truncated");
  for (const char* name : {"functional_bias.weights.h5", "functional_bias.keras"}) {
    const auto bytes = read_bytes(fixture(name));
    for (const std::size_t size : {std::size_t(0), std::size_t(3), std::size_t(8), std::size_t(100),
                                   bytes.size() / 2, bytes.size() - 100, bytes.size() - 1}) {
      SCOPED_TRACE(std::string(name) + " cut to " + std::to_string(size));
      const std::string path = dir + "/" + name;
      write_bytes(path, std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + long(size)));
      EXPECT_THROW(expect_no_open_hdf5_ids([&] { load_keras_layer<double>(path, "attention"); }),
                   FormatError);
    }
  }
}

TEST(KerasFile, CorruptBytesNeverCrash) {
  const std::string dir = scratch("corrupt");
  std::mt19937 random(20240607);
  for (const char* name : {"functional_bias.weights.h5", "functional_bias.keras", "nested.keras"}) {
    const auto bytes = read_bytes(fixture(name));
    const std::string path = dir + "/" + name;
    for (int trial = 0; trial < 150; ++trial) {
      auto corrupt = bytes;
      const int flips = 1 + int(random() % 4);
      for (int flip = 0; flip < flips; ++flip)
        corrupt[random() % corrupt.size()] = std::uint8_t(random());
      write_bytes(path, corrupt);
      SCOPED_TRACE(std::string(name) + " trial " + std::to_string(trial));
      EXPECT_EQ(load_in_child(path), "");
    }
  }
}

// ---- Crafted .keras archives and HDF5 links -----------------------------------------------------

// functional_bias.keras with its config.json replaced by `config`.
std::string keras_with_config(const std::string& dir, const std::string& config) {
  zip_t* source = zip_open(fixture("functional_bias.keras").c_str(), ZIP_RDONLY, nullptr);
  const std::string path = dir + "/crafted.keras";
  std::remove(path.c_str());
  zip_t* target = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, nullptr);
  for (const char* member : {"metadata.json", "model.weights.h5"}) {
    zip_source_t* data =
        zip_source_zip(target, source, zip_name_locate(source, member, 0), 0, 0, -1);
    zip_file_add(target, member, data, ZIP_FL_OVERWRITE);
  }
  // zip_source_buffer with freep = 1 releases the copy with free().
  char* copy = static_cast<char*>(std::malloc(std::max<std::size_t>(config.size(), 1)));
  std::memcpy(copy, config.data(), config.size());
  zip_file_add(target, "config.json", zip_source_buffer(target, copy, config.size(), 1),
               ZIP_FL_OVERWRITE);
  zip_close(target);
  zip_discard(source);
  return path;
}

nlohmann::json functional_bias_config() {
  zip_t* archive = zip_open(fixture("functional_bias.keras").c_str(), ZIP_RDONLY, nullptr);
  zip_stat_t stat;
  zip_stat(archive, "config.json", 0, &stat);
  std::string text(stat.size, '\0');
  zip_file_t* file = zip_fopen(archive, "config.json", 0);
  zip_fread(file, text.data(), text.size());
  zip_fclose(file);
  zip_discard(archive);
  return nlohmann::json::parse(text);
}

TEST(KerasFile, CraftedConfigJsonIsRefused) {
  const std::string dir = scratch("config");
  const nlohmann::json original = functional_bias_config();
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json config = original;
    config["config"]["layers"][3]["config"][key] = value;
    return keras_with_config(dir, config.dump());
  };
  // The crafted archive itself loads while config.json is intact.
  EXPECT_EQ(load_keras_layer<double>(keras_with_config(dir, original.dump()), "attention").group,
            "layers/multi_head_attention");
  expect_error<FormatError>([&] { load_keras_layer<double>(keras_with_config(dir, "{"), "x"); },
                            {"config.json", "not valid JSON"});
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(keras_with_config(dir, std::string(1000, '[')), "x"); },
      {"nests JSON more than 512 levels"});
  expect_error<FormatError>([&] { load_keras_layer<double>(keras_with_config(dir, "[]"), "x"); },
                            {"is a JSON array"});
  expect_error<FormatError>([&] { load_keras_layer<double>(with("use_gate", true), "attention"); },
                            {"config.layers[3].config.use_gate = true is not supported"});
  expect_error<FormatError>(
      [&] {
        load_keras_layer<double>(with("output_shape", {7, 2}), "attention");
      },
      {"output_shape = [7,2] is not supported"});
  expect_error<FormatError>(
      [&] {
        load_keras_layer<double>(with("attention_axes", {1, 2}), "attention");
      },
      {"attention_axes"});
  expect_error<FormatError>([&] { load_keras_layer<double>(with("num_heads", -2), "attention"); },
                            {"num_heads = -2", "expected an integer in [1, 2^24]"});
  expect_error<FormatError>([&] { load_keras_layer<double>(with("key_dim", "3"), "attention"); },
                            {"key_dim = \"3\""});
  expect_error<FormatError>([&] { load_keras_layer<double>(with("use_bias", false), "attention"); },
                            {"layers/multi_head_attention/query_dense/vars/1", "config.json"});
  nlohmann::json renamed = original;  // the HDF5 group is named "attention", config.json disagrees
  renamed["config"]["layers"][3]["config"]["name"] = "other";
  expect_error<FormatError>(
      [&] { load_keras_layer<double>(keras_with_config(dir, renamed.dump()), "other"); },
      {"group 'layers/multi_head_attention' is named 'attention'", "places 'other'"});
}

// A copy of functional_bias.weights.h5 with `link` (a group) replaced by a soft or external link.
std::string weights_with_link(const std::string& dir, const std::string& link, bool external) {
  const std::string path = dir + "/linked.weights.h5";
  write_bytes(path, read_bytes(fixture("functional_bias.weights.h5")));
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  H5Ldelete(file, link.c_str(), H5P_DEFAULT);
  if (external)
    H5Lcreate_external("other.h5", "/x", file, link.c_str(), H5P_DEFAULT, H5P_DEFAULT);
  else
    H5Lcreate_soft("/layers/multi_head_attention/key_dense", file, link.c_str(), H5P_DEFAULT,
                   H5P_DEFAULT);
  H5Fclose(file);
  return path;
}

TEST(KerasFile, SoftAndExternalLinksAreRefused) {
  const std::string dir = scratch("links");
  const std::string link = "layers/multi_head_attention/query_dense";
  expect_error<FormatError>(
      [&] {
        load_keras_layer<double>(weights_with_link(dir, link, false),
                                 "layers/multi_head_attention");
      },
      {"'layers/multi_head_attention/query_dense' is a soft link"});
  expect_error<FormatError>(
      [&] {
        load_keras_layer<double>(weights_with_link(dir, link, true), "layers/multi_head_attention");
      },
      {"is an external or user-defined link"});
}

}  // namespace
}  // namespace sdmha_test
