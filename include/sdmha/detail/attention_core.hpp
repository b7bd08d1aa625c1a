// sdmha/detail/attention_core.hpp — what the sparse layer and the dense baseline share: the
// weights, input validation, the plan of a call, the key/value and output projections, and the
// forward's per-tile score → softmax → values body. The two layers differ only in how they get
// the scores of a tile.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/softmax_exp.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// The mask of one attention item: its rows and keys of the masks of `options`.
template <typename Scalar>
BatchMask item_mask(const AttentionItem& item, const AttentionOptions<Scalar>& options, Index steps,
                    Index key_steps) {
  BatchMask mask;
  mask.steps = item.query_rows;
  mask.key_steps = item.key_steps;
  mask.first_step = item.query_begin;
  mask.first_key_step = item.key_begin;
  mask.causal = options.use_causal_mask;
  mask.causal_offset =
      options.causal_alignment == CausalAlignment::bottom_right ? key_steps - steps : 0;
  if (!options.attention_mask.empty()) {
    mask.attention =
        options.attention_mask.at(item.batch, item.head, item.query_begin, item.key_begin);
    mask.attention_stride = key_steps;
  }
  if (options.key_padding_mask.size() != 0)
    mask.key_padding = options.key_padding_mask.data() + item.batch * key_steps + item.key_begin;
  return mask;
}

// scores += the item's block of attention_bias, where neither is −∞; −∞ where either is: a
// blocked score stays blocked, and a −∞ bias blocks its position as a mask does, whatever the
// score (a NaN or ±∞ score from a non-finite key row included, which the sum would make NaN).
// Cost O(rows·keys) when there is a bias.
template <typename Scalar, typename Tile>
void add_attention_bias(const AttentionItem& item, const AttentionOptions<Scalar>& options,
                        Tile&& scores) {
  const BroadcastRef<Scalar>& bias = options.attention_bias;
  if (bias.empty()) return;
  constexpr Scalar blocked = -std::numeric_limits<Scalar>::infinity();
  for (Index t = 0; t < scores.rows(); ++t) {
    const Scalar* bias_row = bias.at(item.batch, item.head, item.query_begin + t, item.key_begin);
    for (Index s = 0; s < scores.cols(); ++s) {
      Scalar& score = scores(t, s);
      score = score == blocked || bias_row[s] == blocked ? blocked : score + bias_row[s];
    }
  }
}

// (d0, d1, …) of a mask or bias as the caller gave it, for messages.
template <typename T>
std::string shape_text(const BroadcastRef<T>& ref) {
  std::ostringstream text;
  const int first = ref.rank() == 2 ? 2 : 0;
  text << '(';
  for (int axis = first; axis < 4; ++axis) {
    if (ref.rank() == 3 && axis == 1) continue;
    text << ref.dimension(axis) << (axis < 3 ? ", " : ")");
  }
  return text.str();
}

// A mask or bias must broadcast to (B, H, T, S): (T, S), or B' ∈ {1, B}, H' ∈ {1, H}.
template <typename T>
void check_broadcast(const char* where, const char* name, const BroadcastRef<T>& ref, Index batch,
                     Index heads, Index steps, Index key_steps) {
  if (ref.empty()) return;
  // A raw view's rank must agree with its dimensions: (T, S) has B' = H' = 1, (B, T, S) H' = 1.
  const bool rank_agrees = (ref.rank() == 4) || (ref.rank() == 3 && ref.heads() == 1) ||
                           (ref.rank() == 2 && ref.batch() == 1 && ref.heads() == 1);
  const bool fits = (ref.batch() == batch || ref.batch() == 1) &&
                    (ref.heads() == heads || ref.heads() == 1) && ref.steps() == steps &&
                    ref.key_steps() == key_steps && rank_agrees;
  if (!fits)
    fail<ShapeError>(where, name, " is ", shape_text(ref), "; expected (B, T, S) = (", batch, ", ",
                     steps, ", ", key_steps, "), (T, S) = (", steps, ", ", key_steps,
                     ") or (B, H, T, S) = (", batch, ", ", heads, ", ", steps, ", ", key_steps,
                     ") with B or H possibly 1");
  if (ref.data() == nullptr && ref.size() > 0)
    fail<ShapeError>(where, name, " has no data; expected ", ref.size(), " values");
}

// Whether a stage's Arguments take a bfloat16 kernel (`kernel_bfloat16`).
template <typename Stage, typename = void>
struct reads_bfloat16_kernel : std::false_type {};
template <typename Stage>
struct reads_bfloat16_kernel<
    Stage, std::void_t<decltype(std::declval<typename Stage::Arguments&>().kernel_bfloat16)>>
    : std::true_type {};

// Whether a stage's Arguments can ask for its operands rounded to bfloat16
// (`bfloat16_operands`): the score and attend-values stages of the bfloat16 mode.
template <typename Stage, typename = void>
struct reads_bfloat16_operands : std::false_type {};
template <typename Stage>
struct reads_bfloat16_operands<
    Stage, std::void_t<decltype(std::declval<typename Stage::Arguments&>().bfloat16_operands)>>
    : std::true_type {};

template <typename Scalar, typename ScoreKernelT, typename SoftmaxT, typename AttendValuesT,
          typename OutputProjectionT, typename ContextProjectionT>
class AttentionCore {
  static_assert(std::is_same<typename ScoreKernelT::ScalarType, Scalar>::value,
                "the score kernel's ScalarType must be the layer's Scalar");
  static_assert(std::is_same<typename SoftmaxT::ScalarType, Scalar>::value,
                "the softmax's ScalarType must be the layer's Scalar");
  static_assert(std::is_same<typename AttendValuesT::ScalarType, Scalar>::value,
                "the attend-values stage's ScalarType must be the layer's Scalar");
  static_assert(std::is_same<typename OutputProjectionT::ScalarType, Scalar>::value,
                "the output projection's ScalarType must be the layer's Scalar");
  static_assert(std::is_same<typename ContextProjectionT::ScalarType, Scalar>::value,
                "the key/value projection's ScalarType must be the layer's Scalar");

