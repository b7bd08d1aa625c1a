// Bad input that no other test file covers (each case is a row of docs/bad_input.md), and the
// regression tests for what the hardening work found (marked REGRESSION below).
#include "test_support.hpp"

#include "dense_mha.hpp"  // the bench's dense baseline (bench/), which the layers are compared with

#include <sdmha/io/layer_files.hpp>

#include <string>
#include <vector>

namespace sdmha_test {
namespace {

using sdmha::io::LayerFileOptions;
using sdmha::io::SafetensorsFile;
using sdmha::io::SafetensorsWriter;
using sdmha::io::TensorSource;

// A file's tensors, built in memory and read back through the safetensors reader.
class FileBuilder {
 public:
  FileBuilder& f64(const std::string& name, std::vector<std::int64_t> shape, double fill = 0.25) {
    std::int64_t count = 1;
    for (auto d : shape) count *= d;
    std::vector<double> data(static_cast<std::size_t>(count), fill);
    writer_.add<double>(name, shape, data.data());
    return *this;
  }
  FileBuilder& i64(const std::string& name, std::vector<std::int64_t> shape,
                   std::vector<std::int64_t> data) {
    writer_.add<std::int64_t>(name, shape, data.data());
    return *this;
  }
  FileBuilder& boolean(const std::string& name, std::vector<std::int64_t> shape, bool fill) {
    std::int64_t count = 1;
    for (auto d : shape) count *= d;
    std::vector<std::uint8_t> data(static_cast<std::size_t>(count), fill ? 1 : 0);
    writer_.add(name, sdmha::io::DType::BOOL, shape, data.data(), data.size());
    return *this;
  }
  FileBuilder& metadata(const std::string& key, const std::string& value) {
    writer_.set_metadata(key, value);
    return *this;
  }
  // A Keras layer: Eq = 3, Ek = Ev = 4, H = 2, Dk = Dv = 2, O = 3, with biases.
  FileBuilder& keras_layer(const std::string& prefix = "", bool biases = true) {
    f64(prefix + "query/kernel", {3, 2, 2}).f64(prefix + "key/kernel", {4, 2, 2});
    f64(prefix + "value/kernel", {4, 2, 2}).f64(prefix + "attention_output/kernel", {2, 2, 3});
    if (biases) {
      f64(prefix + "query/bias", {2, 2}).f64(prefix + "key/bias", {2, 2});
      f64(prefix + "value/bias", {2, 2}).f64(prefix + "attention_output/bias", {3});
    }
    return *this;
  }
  // Inputs for that layer: B = 2, T = 2, S = 3, two stored values.
  FileBuilder& inputs(std::vector<std::int64_t> dense_shape = {2, 2, 3},
                      std::vector<std::int64_t> indices = {0, 0, 1, 1, 1, 2},
                      std::vector<std::int64_t> value_shape = {2, 3, 4}) {
    i64("query/dense_shape", {3}, dense_shape);
    i64("query/indices", {std::int64_t(indices.size() / 3), 3}, indices);
    f64("query/values", {std::int64_t(indices.size() / 3)}, 1.5);
    return f64("value", value_shape);
  }
  TensorSource source() const {
    return TensorSource(SafetensorsFile::from_bytes(writer_.to_bytes(), "<test>"));
  }

 private:
  SafetensorsWriter writer_;
};

// ---- API ----

TEST(BadInput, TensorRefWithoutDataIsAShapeError) {
  const auto c = make_case<double>(Shape{}, 60);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  const sdmha::TensorRef3<double> no_key(nullptr, 2, 7, 12);
  SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {no_key, c.value}), sdmha::ShapeError,
                          "key has no data; expected 2 x 7 x 12 values");
}

TEST(BadInput, DropoutRateOutsideZeroToOneIsAConfigError) {
  const auto c = make_case<float>(Shape{}, 61);
  const sdmha::SparseDenseMHA<float> layer(c.config, c.weights);
  for (double rate : {1.0, -0.25, std::numeric_limits<double>::quiet_NaN()}) {
    auto options = c.options;
    options.training = true;
    options.dropout_rate = rate;
    SDMHA_EXPECT_THROW_WITH(layer.forward(c.query(), {c.key, c.value}, options), sdmha::ConfigError,
                            "expected 0 <= dropout_rate < 1");
  }
}

TEST(BadInput, ProjectContextRejectsNegativeThreadsAndMismatchedTensors) {
  const auto c = make_case<double>(Shape{}, 62);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  SDMHA_EXPECT_THROW_WITH(layer.project_context(c.key, c.value, -2), sdmha::ConfigError,
                          "project_context: num_threads = -2");
  Tensor3<double> narrow(2, 7, 5);
  narrow.setZero();
  SDMHA_EXPECT_THROW_WITH(layer.project_context(c.key, narrow), sdmha::ShapeError,
                          "value has width 5; expected the kernel's input width 12");
}

