// sdmha/detail/attention_core.hpp — what the sparse layer and the dense baseline share: input
// validation, the key and value projections, the per-(batch, head) score → softmax → values
// loop, and the output projection. The two layers differ only in how they get the scores.
#pragma once

#include <cmath>
#include <type_traits>
#include <utility>

#include "sdmha/config.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

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
  using ScoreKernel = ScoreKernelT;
  using Softmax = SoftmaxT;
  using AttendValues = AttendValuesT;
  using OutputProjection = OutputProjectionT;
  using ContextProjection = ContextProjectionT;

  const MhaConfig& config() const { return config_; }
  const MhaWeights<Scalar>& weights() const { return weights_; }
  const LayerDims& dims() const { return dims_; }

  // The stage objects, for stages that carry parameters of their own. Set them up before the
  // layer is shared between threads: forward only reads them.
  ScoreKernel& score_kernel() { return score_kernel_; }
  Softmax& softmax() { return softmax_; }
  AttendValues& attend_values() { return attend_values_; }
  OutputProjection& output_projection() { return output_projection_; }
  ContextProjection& context_projection() { return context_projection_; }

  // The boundary checks of forward, public so that passes built on the layer (mha_backward)
  // check the same things with the same messages.
  // The sizes of one validated call.
  struct Inputs {
    Index batch, steps, key_steps;
    int threads;
    ThreadPool* pool = nullptr;  // persistent workers (a Workspace's), or threads per call
  };

  // Checks key (B, S, Ek) and value (B, S, Ev) against the weights and the query's batch.
  void check_context(const char* where, Index batch, const TensorRef3<Scalar>& key,
                     const TensorRef3<Scalar>& value) const {
    auto check_tensor = [&](const char* name, const TensorRef3<Scalar>& tensor, Index width) {
      if (tensor.dimension(0) != batch)
        fail<ShapeError>(where, name, " has batch ", tensor.dimension(0),
                         "; expected the query's batch ", batch);
      if (tensor.dimension(2) != width)
        fail<ShapeError>(where, name, " has width ", tensor.dimension(2),
                         "; expected the kernel's input width ", width);
      if (tensor.data() == nullptr && tensor.dimension(0) * tensor.dimension(1) * width > 0)
        fail<ShapeError>(where, name, " has no data; expected ", batch, " x ",
                         tensor.dimension(1), " x ", width, " values");
    };
    check_tensor("key", key, dims_.key_in_dim);
    check_tensor("value", value, dims_.value_in_dim);
    if (key.dimension(1) != value.dimension(1))
      fail<ShapeError>(where, "key has ", key.dimension(1), " steps but value has ",
                       value.dimension(1), "; expected equal");
  }

  // Checks a ProjectedContext against the weights and the query's batch.
  void check_context(const char* where, Index batch, const ProjectedContext<Scalar>& context) const {
    if (context.batch != batch)
      fail<ShapeError>(where, "context has batch ", context.batch, "; expected the query's batch ", batch);
    if (context.key_steps < 0 || context.keys.rows() != context.batch * context.key_steps ||
        context.keys.cols() != dims_.projected_key_width())
      fail<ShapeError>(where, "context.keys is ", context.keys.rows(), " x ", context.keys.cols(),
                       "; expected batch * key_steps x num_heads * key_dim = ",
                       context.batch * context.key_steps, " x ", dims_.projected_key_width());
    if (context.values.rows() != context.keys.rows() ||
        context.values.cols() != dims_.projected_value_width())
      fail<ShapeError>(where, "context.values is ", context.values.rows(), " x ",
                       context.values.cols(), "; expected batch * key_steps x num_heads * value_dim = ",
                       context.keys.rows(), " x ", dims_.projected_value_width());
  }

  // Checks the options against (B, T, S) and resolves the thread count.
  Inputs check_options(const char* where, Index batch, Index steps, Index key_steps,
                       const AttentionOptions<Scalar>& options) const {
    const auto& mask = options.attention_mask;
    if (mask.size() != 0 || mask.dimension(0) != 0 || mask.dimension(1) != 0 || mask.dimension(2) != 0) {
      if (mask.dimension(0) != batch || mask.dimension(1) != steps || mask.dimension(2) != key_steps)
        fail<ShapeError>(where, "attention_mask is (", mask.dimension(0), ", ", mask.dimension(1),
                         ", ", mask.dimension(2), "); expected (B, T, S) = (", batch, ", ", steps,
                         ", ", key_steps, ")");
    }
    const auto& padding = options.key_padding_mask;
    if (padding.dimension(0) != 0 || padding.dimension(1) != 0) {
      if (padding.dimension(0) != batch || padding.dimension(1) != key_steps)
        fail<ShapeError>(where, "key_padding_mask is (", padding.dimension(0), ", ",
                         padding.dimension(1), "); expected (B, S) = (", batch, ", ", key_steps, ")");
    }
    if (!(options.dropout_rate >= 0.0 && options.dropout_rate < 1.0))
      fail<ConfigError>(where, "dropout_rate = ", options.dropout_rate, "; expected 0 <= dropout_rate < 1");
    if (options.num_threads < 0)
      fail<ConfigError>(where, "num_threads = ", options.num_threads,
                        "; expected >= 0 (0 means all hardware threads)");
    return Inputs{batch, steps, key_steps, resolve_thread_count(options.num_threads)};
  }

 protected:
  AttentionCore(const MhaConfig& config, MhaWeights<Scalar> weights)
      : config_(config), weights_(std::move(weights)), dims_(weights_.validate(config_)) {}

 public:
  // K and V of validated key and value, into `context` (resized; reallocated only when it grows).
  // Public, like the checks above, for passes built on the layer (mha_backward).
  void project_checked(const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value, int threads,
                       ThreadPool* pool, ProjectedContext<Scalar>& context) const {
    context.batch = value.dimension(0);
    context.key_steps = value.dimension(1);
    const Index rows = context.batch * context.key_steps;
    context.keys.resize(rows, dims_.projected_key_width());
    context.values.resize(rows, dims_.projected_value_width());
    project_rows(context_projection_, key.as_matrix(), weights_.key_kernel, weights_.key_bias,
                 context.keys, threads, pool);
    project_rows(context_projection_, value.as_matrix(), weights_.value_kernel, weights_.value_bias,
                 context.values, threads, pool);
  }

  // Projects key (B, S, Ek) and value (B, S, Ev) once, for forward calls that reuse them.
  ProjectedContext<Scalar> project_context(const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                                           int num_threads = 0) const {
    constexpr const char* where = "project_context";
    check_context(where, key.dimension(0), key, value);
    if (num_threads < 0)
      fail<ConfigError>(where, "num_threads = ", num_threads, "; expected >= 0 (0 means all hardware threads)");
    ProjectedContext<Scalar> context;
    project_checked(key, value, resolve_thread_count(num_threads), nullptr, context);
    return context;
  }

 protected:
  Scalar score_scale() const { return Scalar(1.0 / std::sqrt(double(dims_.key_dim))); }

  // The bias of a projection, or an empty vector when the layer has none.
  ConstVectorRef<Scalar> bias_or_empty(const Vector<Scalar>& bias) const {
    return bias.size() != 0 ? ConstVectorRef<Scalar>(bias) : ConstVectorRef<Scalar>(no_bias_);
  }
  ConstVectorRef<Scalar> bias_segment(const Vector<Scalar>& bias, Index start, Index size) const {
    return bias.size() != 0 ? ConstVectorRef<Scalar>(bias.segment(start, size))
                            : ConstVectorRef<Scalar>(no_bias_);
  }

  // input (rows × E) · kernel + bias → output, in fixed row blocks spread over the threads.
  template <typename Projection>
  void project_rows(const Projection& projection, const ConstMatrixRef<Scalar>& input,
                    const RowMatrix<Scalar>& kernel, const Vector<Scalar>& bias,
                    MatrixRef<Scalar> output, int threads, ThreadPool* pool = nullptr) const {
    const Index rows = input.rows();
    parallel_for(row_block_count(rows), threads, [&](Index block, int) {
      const Index first = block * kProjectionRowBlock;
      const Index count = std::min(kProjectionRowBlock, rows - first);
      typename Projection::Arguments args{input.middleRows(first, count), kernel,
                                          bias_or_empty(bias), output.middleRows(first, count)};
      Projection::can_implement(args);
      projection(args);
    }, pool);
  }

  // The shared body of forward. `compute_scores(b, h, first_step, key_block, mask, scores)` fills
  // the masked scores of rows first_step … first_step + rows − 1 of one (batch, head) against
  // the key steps 0 … key_block.rows() − 1; everything before and after it is common.
  // Work items are (b, h, query tile) with tiles of `query_tile` steps; for a causal mask the
  // key steps that no row of the tile may see are skipped, neither computed nor stored. Scratch
  // comes from `buffers`, the output goes to `result` (both resized only when shapes change).
  template <typename ComputeScores>
  void attend(const Inputs& inputs, const ProjectedContext<Scalar>& context,
              const AttentionOptions<Scalar>& options, Index query_tile, ComputeScores&& compute_scores,
              CallBuffers<Scalar>& buffers, AttentionResult<Scalar>& result) const {
    const Index B = inputs.batch, T = inputs.steps, S = inputs.key_steps;
    const Index H = dims_.num_heads, Dk = dims_.key_dim, Dv = dims_.value_dim;
    const int threads = inputs.threads;
    ThreadPool* const pool = inputs.pool;
    const RowMatrix<Scalar>& keys = context.keys;
    const RowMatrix<Scalar>& values = context.values;

    const bool return_scores = options.return_attention_scores;
    if (return_scores)
      result.attention_scores.resize(B, H, T, S);
    else if (result.attention_scores.size() != 0)
      result.attention_scores = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>();
    const DropoutMask dropout = options.training ? DropoutMask(options.dropout_rate, options.dropout_seed)
                                                 : DropoutMask();
    RowMatrix<Scalar>& heads = buffers.heads;
    heads.resize(B * T, H * Dv);
    // Whether V_bh is finite, found once per (b, h) for all of its query tiles.
    std::vector<char>& value_is_finite = buffers.value_is_finite;
    value_is_finite.assign(static_cast<std::size_t>(B * H), 0);
    if (S > 0)
      parallel_for(B * H, threads, [&](Index item, int) {
        value_is_finite[std::size_t(item)] =
            all_finite<Scalar>(values.block((item / H) * S, (item % H) * Dv, S, Dv));
      }, pool);
    const Index tiles = query_tile > 0 ? (T + query_tile - 1) / query_tile : 0;
    // Per worker: the scores of the tile in flight, and the probabilities after dropout when the
    // scores before it must be returned.
    const int workers = worker_count(B * H * tiles, threads);
    auto& scratch = buffers.tile_scores;
    auto& dropped = buffers.tile_dropped;
    CallBuffers<Scalar>::ensure_workers(scratch, workers);
    if (dropout.active() && return_scores) CallBuffers<Scalar>::ensure_workers(dropped, workers);
    parallel_for(B * H * tiles, threads, [&](Index item, int worker) {
      const Index b = item / (H * tiles), h = (item / tiles) % H, tile = item % tiles;
      const Index first_step = tile * query_tile, rows = std::min(query_tile, T - first_step);
      const Index key_end = options.use_causal_mask ? std::min(S, first_step + rows) : S;

      if (key_end == 0) {
        // No key steps at all: every row is fully blocked, so its probabilities and head are 0
        // (and K, V are empty, with no memory to take blocks of).
        heads.block(b * T + first_step, h * Dv, rows, Dv).setZero();
        return;
      }
      using ScoresMap = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
      Scalar* scores_data;
      Index scores_stride;
      if (return_scores) {
        scores_data = result.attention_scores.data() + ((b * H + h) * T + first_step) * S;
        scores_stride = S;
        if (key_end < S)
          ScoresMap(scores_data + key_end, rows, S - key_end, Eigen::OuterStride<>(S)).setZero();
      } else {
        RowMatrix<Scalar>& buffer = scratch[std::size_t(worker)];
        // Sized once for a whole tile against every key, so that the causal tiles (fewer keys)
        // and the last tile (fewer rows) do not reallocate it.
        if (buffer.size() < rows * key_end) buffer.resize(std::min(query_tile, T), S);
        scores_data = buffer.data();
        scores_stride = key_end;
      }
      ScoresMap scores(scores_data, rows, key_end, Eigen::OuterStride<>(scores_stride));

      BatchMask mask;
      mask.steps = rows;
      mask.key_steps = key_end;
      mask.first_step = first_step;
      mask.causal = options.use_causal_mask;
      if (options.attention_mask.size() != 0) {
        mask.attention = options.attention_mask.data() + (b * T + first_step) * S;
        mask.attention_stride = S;
      }
      if (options.key_padding_mask.size() != 0) mask.key_padding = options.key_padding_mask.data() + b * S;

      compute_scores(b, h, first_step, ConstMatrixRef<Scalar>(keys.block(b * S, h * Dk, key_end, Dk)),
                     mask, MatrixRef<Scalar>(scores));
      typename Softmax::Arguments softmax_args{scores};
      Softmax::can_implement(softmax_args);
      softmax_(softmax_args);

      // Dropout acts on the probabilities that meet the values; returned scores stay before it.
      Scalar* probabilities_data = scores_data;
      Index probabilities_stride = scores_stride;
      if (dropout.active() && return_scores) {
        RowMatrix<Scalar>& copy = dropped[std::size_t(worker)];
        if (copy.size() < rows * key_end) copy.resize(std::min(query_tile, T), S);
        Eigen::Map<RowMatrix<Scalar>>(copy.data(), rows, key_end) = scores;
        probabilities_data = copy.data();
        probabilities_stride = key_end;
      }
      ScoresMap probabilities(probabilities_data, rows, key_end, Eigen::OuterStride<>(probabilities_stride));
      dropout.apply(probabilities, b, h, first_step, 0);
      typename AttendValues::Arguments values_args{probabilities, values.block(b * S, h * Dv, key_end, Dv),
                                                   heads.block(b * T + first_step, h * Dv, rows, Dv),
                                                   value_is_finite[std::size_t(b * H + h)] != 0};
      AttendValues::can_implement(values_args);
      attend_values_(values_args);
    }, pool);

    result.output.resize(B, T, dims_.output_dim);
    project_rows(output_projection_, heads, weights_.output_kernel, weights_.output_bias,
                 Eigen::Map<RowMatrix<Scalar>>(result.output.data(), B * T, dims_.output_dim),
                 threads, pool);
  }

  MhaConfig config_;
  MhaWeights<Scalar> weights_;
  LayerDims dims_;
  Vector<Scalar> no_bias_;
  ScoreKernel score_kernel_;
  Softmax softmax_;
  AttendValues attend_values_;
  OutputProjection output_projection_;
  ContextProjection context_projection_;
};

}  // namespace sdmha::detail