 public:
  using ScalarType = Scalar;
  using ScoreKernel = ScoreKernelT;
  using Softmax = SoftmaxT;
  using AttendValues = AttendValuesT;
  using OutputProjection = OutputProjectionT;
  using ContextProjection = ContextProjectionT;

  const MhaConfig& config() const { return config_; }
  // The calls given no Workspace (forward, backward, project_context) borrow one the layer keeps
  // (detail::WorkspaceCache): after the first call they allocate only what they return and
  // start no threads. These are the bytes kept, and their release (threads stopped too).
  std::size_t workspace_cache_bytes() const { return workspace_cache_.bytes(); }
  void release_workspace_cache() const { workspace_cache_.release(); }
  // The weights, shared with whoever else holds them: a training step may update them in place
  // between calls (each call checks their shapes again).
  const MhaWeights<Scalar>& weights() const { return *weights_; }
  // A write access: bfloat16 copies of the kernels made before it are stale from now on.
  MhaWeights<Scalar>& weights() {
    ++weight_accesses_;
    return *weights_;
  }
  const std::shared_ptr<MhaWeights<Scalar>>& shared_weights() const { return weights_; }
  // Every width of the layer, from the configuration and the weights' current shapes.
  LayerDims dims() const { return weights_->validate(config_); }

  // The stage objects, for stages that carry parameters of their own. Set them up before the
  // layer is shared between threads: forward and backward only read them.
  ScoreKernel& score_kernel() { return score_kernel_; }
  Softmax& softmax() { return softmax_; }
  AttendValues& attend_values() { return attend_values_; }
  OutputProjection& output_projection() { return output_projection_; }
  ContextProjection& context_projection() { return context_projection_; }
  const ScoreKernel& score_kernel() const { return score_kernel_; }
  const Softmax& softmax() const { return softmax_; }
  const AttendValues& attend_values() const { return attend_values_; }
  const OutputProjection& output_projection() const { return output_projection_; }
  const ContextProjection& context_projection() const { return context_projection_; }

  // Projects key (B, S, Ek) and value (B, S, Ev) once, for forward and backward calls that reuse
  // them.
  ProjectedContext<Scalar> project_context(const TensorRef3<Scalar>& key,
                                           const TensorRef3<Scalar>& value,
                                           int num_threads = 0) const {
    const auto borrowed = borrow_workspace();
    ProjectedContext<Scalar> context;
    project_context(key, value, borrowed.workspace(), context, num_threads);
    return context;
  }
  // The same into `context`, working in `workspace`: a training loop that keeps both allocates
  // nothing and starts no threads after its first step.
  void project_context(const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                       Workspace<Scalar>& workspace, ProjectedContext<Scalar>& context,
                       int num_threads = 0) const {
    constexpr const char* where = "project_context";
    const LayerDims dims = this->dims();
    check_context(where, dims, key.dimension(0), key, value);
    check_dense_kernels_bfloat16(where, Pass::forward);
    if (num_threads < 0)
      fail<ConfigError>(where, "num_threads = ", num_threads,
                        "; expected >= 0 (0 means all hardware threads)");
    AttentionPlan plan;
    plan.dims = dims;
    plan.batch = key.dimension(0);
    plan.key_steps = key.dimension(1);
    plan.threads = resolve_thread_count(num_threads);
    plan.worker_scratch_bytes = context_scratch_bytes(plan);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    project_context_into(plan, key, value, lease.buffers(), context);
  }

 protected:
  // A workspace of the layer's cache for a call given none, given back when it goes out of scope.
  typename WorkspaceCache<Scalar>::Borrowed borrow_workspace() const {
    return typename WorkspaceCache<Scalar>::Borrowed(workspace_cache_);
  }

  AttentionCore(const MhaConfig& config, std::shared_ptr<MhaWeights<Scalar>> weights)
      : config_(config), weights_(std::move(weights)) {
    if (!weights_) fail<ConfigError>("layer", "weights is a null shared_ptr; expected MhaWeights");
    dims();  // ConfigError, ShapeError
  }

  // ---- bfloat16 kernels ---------------------------------------------------------------------

  // Wk, Wv and Wo rounded to bfloat16 and packed for the bfloat16 GEMM, with what they were
  // rounded from: the float kernels' places and the count of write accesses at the time.
  struct DenseKernelsBFloat16 {
    BFloat16Kernel key, value, output;
    const Scalar *key_source = nullptr, *value_source = nullptr, *output_source = nullptr;
    std::uint64_t weight_accesses = 0;
  };

  // Rounds Wk, Wv and Wo now (Precision::bfloat16), or drops the copies (float32). `where` names
  // the public call in errors: a double layer, or a key/value or output projection stage that
  // takes no kernel_bfloat16, is a ConfigError.
  void set_dense_kernel_precision(const char* where, Precision precision) {
    if (precision == Precision::float32) {
      dense_bfloat16_.reset();
      return;
    }
    if constexpr (!std::is_same<Scalar, float>::value) {
      fail<ConfigError>(where,
                        "precision is bfloat16 for a double layer; expected float32 "
                        "(bfloat16 kernels need Scalar = float)");
    } else if constexpr (!reads_bfloat16_kernel<ContextProjection>::value ||
                         !reads_bfloat16_kernel<OutputProjection>::value) {
      fail<ConfigError>(where,
                        "precision is bfloat16 but the key/value or output projection "
                        "stage takes no kernel_bfloat16; expected float32");
    } else {
      const MhaWeights<Scalar>& weights = *weights_;
      auto kernels = std::make_shared<DenseKernelsBFloat16>();
      kernels->key = BFloat16Kernel(weights.key_kernel);
      kernels->value = BFloat16Kernel(weights.value_kernel);
      kernels->output = BFloat16Kernel(weights.output_kernel);
      kernels->key_source = weights.key_kernel.data();
      kernels->value_source = weights.value_kernel.data();
      kernels->output_source = weights.output_kernel.data();
      kernels->weight_accesses = weight_accesses_;
      dense_bfloat16_ = std::move(kernels);
    }
  }
  bool dense_kernels_bfloat16() const { return dense_bfloat16_ != nullptr; }
  // Whether the scores and P·V round their operands (Q, K, P, V) to bfloat16: in the bfloat16
  // mode, when the score and attend-values stages both can.
  bool attends_in_bfloat16() const {
    return dense_bfloat16_ != nullptr && std::is_same<Scalar, float>::value &&
           reads_bfloat16_operands<ScoreKernel>::value &&
           reads_bfloat16_operands<AttendValues>::value;
  }
  std::uint64_t weight_accesses() const { return weight_accesses_; }