// ---- layer files (io/layer_files.hpp) ----

TEST(BadInputFiles, KerasLayerProblems) {
  auto load = [](const FileBuilder& file, LayerFileOptions options = {}) {
    return sdmha::io::load_layer<double>(file.source(), options);
  };
  EXPECT_NO_THROW(load(FileBuilder().keras_layer()));
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().f64("key/kernel", {4, 2, 2})), sdmha::FormatError,
                          "no tensor named '[prefix/]query/kernel'");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().keras_layer("a/").keras_layer("b/")),
                          sdmha::FormatError, "several layers ('a/', 'b/') hold a query/kernel");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().keras_layer("", false).f64("key/bias", {2, 2})),
                          sdmha::FormatError, "some projections have a bias and others not");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().keras_layer().metadata("layout", "jax")),
                          sdmha::FormatError, "metadata 'layout' = 'jax'; expected keras or torch");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().keras_layer().metadata("use_causal_mask", "maybe")),
                          sdmha::FormatError,
                          "metadata 'use_causal_mask' = 'maybe'; expected true or false");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().keras_layer().metadata("key_dim", "3")),
                          sdmha::ShapeError,
                          "metadata 'key_dim' = 3 but the weights' shapes give 2");
  auto wrong_bias = FileBuilder().keras_layer("", false);
  wrong_bias.f64("query/bias", {2, 3})
      .f64("key/bias", {2, 2})
      .f64("value/bias", {2, 2})
      .f64("attention_output/bias", {3});
  SDMHA_EXPECT_THROW_WITH(load(wrong_bias), sdmha::ShapeError,
                          "tensor 'query/bias' has shape [2, 3]; expected [2, 2]");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder()
                                   .f64("query/kernel", {3, 2, 2})
                                   .f64("key/kernel", {4, 2, 2})
                                   .f64("value/kernel", {4, 2, 2})
                                   .f64("attention_output/kernel", {2, 2, 3}),
                               LayerFileOptions{std::nullopt, 3, std::nullopt, std::nullopt}),
                          sdmha::ShapeError, "num_heads = 3 but the Keras kernels hold 2 heads");
}

TEST(BadInputFiles, TorchLayerProblems) {
  auto torch = [](bool with_out_bias = true) {
    FileBuilder file;
    file.f64("in_proj_weight", {12, 4}).f64("in_proj_bias", {12}).f64("out_proj.weight", {4, 4});
    if (with_out_bias) file.f64("out_proj.bias", {4});
    return file;
  };
  auto load = [](const FileBuilder& file, LayerFileOptions options = {}) {
    return sdmha::io::load_layer<double>(file.source(), options);
  };
  EXPECT_NO_THROW(load(torch().metadata("num_heads", "2")));
  SDMHA_EXPECT_THROW_WITH(
      load(torch()), sdmha::FormatError,
      "num_heads is neither in the metadata nor given; PyTorch weights need it");
  SDMHA_EXPECT_THROW_WITH(load(torch().metadata("num_heads", "3")), sdmha::ShapeError,
                          "embed_dim 4 is not divisible by num_heads 3");
  SDMHA_EXPECT_THROW_WITH(load(torch().metadata("num_heads", "0")), sdmha::ConfigError,
                          "num_heads = 0; expected > 0");
  SDMHA_EXPECT_THROW_WITH(load(torch().metadata("num_heads", "two")), sdmha::FormatError,
                          "metadata 'num_heads' = 'two'; expected an integer");
  SDMHA_EXPECT_THROW_WITH(load(torch().metadata("num_heads", "2").f64("bias_k", {1, 1, 4})),
                          sdmha::FormatError, "tensor 'bias_k' (add_bias_kv) is not supported");
  SDMHA_EXPECT_THROW_WITH(load(torch(false).metadata("num_heads", "2")), sdmha::FormatError,
                          "exactly one of 'in_proj_bias' and 'out_proj.bias' is present");
  FileBuilder separate;
  separate.f64("q_proj_weight", {4, 3}).f64("k_proj_weight", {4, 5}).f64("out_proj.weight", {4, 4});
  SDMHA_EXPECT_THROW_WITH(
      load(separate, LayerFileOptions{std::nullopt, 2, std::nullopt, std::nullopt}),
      sdmha::FormatError, "neither 'in_proj_weight' nor 'v_proj_weight' is present");
  FileBuilder packed_wrong;
  packed_wrong.f64("in_proj_weight", {12, 3})
      .f64("out_proj.weight", {4, 4})
      .metadata("num_heads", "2");
  SDMHA_EXPECT_THROW_WITH(load(packed_wrong), sdmha::ShapeError,
                          "tensor 'in_proj_weight' has shape [12, 3]; expected [12, 4]");
}

