// tests/fuzz/fuzz_safetensors.cpp — the safetensors reader and the layer loader on arbitrary bytes.
//
// The bytes are a whole file. SafetensorsFile::from_bytes must reject them with an sdmha::Error or
// give a file whose every tensor reads as every element type (or is refused with an sdmha::Error)
// with exactly its shape's element count. The file then goes through TensorSource to load_layer
// and load_inputs, and, when both succeed on small shapes, through a forward pass.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <sdmha/io/layer_files.hpp>
#include <sdmha/sdmha.hpp>

#include "fuzz_support.hpp"

namespace {

using sdmha::Index;
using sdmha::io::SafetensorsFile;
using sdmha::io::TensorSource;

// load_inputs builds the query's CSR rows, B·T + 1 offsets that a dense shape of three numbers
// can make as large as 2³¹: it runs under this row limit (SparseQueryLimits), which must refuse a
// larger dense shape with an sdmha::Error before allocating.
constexpr std::int64_t kMaxQueryRows = std::int64_t(1) << 16;
// The forward pass runs when the problem has at most this many scores and weights.
constexpr std::int64_t kMaxForwardWork = std::int64_t(1) << 16;

template <typename T>
void read_as(const SafetensorsFile& file, const std::string& name) {
  const auto& info = file.info(name);
  std::vector<T> values;
  if (!sdmha_fuzz::accepts([&] { values = file.read<T>(name); })) return;
  SDMHA_FUZZ_CHECK(std::int64_t(values.size()) == info.element_count());
  if constexpr (!std::is_same_v<T, bool>) {
    const T* view = file.data_if_aligned<T>(name);
    if (view != nullptr && !values.empty()) {
      SDMHA_FUZZ_CHECK(info.dtype == sdmha::detail::IoElement<T>::dtype);
      SDMHA_FUZZ_CHECK(std::memcmp(view, values.data(), values.size() * sizeof(T)) == 0);
    }
  }
}

// The product of a shape's dimensions, or −1 when it exceeds `limit` (no overflow on the way). A
// zero dimension makes the product 0 however large the others are.
std::int64_t bounded_product(const std::vector<std::int64_t>& shape, std::int64_t limit) {
  for (std::int64_t dimension : shape)
    if (dimension < 0) return -1;
  for (std::int64_t dimension : shape)
    if (dimension == 0) return 0;
  std::int64_t product = 1;
  for (std::int64_t dimension : shape) {
    if (dimension != 0 && product > limit / dimension) return -1;
    product *= dimension;
  }
  return product;
}

template <typename Scalar>
void load_and_run(const TensorSource& source) {
  sdmha::io::LayerFile<Scalar> layer_file;
  const bool have_layer =
      sdmha_fuzz::accepts([&] { layer_file = sdmha::io::load_layer<Scalar>(source); });
  sdmha::io::LayerInputs<Scalar> inputs;
  const bool have_inputs = sdmha_fuzz::accepts(
      [&] { inputs = sdmha::io::load_inputs<Scalar>(source, {kMaxQueryRows}); });
  if (have_inputs) {
    SDMHA_FUZZ_CHECK(inputs.query.rows() <= kMaxQueryRows);
    SDMHA_FUZZ_CHECK(inputs.key.dimension(0) == inputs.query.batch());
    SDMHA_FUZZ_CHECK(inputs.value.dimension(0) == inputs.query.batch());
    // A mask or bias keeps its stored rank and the query's steps and the value's key steps.
    for (const auto& [rank, steps, key_steps] :
         {std::tuple<int, Index, Index>{inputs.attention_mask.rank,
                                        inputs.attention_mask.dimension(2),
                                        inputs.attention_mask.dimension(3)},
          {inputs.attention_bias.rank, inputs.attention_bias.dimension(2),
           inputs.attention_bias.dimension(3)}}) {
      SDMHA_FUZZ_CHECK(rank == 0 || (rank >= 2 && rank <= 4));
      SDMHA_FUZZ_CHECK(rank == 0 ||
                       (steps == inputs.query.steps() && key_steps == inputs.value.dimension(1)));
    }
  }
  if (!have_layer || !have_inputs) return;

  const sdmha::LayerDims probe = layer_file.weights.validate(layer_file.config);
  const std::int64_t scores = bounded_product(
      {inputs.query.batch(), probe.num_heads, inputs.query.steps(), inputs.value.dimension(1)},
      kMaxForwardWork);
  const std::int64_t weights =
      bounded_product({probe.query_dim + probe.key_in_dim + probe.value_in_dim + probe.output_dim,
                       probe.num_heads, probe.key_dim + probe.value_dim},
                      kMaxForwardWork);
  if (scores < 0 || weights < 0) return;

  sdmha::SparseDenseMHA<Scalar> layer(layer_file.config, layer_file.weights);
  auto options = layer_file.attention_options();  // the file's causal mask, scale, alignment, …
  options.attention_mask = inputs.attention_mask;
  options.attention_bias = inputs.attention_bias;
  options.return_attention_scores = true;
  options.num_threads = 1;
  for (auto strategy :
       {sdmha::ScoreStrategy::project_first, sdmha::ScoreStrategy::sparse_regrouped}) {
    options.score_strategy = strategy;
    sdmha::AttentionResult<Scalar> result;
    if (!sdmha_fuzz::accepts([&] {
          result = layer.forward(inputs.query, {inputs.key, inputs.value}, options);
        }))
      return;
    SDMHA_FUZZ_CHECK(result.output.dimension(0) == inputs.query.batch());
    SDMHA_FUZZ_CHECK(result.output.dimension(1) == inputs.query.steps());
    // Every probability row sums to 1 or (fully blocked) is all zero, whatever the data — unless
    // the data itself is not finite, which the file may well hold.
    const auto& p = result.attention_scores;
    const Index key_steps = p.dimension(3);
    for (Index row = 0; key_steps > 0 && row < p.size() / key_steps; ++row) {
      double sum = 0.0;
      for (Index s = 0; s < key_steps; ++s) sum += double(p.data()[row * key_steps + s]);
      SDMHA_FUZZ_CHECK(!std::isfinite(sum) || sum == 0.0 || std::abs(sum - 1.0) < 1e-3);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<SafetensorsFile> parsed;
  if (!sdmha_fuzz::accepts([&] {
        parsed =
            SafetensorsFile::from_bytes(std::vector<std::uint8_t>(data, data + size), "<fuzz>");
      }))
    return 0;
  SafetensorsFile& file = *parsed;
  for (const std::string& name : file.names()) {
    const auto& info = file.info(name);
    SDMHA_FUZZ_CHECK(info.begin <= info.end);
    SDMHA_FUZZ_CHECK(std::uint64_t(info.element_count()) * sdmha::io::dtype_size(info.dtype) ==
                     info.end - info.begin);
    file.expect_shape(name, info.shape);
    file.expect_rank(name, info.shape.size());
    read_as<float>(file, name);
    read_as<double>(file, name);
    read_as<std::int64_t>(file, name);
    read_as<std::int32_t>(file, name);
    read_as<std::uint8_t>(file, name);
    read_as<bool>(file, name);
  }
  if (file.names().empty()) return 0;
  const TensorSource source(std::move(*parsed));
  // The precision follows the file, as sdmha-run does: float64 for F64 query values.
  if (source.contains("query/values") && source.dtype("query/values") == sdmha::io::DType::F64)
    load_and_run<double>(source);
  else
    load_and_run<float>(source);
  return 0;
}