  // The bfloat16 copies must be those of the current kernels, in a forward pass.
  void check_dense_kernels_bfloat16(const char* where, Pass pass) const {
    if (dense_bfloat16_ == nullptr) return;
    if (pass == Pass::backward)
      fail<ConfigError>(where,
                        "the layer's precision is bfloat16; expected float32 for the "
                        "backward, which differentiates the float32 layer");
    const MhaWeights<Scalar>& weights = *weights_;
    const DenseKernelsBFloat16& copies = *dense_bfloat16_;
    auto same = [](const RowMatrix<Scalar>& kernel, const BFloat16Kernel& copy,
                   const Scalar* source) {
      return kernel.data() == source && kernel.rows() == copy.rows() &&
             kernel.cols() == copy.cols();
    };
    if (copies.weight_accesses != weight_accesses_ ||
        !same(weights.key_kernel, copies.key, copies.key_source) ||
        !same(weights.value_kernel, copies.value, copies.value_source) ||
        !same(weights.output_kernel, copies.output, copies.output_source))
      fail<ConfigError>(where,
                        "the bfloat16 kernels were rounded before the weights' last write "
                        "access; expected set_precision(Precision::bfloat16) again");
  }

  // The bfloat16 copy of one kernel for project_rows, or nullptr in float32.
  const BFloat16Kernel* dense_kernel_bfloat16(BFloat16Kernel DenseKernelsBFloat16::*kernel) const {
    return dense_bfloat16_ != nullptr ? &((*dense_bfloat16_).*kernel) : nullptr;
  }

  // ---- validation --------------------------------------------------------------------------

  // Checks key (B, S, Ek) and value (B, S, Ev) against the weights and the query's batch.
  static void check_context(const char* where, const LayerDims& dims, Index batch,
                            const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value) {
    auto check_tensor = [&](const char* name, const TensorRef3<Scalar>& tensor, Index width) {
      if (tensor.dimension(0) != batch)
        fail<ShapeError>(where, name, " has batch ", tensor.dimension(0),
                         "; expected the query's batch ", batch);
      if (tensor.dimension(2) != width)
        fail<ShapeError>(where, name, " has width ", tensor.dimension(2),
                         "; expected the kernel's input width ", width);
      if (tensor.data() == nullptr && tensor.dimension(0) * tensor.dimension(1) * width > 0)
        fail<ShapeError>(where, name, " has no data; expected ", batch, " x ", tensor.dimension(1),
                         " x ", width, " values");
    };
    check_tensor("key", key, dims.key_in_dim);
    check_tensor("value", value, dims.value_in_dim);
    if (key.dimension(1) != value.dimension(1))
      fail<ShapeError>(where, "key has ", key.dimension(1), " steps but value has ",
                       value.dimension(1), "; expected equal");
  }

  // Checks a ProjectedContext against the weights and the query's batch.
  static void check_context(const char* where, const LayerDims& dims, Index batch,
                            const ProjectedContext<Scalar>& context) {
    if (context.batch != batch)
      fail<ShapeError>(where, "context has batch ", context.batch, "; expected the query's batch ",
                       batch);
    if (context.key_steps < 0 || context.keys.rows() != context.batch * context.key_steps ||
        context.keys.cols() != dims.projected_key_width())
      fail<ShapeError>(where, "context.keys is ", context.keys.rows(), " x ", context.keys.cols(),
                       "; expected batch * key_steps x num_heads * key_dim = ",
                       context.batch * context.key_steps, " x ", dims.projected_key_width());
    if (context.values.rows() != context.keys.rows() ||
        context.values.cols() != dims.projected_value_width())
      fail<ShapeError>(
          where, "context.values is ", context.values.rows(), " x ", context.values.cols(),
          "; expected batch * key_steps x num_heads * value_dim = ", context.keys.rows(), " x ",
          dims.projected_value_width());
  }