TEST(BadInputFiles, InputProblems) {
  auto load = [](const FileBuilder& file) { return sdmha::io::load_inputs<double>(file.source()); };
  EXPECT_NO_THROW(load(FileBuilder().inputs()));
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().f64("value", {2, 3, 4})), sdmha::FormatError,
                          "tensor 'query/dense_shape' is missing");
  FileBuilder wrong_rank;
  wrong_rank.i64("query/dense_shape", {1, 3}, {2, 2, 3});
  SDMHA_EXPECT_THROW_WITH(load(wrong_rank), sdmha::ShapeError,
                          "tensor 'query/dense_shape' has rank 2; expected rank 1");
  FileBuilder short_values;
  short_values.i64("query/dense_shape", {3}, {2, 2, 3})
      .i64("query/indices", {2, 3}, {0, 0, 1, 1, 1, 2});
  short_values.f64("query/values", {3}).f64("value", {2, 3, 4});
  SDMHA_EXPECT_THROW_WITH(load(short_values), sdmha::ShapeError,
                          "tensor 'query/values' has shape [3]; expected [2] (-1 = any)");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().inputs({2, 2, 3}, {0, 0, 1, 1, 5, 2})),
                          sdmha::IndexError,
                          "tensors 'query/indices', 'query/values', 'query/dense_shape': sdmha: "
                          "SparseQuery::from_coo: indices[1] step = 5 is out of range");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().inputs({2, -2, 3})), sdmha::ShapeError,
                          "steps = -2; expected >= 0");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().inputs({2, 2, 3}, {0, 0, 1}, {3, 3, 4})),
                          sdmha::ShapeError,
                          "tensor 'value' has batch 3; expected the query's batch 2");
  SDMHA_EXPECT_THROW_WITH(load(FileBuilder().inputs().boolean("attention_mask", {2, 2, 4}, true)),
                          sdmha::ShapeError,
                          "tensor 'attention_mask' has shape [2, 2, 4]; expected [2, 2, 3]");
  FileBuilder byte_mask;
  byte_mask.inputs().f64("attention_mask", {2, 2, 3});
  SDMHA_EXPECT_THROW_WITH(load(byte_mask), sdmha::FormatError,
                          "has dtype F64, which cannot be read as bool");
}

// ---- REGRESSION: found by the fuzzers and sanitizers ----
// Each of these failed (crash, sanitizer report or an exception outside sdmha::Error) when it was
// written; the comment says how. The ones marked "UBSan" pass by luck in a Release build (the
// overflow wraps to a harmless value) and fail in the ASan + UBSan build of .ci/hardening.sh.

// REGRESSION (UBSan: signed overflow in detail::load_keras, layer_files.hpp `H * Dk`): Keras
// kernels of shape [0, 2^32, 2^32] hold no bytes, so the file is well formed, but H·Dk overflows.
TEST(BadInputRegression, KerasKernelShapesWhoseHeadProductOverflows) {
  const std::int64_t big = std::int64_t(1) << 32;
  SafetensorsWriter writer;
  const double* none = nullptr;
  writer.add<double>("query/kernel", {0, big, big}, none);
  writer.add<double>("key/kernel", {0, big, big}, none);
  writer.add<double>("value/kernel", {0, big, 1}, none);
  writer.add<double>("attention_output/kernel", {big, 1, 0}, none);
  const TensorSource source(SafetensorsFile::from_bytes(writer.to_bytes(), "<overflow>"));
  EXPECT_THROW(sdmha::io::load_layer<double>(source), sdmha::Error);
}

// REGRESSION (SIGSEGV in every build: stack overflow): a header value nested a million arrays
// deep in "shape" is dumped recursively by nlohmann::json into the error message
// (SafetensorsFile::non_negative_integer, `value.dump()`). A 2 MB file kills the process.
TEST(BadInputRegression, DeeplyNestedHeaderValueIsAFormatError) {
  const std::size_t depth = 1000000;
  const std::string text = "{\"a\":{\"dtype\":\"F64\",\"shape\":" + std::string(depth, '[') +
                           std::string(depth, ']') + ",\"data_offsets\":[0,0]}}";
  std::vector<std::uint8_t> bytes(8);
  for (int i = 0; i < 8; ++i)
    bytes[std::size_t(i)] = std::uint8_t(std::uint64_t(text.size()) >> (8 * i));
  bytes.insert(bytes.end(), text.begin(), text.end());
  EXPECT_THROW(SafetensorsFile::from_bytes(bytes, "<deep>"), sdmha::FormatError);
}

