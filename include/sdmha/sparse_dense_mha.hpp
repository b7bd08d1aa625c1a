// sdmha/sparse_dense_mha.hpp — SparseDenseMHA: multi-head attention with a sparse query.
//
// The layer composes its stages, each a template parameter with a default:
//
//   X (CSR) ──QueryProjection──▶ Q ─┐                           (project_first)
//   X (CSR) ────────────────────────┼─ScoreKernel─▶ S ─Softmax─▶ P ─AttendValues─▶ A ─OutputProjection─▶ Y
//   key  ──ContextProjection──▶ K ──┘                    value ──ContextProjection──▶ V ─┘
//
// With ScoreStrategy::sparse_regrouped the score kernel reads X's CSR rows directly and Q is
// never formed. The math is Keras 3's MultiHeadAttention (see README: Keras/PyTorch correspondence).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "sdmha/backward.hpp"
#include "sdmha/detail/attention_core.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/dense_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/query_projection.hpp"
#include "sdmha/stages/score_kernel.hpp"

namespace sdmha {

namespace detail {

// Scratch-size hints that the default stages' Arguments declare (see their headers); a custom
// stage whose Arguments lack them still composes, and just does not get the hint.
template <typename Arguments>
auto hint_nonzero_capacity(Arguments& args, Index value, int) -> decltype(void(args.nonzero_capacity = value)) {
  args.nonzero_capacity = value;
}
template <typename Arguments>
void hint_nonzero_capacity(Arguments&, Index, long) {}
template <typename Arguments>
auto hint_feature_capacity(Arguments& args, Index value, int) -> decltype(void(args.feature_capacity = value)) {
  args.feature_capacity = value;
}
template <typename Arguments>
void hint_feature_capacity(Arguments&, Index, long) {}

}  // namespace detail

template <typename Scalar,
          typename QueryProjectionT = SparseQueryProjection<Scalar>,
          typename ScoreKernelT = ScoreKernel<Scalar>,
          typename SoftmaxT = MaskedSoftmax<Scalar>,
          typename AttendValuesT = AttendValues<Scalar>,
          typename OutputProjectionT = OutputProjection<Scalar>,
          typename ContextProjectionT = DenseProjection<Scalar>>
class SparseDenseMHA
    : public detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                   OutputProjectionT, ContextProjectionT> {
  using Core = detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                     OutputProjectionT, ContextProjectionT>;
  static_assert(std::is_floating_point<Scalar>::value, "SparseDenseMHA: Scalar must be float or double");
  static_assert(std::is_same<typename QueryProjectionT::ScalarType, Scalar>::value,
                "the query projection's ScalarType must be the layer's Scalar");
  static_assert(std::is_same<typename QueryProjectionT::StorageIndexType,
                             typename ScoreKernelT::StorageIndexType>::value,
                "the query projection and the score kernel must read the same CSR StorageIndex");

 public:
  using ScalarType = Scalar;
  using QueryProjection = QueryProjectionT;
  using StorageIndex = typename QueryProjectionT::StorageIndexType;
  using Query = SparseQuery<Scalar, StorageIndex>;

  // Validates the configuration and the weights' shapes (ConfigError, ShapeError).
  SparseDenseMHA(const MhaConfig& config, MhaWeights<Scalar> weights)
      : Core(config, std::move(weights)) {}

  QueryProjection& query_projection() { return query_projection_; }

  // query (B, T, Eq) sparse; key (B, S, Ek); value (B, S, Ev) → output (B, T, O). Thread-safe.
  AttentionResult<Scalar> forward(const Query& query, const TensorRef3<Scalar>& key,
                                  const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    Workspace<Scalar> workspace;
    AttentionResult<Scalar> result;
    forward(query, key, value, options, workspace, result);
    return result;
  }

  // The same into `result`, working in `workspace` (sdmha/workspace.hpp): called again with the
  // same shapes, it allocates nothing and starts no threads. Thread-safe for distinct workspaces.
  void forward(const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
               const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
               AttentionResult<Scalar>& result) const {
    constexpr const char* where = "SparseDenseMHA::forward";
    check_query(where, query);
    this->check_context(where, query.batch(), key, value);
    auto inputs = this->check_options(where, query.batch(), query.steps(), value.dimension(1), options);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    inputs.pool = &buffers.pool;
    this->project_checked(key, value, inputs.threads, inputs.pool, buffers.context);
    run(query, buffers.context, inputs, options, buffers, result);
  }

  // The same against keys and values projected once by project_context(key, value).
  AttentionResult<Scalar> forward(const Query& query, const ProjectedContext<Scalar>& context,
                                  const AttentionOptions<Scalar>& options = {}) const {
    Workspace<Scalar> workspace;
    AttentionResult<Scalar> result;
    forward(query, context, options, workspace, result);
    return result;
  }

  void forward(const Query& query, const ProjectedContext<Scalar>& context,
               const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
               AttentionResult<Scalar>& result) const {
    constexpr const char* where = "SparseDenseMHA::forward";
    check_query(where, query);
    this->check_context(where, query.batch(), context);
    auto inputs = this->check_options(where, query.batch(), query.steps(), context.key_steps, options);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    inputs.pool = &buffers.pool;
    run(query, context, inputs, options, buffers, result);
  }

  // The score strategy that `requested` resolves to for this query and S key steps. The cost
  // model counts, per call, project-first's 2·nnz·H·Dk sparse flops plus 2·B·H·T·S·Dk GEMM flops
  // (about half under a causal mask, whose blocked key tiles are skipped) against regrouped's
  // 2·H·Dk·S·Σ_b U_b GEMM flops plus 2·nnz·H·S sparse flops, U_b being the distinct features of
  // batch b. A sparse flop is weighted as kSparseFlopCost GEMM flops: it streams a row of a
  // dense operand per stored value instead of reusing registers and cache as a GEMM does.
  ScoreStrategy resolve_strategy(ScoreStrategy requested, const Query& query, Index key_steps,
                                 bool causal) const {
    std::vector<Index> scratch;
    return resolve_strategy(requested, query, key_steps, causal, scratch);
  }
  // The same with the cost model's scratch (Eq entries) supplied.
  ScoreStrategy resolve_strategy(ScoreStrategy requested, const Query& query, Index key_steps,
                                 bool causal, std::vector<Index>& scratch) const {
    if (requested != ScoreStrategy::automatic) return requested;
    return choose_strategy(requested, query, key_steps, causal, scratch).strategy;
  }

  // Gradients of a loss through forward(query, key, value, options), given d_output =
  // ∂loss/∂output (B, T, O): every weight, the query's stored values, key and value. See
  // mha_backward in sdmha/backward.hpp (recomputes the forward; same masks, dropout, threads).
  MhaGradients<Scalar> backward(const Query& query, const TensorRef3<Scalar>& key,
                                const TensorRef3<Scalar>& value, const TensorRef3<Scalar>& d_output,
                                const AttentionOptions<Scalar>& options = {}) const {
    return mha_backward(*this, query, key, value, d_output, options);
  }
  // The same, reusing the keys and values of project_context(key, value).
  MhaGradients<Scalar> backward(const Query& query, const TensorRef3<Scalar>& key,
                                const TensorRef3<Scalar>& value, const ProjectedContext<Scalar>& context,
                                const TensorRef3<Scalar>& d_output,
                                const AttentionOptions<Scalar>& options = {}) const {
    return mha_backward(*this, query, key, value, context, d_output, options);
  }
  // Both forms into `gradients`, working in `workspace`: a training loop that keeps them
  // allocates nothing and starts no threads after its first step.
  void backward(const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options,
                Workspace<Scalar>& workspace, MhaGradients<Scalar>& gradients) const {
    mha_backward(*this, query, key, value, d_output, options, workspace, gradients);
  }
  void backward(const Query& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                const ProjectedContext<Scalar>& context, const TensorRef3<Scalar>& d_output,
                const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
                MhaGradients<Scalar>& gradients) const {
    mha_backward(*this, query, key, value, context, d_output, options, workspace, gradients);
  }

  void check_query(const char* where, const Query& query) const {
    if (query.features() != this->dims_.query_dim)
      detail::fail<ShapeError>(where, "query has ", query.features(),
                               " features; expected the query kernel's input width ", this->dims_.query_dim);
  }

  // Q = X·Wq + bq for a validated query, in fixed blocks of rows spread over `threads`.
  RowMatrix<Scalar> project_query(const Query& query, int threads) const {
    RowMatrix<Scalar> projected_query;
    project_query(query, threads, nullptr, projected_query);
    return projected_query;
  }
  // The same into `projected_query` (resized), on `pool`'s threads when one is given.
  void project_query(const Query& query, int threads, detail::ThreadPool* pool,
                     RowMatrix<Scalar>& projected_query) const {
    projected_query.resize(query.rows(), this->dims_.projected_key_width());
    const auto& csr = query.csr();
    const auto& weights = this->weights_;
    constexpr Index block_rows = detail::kQueryProjectionRowBlock;
    const Index blocks = (query.rows() + block_rows - 1) / block_rows;
    Index largest_block = 0;  // stored values of the fullest block: the kernel's scratch bound
    for (Index block = 0; block < blocks; ++block)
      largest_block = std::max(largest_block, csr.middle_rows(block * block_rows,
                                                              std::min(block_rows, query.rows() - block * block_rows))
                                                  .nonzeros());
    detail::parallel_for(blocks, threads, [&](Index block, int) {
      const Index first = block * block_rows;
      const Index count = std::min(block_rows, query.rows() - first);
      typename QueryProjection::Arguments args{csr.middle_rows(first, count), weights.query_kernel,
                                               this->bias_or_empty(weights.query_bias),
                                               projected_query.middleRows(first, count)};
      detail::hint_nonzero_capacity(args, largest_block, 0);
      QueryProjection::can_implement(args);
      query_projection_(args);
    }, pool);
  }

  // Self-attention form of Keras' call(query, value): the key is the value.
  AttentionResult<Scalar> forward(const Query& query, const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    return forward(query, value, value, options);
  }

  // U_b, the number of distinct features that batch entry b's rows use: their sum Σ_b U_b and
  // their maximum. O(nnz + Eq).
  struct FeatureCounts {
    Index total = 0, largest = 0;
  };

  // What resolve_strategy chooses, with the feature counts behind it when the choice needed them
  // (automatic or regrouped), so that the regrouped kernel's scratch hint (the forward's and the
  // backward's) does not count again.
  struct StrategyChoice {
    ScoreStrategy strategy;
    FeatureCounts features;
  };
  StrategyChoice choose_strategy(ScoreStrategy requested, const Query& query, Index key_steps,
                                 bool causal, std::vector<Index>& scratch) const {
    if (requested == ScoreStrategy::project_first) return {requested, {}};
    const FeatureCounts features = distinct_features_per_batch(query, scratch);
    if (requested == ScoreStrategy::sparse_regrouped) return {requested, features};
    constexpr double kSparseFlopCost = 4.0;
    const double H = double(this->dims_.num_heads), Dk = double(this->dims_.key_dim);
    const double S = double(key_steps), nnz = double(query.nonzeros());
    const double B = double(query.batch()), T = double(query.steps());
    const double project_first = kSparseFlopCost * 2 * nnz * H * Dk + (causal ? 0.5 : 1.0) * 2 * B * H * T * S * Dk;
    const double regrouped = 2 * H * Dk * S * double(features.total) + kSparseFlopCost * 2 * nnz * H * S;
    return {regrouped < project_first ? ScoreStrategy::sparse_regrouped : ScoreStrategy::project_first,
            features};
  }

 private:
  static FeatureCounts distinct_features_per_batch(const Query& query, std::vector<Index>& last_batch) {
    last_batch.assign(static_cast<std::size_t>(query.features()), -1);
    const auto& csr = query.csr();
    FeatureCounts counts;
    for (Index b = 0; b < query.batch(); ++b) {
      Index in_batch = 0;
      for (Index row = b * query.steps(); row < (b + 1) * query.steps(); ++row)
        for (Index k = csr.row_begin(row); k < csr.row_end(row); ++k) {
          Index& seen = last_batch[std::size_t(csr.column_indices[k])];
          if (seen != b) {
            seen = b;
            ++in_batch;
          }
        }
      counts.total += in_batch;
      counts.largest = std::max(counts.largest, in_batch);
    }
    return counts;
  }

  void run(const Query& query, const ProjectedContext<Scalar>& context, const typename Core::Inputs& inputs,
           const AttentionOptions<Scalar>& options, detail::CallBuffers<Scalar>& buffers,
           AttentionResult<Scalar>& result) const {
    const LayerDims& dims = this->dims_;
    const Index T = inputs.steps, Dk = dims.key_dim;
    const Scalar scale = this->score_scale();
    const auto& weights = this->weights_;
    const StrategyChoice choice = choose_strategy(options.score_strategy, query, inputs.key_steps,
                                                  options.use_causal_mask, buffers.feature_batch);

    if (choice.strategy == ScoreStrategy::sparse_regrouped) {
      // The regrouped form works on a batch entry's rows at once: M_bh is shared by all of them.
      const Index feature_capacity = choice.features.largest;
      this->attend(inputs, context, options, T,
                          [&](Index b, Index h, Index, const ConstMatrixRef<Scalar>& key_bh,
                              const BatchMask& mask, MatrixRef<Scalar> scores) {
        typename ScoreKernelT::SparseArguments args{
            query.batch_rows(b), weights.query_kernel.middleCols(h * Dk, Dk),
            this->bias_segment(weights.query_bias, h * Dk, Dk), key_bh, scale, mask, scores};
        detail::hint_feature_capacity(args, feature_capacity, 0);
        ScoreKernelT::can_implement(args);
        this->score_kernel_(args);
      }, buffers, result);
      return;
    }

    project_query(query, inputs.threads, inputs.pool, buffers.projected_query);
    const RowMatrix<Scalar>& projected_query = buffers.projected_query;
    this->attend(inputs, context, options, detail::kQueryTile,
                        [&](Index b, Index h, Index first_step, const ConstMatrixRef<Scalar>& key_bh,
                            const BatchMask& mask, MatrixRef<Scalar> scores) {
      typename ScoreKernelT::Arguments args{
          projected_query.block(b * T + first_step, h * Dk, scores.rows(), Dk), key_bh, scale, mask, scores};
      ScoreKernelT::can_implement(args);
      this->score_kernel_(args);
    }, buffers, result);
  }

  QueryProjection query_projection_;
};

}  // namespace sdmha