  // Checks the options against (B, T, S) and starts the call's plan: sizes and threads.
  static AttentionPlan check_options(const char* where, const LayerDims& dims, Index batch,
                                     Index steps, Index key_steps,
                                     const AttentionOptions<Scalar>& options, Pass pass) {
    const auto& padding = options.key_padding_mask;
    if (padding.dimension(0) != 0 || padding.dimension(1) != 0) {
      if (padding.dimension(0) != batch || padding.dimension(1) != key_steps)
        fail<ShapeError>(where, "key_padding_mask is (", padding.dimension(0), ", ",
                         padding.dimension(1), "); expected (B, S) = (", batch, ", ", key_steps,
                         ")");
    }
    if (!(options.dropout_rate >= 0.0 && options.dropout_rate < 1.0))
      fail<ConfigError>(where, "dropout_rate = ", options.dropout_rate,
                        "; expected 0 <= dropout_rate < 1");
    if (options.num_threads < 0)
      fail<ConfigError>(where, "num_threads = ", options.num_threads,
                        "; expected >= 0 (0 means all hardware threads)");
    // Every count the plan forms (up to B·H·T·S scores) must be an Index: larger sizes, possible
    // without data when a width is 0, are refused rather than wrapped.
    const double scores = double(std::max<Index>(batch, 1)) * double(dims.num_heads) *
                          double(std::max<Index>(steps, 1)) * double(std::max<Index>(key_steps, 1));
    if (scores > double(Index(1) << 59))
      fail<ShapeError>(where, "B x H x T x S = ", batch, " x ", dims.num_heads, " x ", steps, " x ",
                       key_steps, " scores; expected at most 2^59");
    // After the bound above, so that a view's B'·H'·T·S cannot overflow.
    check_broadcast(where, "attention_mask", options.attention_mask, batch, dims.num_heads, steps,
                    key_steps);
    check_broadcast(where, "attention_bias", options.attention_bias, batch, dims.num_heads, steps,
                    key_steps);
    if (options.scale.has_value() && !std::isfinite(*options.scale))
      fail<ConfigError>(where, "scale = ", *options.scale,
                        "; expected a finite number (or none: 1/sqrt(key_dim))");
    AttentionPlan plan;
    plan.pass = pass;
    plan.batch = batch;
    plan.steps = steps;
    plan.key_steps = key_steps;
    plan.dims = dims;
    plan.threads = resolve_thread_count(options.num_threads);
    plan.causal = options.use_causal_mask;
    plan.causal_offset =
        options.causal_alignment == CausalAlignment::bottom_right ? key_steps - steps : 0;
    plan.scale = options.scale.value_or(1.0 / std::sqrt(double(dims.key_dim)));
    plan.fully_masked_rows = options.fully_masked_rows;
    plan.return_scores = options.return_attention_scores;
    if (options.training && options.dropout_rate > 0.0) {
      plan.dropout_rate = options.dropout_rate;
      plan.dropout_seed = options.dropout_generator == nullptr ? options.dropout_seed
                          : pass == Pass::forward              ? options.dropout_generator->next()
                                                               : options.dropout_generator->last();
    }
    return plan;
  }

  // ---- the plan's scratch ------------------------------------------------------------------

  std::size_t context_scratch_bytes(const AttentionPlan& plan) const {
    TileSizes sizes;
    sizes.rows = plan.pass == Pass::forward ? kProjectionRowBlock
                                            : std::max(plan.batch * plan.key_steps, Index(1));
    sizes.input_width = std::max(plan.dims.key_in_dim, plan.dims.value_in_dim);
    sizes.output_width =
        std::max(plan.dims.projected_key_width(), plan.dims.projected_value_width());
    return stage_workspace_size<ContextProjection>(sizes);
  }

  // Fills in the plan's tiles and each worker's scratch: the largest of what the stages ask for
  // (`query_stage_bytes` is the layer's own query projection's).
  void finish_plan(AttentionPlan& plan, std::size_t query_stage_bytes) const {
    plan.online_softmax = plan.pass == Pass::forward && !plan.regrouped() && !plan.return_scores &&
                          plan.fully_masked_rows == FullyMaskedRows::zeros &&
                          plan.key_steps > kKeyTile &&
                          std::is_same<Softmax, MaskedSoftmax<Scalar>>::value &&
                          std::is_same<AttendValues, sdmha::AttendValues<Scalar>>::value;
    plan.key_tile = plan.online_softmax ? kKeyTile : plan.key_steps;
    plan.query_tile = plan_query_tile(plan.pass, plan.regrouped(), plan.causal, plan.steps,
                                      plan.key_steps, plan.key_tile);
    plan.query_tiles = AttentionPlan::block_count(plan.steps, plan.query_tile);
    const Index rows = std::min(plan.query_tile, plan.steps);
    plan.tile_entries = rows * std::max(plan.key_tile, Index(2));
    TileSizes tile;
    tile.rows = rows;
    tile.key_steps = plan.key_tile;
    tile.key_dim = plan.dims.key_dim;
    tile.value_dim = plan.dims.value_dim;
    tile.features = plan.dims.query_dim;
    tile.bfloat16_operands = attends_in_bfloat16();
    if (plan.regrouped()) {
      tile.distinct_features = plan.query.distinct_largest;
      tile.nonzeros = plan.query.batch_nonzeros_largest;
    }
    TileSizes output;
    output.rows = plan.pass == Pass::forward ? kProjectionRowBlock
                                             : std::max(plan.batch * plan.steps, Index(1));
    output.input_width = plan.dims.projected_value_width();
    output.output_width = plan.dims.output_dim;
    plan.worker_scratch_bytes = std::max(
        {query_stage_bytes, context_scratch_bytes(plan),
         stage_workspace_size<OutputProjection>(output), stage_workspace_size<ScoreKernel>(tile),
         stage_workspace_size<Softmax>(tile), stage_workspace_size<AttendValues>(tile)});
  }

  // Whether a forward given key and value streams K and V: plan.context_chunk, for a finished
  // plan (the online softmax decided), by the layer's streaming sizes.
  void plan_context_streaming(AttentionPlan& plan) const {
    plan.context_chunk = plan_context_chunk(plan, sizeof(Scalar), context_streaming_);
  }

  // ---- forward passes ----------------------------------------------------------------------

  // input (rows × E) · kernel + bias → output, in the plan's fixed row blocks.
  // With `kernel_bfloat16` (the kernel's bfloat16 copy, or nullptr), the stage reads that.
  template <typename Projection>
  static void project_rows(const AttentionPlan& plan, const Projection& projection,
                           Index block_rows, const ConstMatrixRef<Scalar>& input,
                           const RowMatrix<Scalar>& kernel, const Vector<Scalar>& bias,
                           MatrixRef<Scalar> output, CallBuffers<Scalar>& buffers,
                           const BFloat16Kernel* kernel_bfloat16 = nullptr) {
    const Index rows = input.rows();
    const Index blocks = AttentionPlan::block_count(rows, block_rows);
    buffers.prepare_workers(plan.workers(blocks), plan.worker_scratch_bytes, 0, 0);
    parallel_for(
        blocks, plan.threads,
        [&](Index index, int worker) {
          const RowBlock block = AttentionPlan::block(index, rows, block_rows);
          typename Projection::Arguments args{input.middleRows(block.begin, block.rows), kernel,
                                              bias_view(bias),
                                              output.middleRows(block.begin, block.rows),
                                              buffers.workers[std::size_t(worker)].stage.view()};
          if constexpr (reads_bfloat16_kernel<Projection>::value)
            args.kernel_bfloat16 = kernel_bfloat16;
          Projection::can_implement(args);
          projection(args);
        },
        &buffers.pool);
  }