// REGRESSION (UBSan: signed overflow in AttentionCore::attend, `T + query_tile - 1`):
// from_coo(0, INT64_MAX, Eq) is accepted (B·T = 0 fits), and forward then overflows computing
// its query tiles. Reachable from a file: query/dense_shape = [0, 2^63 - 1, Eq].
TEST(BadInputRegression, ZeroBatchWithStepsNearTheIndexLimit) {
  const auto c = make_case<double>(Shape{}, 63);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  const CooIndices no_entries(0, 3);
  const sdmha::Vector<double> no_values;
  try {
    const auto query = sdmha::SparseQuery<double>::from_coo(
        0, std::numeric_limits<Index>::max(), c.shape.query_dim, no_entries, no_values);
    Tensor3<double> empty(0, 7, 12);
    for (auto strategy :
         {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
      auto options = c.options;
      options.score_strategy = strategy;
      EXPECT_EQ(layer.forward(query, {empty, empty}, options).output.size(), 0);
    }
  } catch (const sdmha::ShapeError&) {
    // Rejecting the shape at the boundary is the other acceptable outcome.
  }
}

// REGRESSION (std::bad_alloc escapes instead of an sdmha::Error; UBSan: `B * H * tiles`
// overflows in AttentionCore::attend): from_coo(2^62, 0, Eq) is accepted (B·T = 0), and forward
// with return_attention_scores asks Eigen for a (2^62, H, 0, 0) tensor, whose dimension product
// overflows: Eigen throws std::bad_alloc. Reachable from a file: query/dense_shape = [2^62, 0, Eq]
// with a value of shape [2^62, 0, Ev] (no bytes).
TEST(BadInputRegression, HugeBatchWithZeroStepsAndScores) {
  const auto c = make_case<double>(Shape{}, 64);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  const Index huge = Index(1) << 62;
  const CooIndices no_entries(0, 3);
  const sdmha::Vector<double> no_values;
  std::vector<double> nothing;
  const sdmha::TensorRef3<double> empty(nothing.data(), huge, 0, 12);
  for (bool scores : {false, true}) {
    try {
      const auto query =
          sdmha::SparseQuery<double>::from_coo(huge, 0, c.shape.query_dim, no_entries, no_values);
      auto options = c.options;
      options.return_attention_scores = scores;
      const auto result = layer.forward(query, {empty, empty}, options);
      EXPECT_EQ(result.output.size(), 0);
    } catch (const sdmha::Error&) {
      // Rejecting the shape is fine; any other exception is the bug.
    } catch (const std::exception& error) {
      ADD_FAILURE() << "an exception other than sdmha::Error: " << error.what()
                    << " (scores: " << scores << ")";
    }
  }
}

// More than 2^59 scores (B·H·T·S, zero sizes counted as 1) is a ShapeError before any count is
// formed; a zero width lets such a shape come without data, from a file too.
TEST(BadInput, MoreThanTwoToTheFiftyNineScoresIsAShapeError) {
  const auto c = make_case<double>(Shape{}, 65);  // H = 2
  // The dense baseline: a sparse query of 2^59 rows does not fit the default int StorageIndex.
  const sdmha::DenseMHA<double> layer(c.config, c.weights);
  const Index huge = Index(1) << 59;
  std::vector<double> nothing;
  const sdmha::TensorRef3<double> query(nothing.data(), huge, 0, c.shape.query_dim);
  const sdmha::TensorRef3<double> empty(nothing.data(), huge, 0, 12);
  SDMHA_EXPECT_THROW_WITH(layer.forward(query, {empty, empty}, c.options), sdmha::ShapeError,
                          "B x H x T x S = 576460752303423488 x 2 x 0 x 0 scores; expected at "
                          "most 2^59");
}

// REGRESSION (UBSan: "applying non-zero offset to null pointer" in Eigen's Block, from
// AttentionCore::attend's `keys.block(b * S, h * Dk, key_end, Dk)` when S = 0: the projected keys
// are an empty matrix with a null data pointer, and head h ≥ 1 offsets it).
TEST(BadInputRegression, NoKeyStepsWithSeveralHeadsGiveTheOutputBias) {
  Shape s;
  s.heads = 3;
  const auto c = make_case<double>(s, 65);
  const sdmha::SparseDenseMHA<double> layer(c.config, c.weights);
  Tensor3<double> no_keys(s.batch, 0, s.key_in_dim), no_values(s.batch, 0, s.value_in_dim);
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    sdmha::AttentionOptions<double> options;
    options.score_strategy = strategy;
    options.return_attention_scores = true;
    const auto result = layer.forward(c.query(), {no_keys, no_values}, options);
    ASSERT_EQ(result.output.dimension(1), s.steps);
    for (long b = 0; b < s.batch; ++b)
      for (long t = 0; t < s.steps; ++t)
        for (long o = 0; o < result.output.dimension(2); ++o)
          EXPECT_EQ(result.output(b, t, o), c.weights.output_bias[o]);
  }
}

}  // namespace
}  // namespace sdmha_test