  // K and V of validated key and value, into `context` (resized; reallocated only when it grows).
  void project_context_into(const AttentionPlan& plan, const TensorRef3<Scalar>& key,
                            const TensorRef3<Scalar>& value, CallBuffers<Scalar>& buffers,
                            ProjectedContext<Scalar>& context) const {
    const MhaWeights<Scalar>& weights = *weights_;
    context.batch = value.dimension(0);
    context.key_steps = value.dimension(1);
    const Index rows = context.batch * context.key_steps;
    context.keys.resize(rows, plan.dims.projected_key_width());
    context.values.resize(rows, plan.dims.projected_value_width());
    project_rows(plan, context_projection_, kProjectionRowBlock, key.as_matrix(),
                 weights.key_kernel, weights.key_bias, context.keys, buffers,
                 dense_kernel_bfloat16(&DenseKernelsBFloat16::key));
    project_rows(plan, context_projection_, kProjectionRowBlock, value.as_matrix(),
                 weights.value_kernel, weights.value_bias, context.values, buffers,
                 dense_kernel_bfloat16(&DenseKernelsBFloat16::value));
  }

  // Where K and V of key step s of batch entry b are: row b·S + s − first_row of `keys` and
  // `values` (first_row 0 for a whole projected context).
  struct ContextRows {
    ConstMatrixRef<Scalar> keys, values;
    Index first_row;
  };
  // The keys [key_begin, key_end) of one pass over an item; the first pass starts each row's
  // online-softmax state, the last normalises the row.
  struct KeyChunk {
    Index key_begin, key_end;
    bool first, last;
  };

  // The shared body of forward: for every attention item of the plan, the scores (from
  // `compute_scores(item, mask, key_tile, bfloat16_operands, scratch, scores)`), the softmax,
  // dropout and P·V into the heads, then the output projection. K and V are `context`'s. Scratch
  // comes from `buffers`, the output goes to `result` (both resized only when shapes change).
  template <typename ComputeScores>
  void attend(const AttentionPlan& plan, const ProjectedContext<Scalar>& context,
              const AttentionOptions<Scalar>& options, ComputeScores&& compute_scores,
              CallBuffers<Scalar>& buffers, AttentionResult<Scalar>& result) const {
    begin_attention(plan, options, buffers, result);
    const ContextRows whole{context.keys, context.values, 0};
    mark_finite_values(plan, whole, 0, plan.batch, 0, plan.key_steps, buffers);
    buffers.prepare_workers(plan.workers(plan.attention_items()), plan.worker_scratch_bytes,
                            plan.tile_entries, 2);
    const KeyChunk all_keys{0, plan.key_steps, true, true};
    parallel_for(
        plan.attention_items(), plan.threads,
        [&](Index index, int worker) {
          auto& worker_buffers = buffers.workers[std::size_t(worker)];
          if (plan.online_softmax)
            attend_item_online(plan, plan.attention_item(index), whole, all_keys, options,
                               compute_scores, worker_buffers, buffers);
          else
            attend_item(plan, plan.attention_item(index), context, options, compute_scores,
                        worker_buffers, buffers, result);
        },
        &buffers.pool);
    project_output(plan, buffers, result);
  }

  // The same with K and V streamed (plan.context_chunk > 0, so the online softmax runs): per
  // batch entry b and chunk of key steps, that chunk's K and V are projected, then every item of
  // b runs over its key tiles in the chunk, the rows' online-softmax state kept between chunks.
  // Each row meets the same key tiles in the same order as in `attend`, so the bits are the same.
  template <typename ComputeScores>
  void attend_streamed(const AttentionPlan& plan, const TensorRef3<Scalar>& key,
                       const TensorRef3<Scalar>& value, const AttentionOptions<Scalar>& options,
                       ComputeScores&& compute_scores, CallBuffers<Scalar>& buffers,
                       AttentionResult<Scalar>& result) const {
    SDMHA_ASSERT(plan.online_softmax && plan.context_chunk % plan.key_tile == 0);
    begin_attention(plan, options, buffers, result);
    const Index S = plan.key_steps, items = plan.heads() * plan.query_tiles;
    // The chunk's rows widened to whole projection row blocks: at most 2 blocks more.
    const Index chunk_rows = std::min(plan.context_chunk + 2 * kProjectionRowBlock, plan.batch * S);
    buffers.context_chunk.keys.resize(chunk_rows, plan.dims.projected_key_width());
    buffers.context_chunk.values.resize(chunk_rows, plan.dims.projected_value_width());
    for (Index b = 0; b < plan.batch; ++b)
      for (Index key_begin = 0; key_begin < S; key_begin += plan.context_chunk) {
        const KeyChunk chunk{key_begin, std::min(S, key_begin + plan.context_chunk), key_begin == 0,
                             key_begin + plan.context_chunk >= S};
        const ContextRows rows = project_context_chunk(plan, key, value, b, chunk, buffers);
        mark_finite_values(plan, rows, b, b + 1, chunk.key_begin, chunk.key_end, buffers);
        buffers.prepare_workers(plan.workers(items), plan.worker_scratch_bytes, plan.tile_entries,
                                2);
        parallel_for(
            items, plan.threads,
            [&](Index index, int worker) {
              attend_item_online(plan, plan.attention_item(b * items + index), rows, chunk, options,
                                 compute_scores, buffers.workers[std::size_t(worker)], buffers);
            },
            &buffers.pool);
      }
    project_output(plan, buffers, result);
  }

  // K and V of batch entry b's key steps in `chunk`, into buffers.context_chunk. The rows
  // projected are the whole row blocks of kProjectionRowBlock (counted from row 0 of all B·S)
  // that hold the chunk: the blocks, and so the bits, of project_context_into.
  ContextRows project_context_chunk(const AttentionPlan& plan, const TensorRef3<Scalar>& key,
                                    const TensorRef3<Scalar>& value, Index b, const KeyChunk& chunk,
                                    CallBuffers<Scalar>& buffers) const {
    const Index S = plan.key_steps, block = kProjectionRowBlock;
    const Index first = (b * S + chunk.key_begin) / block * block;
    const Index end = std::min(plan.batch * S, (b * S + chunk.key_end + block - 1) / block * block);
    auto keys = buffers.context_chunk.keys.topRows(end - first);
    auto values = buffers.context_chunk.values.topRows(end - first);
    const MhaWeights<Scalar>& weights = *weights_;
    project_rows(plan, context_projection_, block, key.as_matrix().middleRows(first, end - first),
                 weights.key_kernel, weights.key_bias, keys, buffers,
                 dense_kernel_bfloat16(&DenseKernelsBFloat16::key));
    project_rows(plan, context_projection_, block, value.as_matrix().middleRows(first, end - first),
                 weights.value_kernel, weights.value_bias, values, buffers,
                 dense_kernel_bfloat16(&DenseKernelsBFloat16::value));
    return ContextRows{keys, values, first};
  }

  // What both forms of attend do first: the result's seed and returned scores sized, the heads
  // and the online-softmax state sized.
  static void begin_attention(const AttentionPlan& plan, const AttentionOptions<Scalar>& options,
                              CallBuffers<Scalar>& buffers, AttentionResult<Scalar>& result) {
    const Index B = plan.batch, T = plan.steps, S = plan.key_steps, H = plan.heads();
    result.dropout_seed = plan.dropout_rate > 0.0 ? plan.dropout_seed : 0;
    if (options.return_attention_scores)
      result.attention_scores.resize(B, H, T, S);
    else if (result.attention_scores.size() != 0)
      result.attention_scores = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>();
    buffers.heads.resize(B * T, plan.dims.projected_value_width());
    // Rows no item writes (no key steps: every row fully blocked) are 0, as are their heads.
    if (plan.attention_items() == 0) buffers.heads.setZero();
    if (plan.online_softmax) buffers.online_statistics.resize(B * T, 2 * H);
    buffers.value_is_finite.assign(std::size_t(B * H * plan.key_tiles_per_head()), 0);
  }

  // Y = A·Wo + bo from the heads, into result.output.
  void project_output(const AttentionPlan& plan, CallBuffers<Scalar>& buffers,
                      AttentionResult<Scalar>& result) const {
    const Index B = plan.batch, T = plan.steps;
    result.output.resize(B, T, plan.dims.output_dim);
    project_rows(plan, output_projection_, kProjectionRowBlock, buffers.heads,
                 weights_->output_kernel, weights_->output_bias,
                 Eigen::Map<RowMatrix<Scalar>>(result.output.data(), B * T, plan.dims.output_dim),
                 buffers, dense_kernel_bfloat16(&DenseKernelsBFloat16::output));
  }

  // Whether V is finite on each key tile of the plan's grid (plan.key_tile wide, one tile of all
  // S keys without the online softmax) that starts in [key_begin, key_end), per head, for the
  // batch entries b in [batch_begin, batch_end): flag (b·H + h)·key_tiles_per_head + j (in the
  // bfloat16 mode, finite when rounded too: all_finite_doubled). It depends on V and the grid
  // only, not on how K and V are streamed. One parallel loop for all the entries: each loop wakes
  // the pool's threads, which costs tens of microseconds.
  void mark_finite_values(const AttentionPlan& plan, const ContextRows& context, Index batch_begin,
                          Index batch_end, Index key_begin, Index key_end,
                          CallBuffers<Scalar>& buffers) const {
    const bool rounded = attends_in_bfloat16();
    const Index H = plan.heads(), S = plan.key_steps, Dv = plan.dims.value_dim;
    const Index width = plan.key_tile, per_head = plan.key_tiles_per_head();
    const Index first = key_begin / std::max<Index>(width, 1);
    const Index tiles = width > 0 ? (key_end - key_begin + width - 1) / width : 0;
    parallel_for((batch_end - batch_begin) * H * tiles, plan.threads,
                 [&](Index item, int) {
                   const Index b = batch_begin + item / (H * tiles), h = item / tiles % H;
                   const Index tile = first + item % tiles;
                   const Index keys = std::min(width, S - tile * width);
                   const auto values = context.values.block(
                       b * S + tile * width - context.first_row, h * Dv, keys, Dv);
                   buffers.value_is_finite[std::size_t((b * H + h) * per_head + tile)] =
                       rounded ? all_finite_doubled<Scalar>(values) : all_finite<Scalar>(values);
                 },
                 &buffers.pool);
  }
  static bool value_is_finite(const AttentionPlan& plan, const CallBuffers<Scalar>& buffers,
                              const AttentionItem& tile) {
    const Index index = (tile.batch * plan.heads() + tile.head) * plan.key_tiles_per_head() +
                        tile.key_begin / plan.key_tile;
    return buffers.value_is_finite[std::size_t(index)] != 0;
  }
  // The Arguments of an attend-values Stage for a tile: P, its V, the heads' rows, V's finiteness
  // and whether P and V are rounded to bfloat16.
  template <typename Stage, typename Probabilities, typename Heads>
  typename Stage::Arguments values_arguments(const AttentionPlan& plan, const AttentionItem& tile,
                                             Probabilities& probabilities,
                                             const ConstMatrixRef<Scalar>& value, Heads& heads,
                                             const CallBuffers<Scalar>& buffers,
                                             StageScratch scratch) const {
    typename Stage::Arguments args{
        tile.position(), probabilities, value, heads, value_is_finite(plan, buffers, tile),
        scratch};
    if constexpr (reads_bfloat16_operands<Stage>::value)
      args.bfloat16_operands = attends_in_bfloat16();
    return args;
  }

  template <typename ComputeScores>
  void attend_item(const AttentionPlan& plan, const AttentionItem& item,
                   const ProjectedContext<Scalar>& context, const AttentionOptions<Scalar>& options,
                   ComputeScores& compute_scores, WorkerBuffers<Scalar>& worker,
                   CallBuffers<Scalar>& buffers, AttentionResult<Scalar>& result) const {
    const Index T = plan.steps, S = plan.key_steps;
    const Index Dk = plan.dims.key_dim, Dv = plan.dims.value_dim;
    const Index b = item.batch, h = item.head, rows = item.query_rows, keys = item.key_steps;
    auto heads = buffers.heads.block(b * T + item.query_begin, h * Dv, rows, Dv);
    if (keys == 0) {  // every row fully blocked: zero probabilities, zero heads
      heads.setZero();
      if (options.return_attention_scores) scores_in_result(plan, item, result).setZero();
      return;
    }
    using Tile = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    Tile scores = options.return_attention_scores
                      ? scores_in_result(plan, item, result)
                      : as_tile(worker.tile(0, rows, keys, plan.tile_entries));
    const TilePosition position = item.position();
    const StageScratch scratch = worker.stage.view();
    compute_scores(
        item, item_mask(item, options, T, S),
        ConstMatrixRef<Scalar>(context.keys.block(b * S + item.key_begin, h * Dk, keys, Dk)),
        attends_in_bfloat16(), scratch, MatrixRef<Scalar>(scores));
    add_attention_bias(item, options, scores);
    typename Softmax::Arguments softmax_args{position, scores, scratch, plan.fully_masked_rows};
    Softmax::can_implement(softmax_args);
    softmax_(softmax_args);
    // Dropout acts on the probabilities that meet the values; returned scores stay before it.
    const DropoutMask dropout = plan.dropout();
    const bool keep_scores = dropout.active() && options.return_attention_scores;
    Tile probabilities =
        keep_scores ? as_tile(worker.tile(1, rows, keys, plan.tile_entries)) : scores;
    if (keep_scores) probabilities = scores;
    dropout.apply(probabilities, b, h, item.query_begin, item.key_begin);
    const auto values_args = values_arguments<AttendValues>(
        plan, item, probabilities,
        ConstMatrixRef<Scalar>(context.values.block(b * S + item.key_begin, h * Dv, keys, Dv)),
        heads, buffers, scratch);
    AttendValues::can_implement(values_args);
    attend_values_(values_args);
  }

  // The item with an online softmax over its key tiles that start in `chunk` (the plan chose it
  // only for the default softmax and attend-values stages). Per row t, with m_t the largest score
  // so far and l_t the sum of exp(score − m_t) so far, each key tile j does
  //   m' = max(m_t, max_s S_j[t, s]),  P_j[t, s] = exp(S_j[t, s] − m'),
  //   l_t ← l_t·exp(m_t − m') + Σ_s P_j[t, s],  A[t] ← A[t]·exp(m_t − m') + dropout(P_j)[t]·V_j,
  // and after the last chunk A[t] /= l_t: the softmax's probabilities, normalised after the
  // product instead of before it. (m_t, l_t) live in buffers.online_statistics between chunks. A
  // row without a key it may see keeps l_t = 0 and gets A[t] = 0; a NaN or +∞ score makes l_t
  // NaN and the row NaN, as MaskedSoftmax does.
  template <typename ComputeScores>
  void attend_item_online(const AttentionPlan& plan, const AttentionItem& item,
                          const ContextRows& context, const KeyChunk& chunk,
                          const AttentionOptions<Scalar>& options, ComputeScores& compute_scores,
                          WorkerBuffers<Scalar>& worker, CallBuffers<Scalar>& buffers) const {
    const Index row = item.batch * plan.steps + item.query_begin, rows = item.query_rows;
    const Index Dv = plan.dims.value_dim;
    auto heads = buffers.heads.block(row, item.head * Dv, rows, Dv);
    auto statistics = buffers.online_statistics.block(row, 2 * item.head, rows, 2);
    if (chunk.first) {
      heads.setZero();
      statistics.col(0).setConstant(-std::numeric_limits<Scalar>::infinity());
      statistics.col(1).setZero();
    }
    for (Index index = 0; index < plan.key_tiles(item); ++index) {
      const AttentionItem tile = plan.key_tile_of(item, index);
      if (tile.key_begin < chunk.key_begin) continue;
      if (tile.key_begin >= chunk.key_end) break;
      attend_key_tile(plan, tile, context, options, compute_scores, worker, buffers, statistics,
                      heads);
    }
    if (!chunk.last) return;
    for (Index t = 0; t < rows; ++t) {
      const Scalar sum = statistics(t, 1);
      if (sum > Scalar(0))
        heads.row(t) *= Scalar(1) / sum;
      else if (sum == Scalar(0))
        heads.row(t).setZero();
      else  // NaN: a NaN or +∞ score, whose row MaskedSoftmax makes NaN too
        heads.row(t).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    }
  }

  // One key tile of an item under the online softmax: its scores (masked, biased), the update of
  // the rows' (m_t, l_t) and partial heads, dropout, and heads += P_j·V_j.
  template <typename ComputeScores, typename Statistics, typename Heads>
  void attend_key_tile(const AttentionPlan& plan, const AttentionItem& tile,
                       const ContextRows& context, const AttentionOptions<Scalar>& options,
                       ComputeScores& compute_scores, WorkerBuffers<Scalar>& worker,
                       const CallBuffers<Scalar>& buffers, Statistics& statistics,
                       Heads& heads) const {
    const Index T = plan.steps, S = plan.key_steps;
    const Index Dk = plan.dims.key_dim, Dv = plan.dims.value_dim, h = tile.head;
    const Index key_row = tile.batch * S + tile.key_begin - context.first_row;
    auto scores = worker.tile(0, tile.query_rows, tile.key_steps, plan.tile_entries);
    const StageScratch scratch = worker.stage.view();
    compute_scores(tile, item_mask(tile, options, T, S),
                   ConstMatrixRef<Scalar>(context.keys.block(key_row, h * Dk, tile.key_steps, Dk)),
                   attends_in_bfloat16(), scratch, MatrixRef<Scalar>(scores));
    add_attention_bias(tile, options, scores);
    online_softmax_update(scores, statistics, heads);
    plan.dropout().apply(scores, tile.batch, h, tile.query_begin, tile.key_begin);
    // heads += P_j·V_j: the default stage's product, accumulating.
    using DefaultAttendValues = sdmha::AttendValues<Scalar>;
    DefaultAttendValues::multiply(
        values_arguments<DefaultAttendValues>(
            plan, tile, scores,
            ConstMatrixRef<Scalar>(context.values.block(key_row, h * Dv, tile.key_steps, Dv)),
            heads, buffers, scratch),
        true);
  }

  // One key tile of the online softmax: scores → unnormalised probabilities exp(S − m'), with
  // the running maximum and sum of each row updated and its partial output rescaled to m'.
  // Probabilities below the smallest normal number are flushed to 0, as MaskedSoftmax does, so
  // a blocked key (−∞) contributes exactly 0.
  template <typename Tile, typename Statistics, typename Heads>
  static void online_softmax_update(Tile& scores, Statistics& statistics, Heads& heads) {
    constexpr Scalar minus_infinity = -std::numeric_limits<Scalar>::infinity();
    for (Index t = 0; t < scores.rows(); ++t) {
      auto row = scores.row(t).array();
      const Scalar previous = statistics(t, 0);
      const Scalar maximum = std::max(previous, row_maximum(scores.row(t).data(), scores.cols()));
      if (maximum == minus_infinity) {  // nothing seen yet in this row (or a NaN max ignores)
        if (row.isNaN().any()) statistics(t, 1) = std::numeric_limits<Scalar>::quiet_NaN();
        row.setZero();
        continue;
      }
      const Scalar sum = exponentiate_shifted(scores.row(t).data(), scores.cols(), maximum);
      const Scalar correction =
          previous == minus_infinity ? Scalar(0) : std::exp(previous - maximum);
      statistics(t, 1) = statistics(t, 1) * correction + sum;
      statistics(t, 0) = maximum;
      if (correction != Scalar(1)) heads.row(t) *= correction;
    }
  }

  // The item's block of the returned (B, H, T, S) probabilities; keys beyond the item's are 0.
  static Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> scores_in_result(
      const AttentionPlan& plan, const AttentionItem& item, AttentionResult<Scalar>& result) {
    const Index S = plan.key_steps;
    Scalar* first = result.attention_scores.data() +
                    ((item.batch * plan.heads() + item.head) * plan.steps + item.query_begin) * S;
    Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> whole(first, item.query_rows, S,
                                                                 Eigen::OuterStride<>(S));
    whole.rightCols(S - item.key_begin - item.key_steps).setZero();
    whole.leftCols(item.key_begin).setZero();
    return Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>(
        first + item.key_begin, item.query_rows, item.key_steps, Eigen::OuterStride<>(S));
  }
  static Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> as_tile(
      Eigen::Map<RowMatrix<Scalar>> map) {
    return Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>(
        map.data(), map.rows(), map.cols(), Eigen::OuterStride<>(map.cols()));
  }

  // The masked scores of one tile from its block of the projected query Q (B·T × H·Dk), by the
  // score stage's project-first Arguments: the sparse layer's project_first strategy and the
  // dense baseline.
  void project_first_scores(const AttentionPlan& plan, const AttentionItem& item,
                            const RowMatrix<Scalar>& projected_query, const BatchMask& mask,
                            const ConstMatrixRef<Scalar>& key, bool bfloat16_operands,
                            StageScratch scratch, MatrixRef<Scalar> scores) const {
    const Index Dk = plan.dims.key_dim;
    typename ScoreKernel::Arguments args{
        item.position(),
        projected_query.block(item.batch * plan.steps + item.query_begin, item.head * Dk,
                              item.query_rows, Dk),
        key,
        Scalar(plan.scale),
        mask,
        scores,
        scratch};
    if constexpr (reads_bfloat16_operands<ScoreKernel>::value)
      args.bfloat16_operands = bfloat16_operands;
    ScoreKernel::can_implement(args);
    score_kernel_(args);
  }

  // A projection's bias, or an empty view when the layer has none.
  static ConstVectorRef<Scalar> bias_view(const Vector<Scalar>& bias) {
    static const Vector<Scalar> none;
    return bias.size() != 0 ? ConstVectorRef<Scalar>(bias) : ConstVectorRef<Scalar>(none);
  }
  static ConstVectorRef<Scalar> bias_segment(const Vector<Scalar>& bias, Index start, Index size) {
    static const Vector<Scalar> none;
    return bias.size() != 0 ? ConstVectorRef<Scalar>(bias.segment(start, size))
                            : ConstVectorRef<Scalar>(none);
  }

  MhaConfig config_;
  std::shared_ptr<MhaWeights<Scalar>> weights_;
  ScoreKernel score_kernel_;
  Softmax softmax_;
  AttendValues attend_values_;
  OutputProjection output_projection_;
  ContextProjection context_projection_;
  ContextStreaming context_streaming_;  // see plan_context_chunk
  std::shared_ptr<const DenseKernelsBFloat16> dense_bfloat16_;
  std::uint64_t weight_accesses_ = 0;       // calls of the non-const weights()
  WorkspaceCache<Scalar> workspace_cache_;  // for the calls given no Workspace

  friend struct ContextStreamingHook;
};

// A layer's streaming sizes (ContextStreaming's defaults unless set): its forward given key and
// value streams K and V beyond the budget. For tests, which lower them to stream small problems.
struct ContextStreamingHook {
  template <typename... Stages>
  static void set(AttentionCore<Stages...>& layer, const ContextStreaming& streaming) {
    layer.context_streaming_ = streaming;
  }
};

}  // namespace sdmha::detail
