// sdmha/dense_mha.hpp — DenseMHA: the dense baseline, the same layer on a dense query.
//
// Same weights, options and stages as SparseDenseMHA (score kernel in its project-first form);
// the query (B, T, Eq) is projected by a dense GEMM. It is what a user would run after
// densifying a sparse query, and what the bench compares against.
#pragma once

#include "sdmha/detail/attention_core.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/dense_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/score_kernel.hpp"

namespace sdmha {

template <typename Scalar,
          typename QueryProjectionT = DenseProjection<Scalar>,
          typename ScoreKernelT = ScoreKernel<Scalar>,
          typename SoftmaxT = MaskedSoftmax<Scalar>,
          typename AttendValuesT = AttendValues<Scalar>,
          typename OutputProjectionT = OutputProjection<Scalar>,
          typename ContextProjectionT = DenseProjection<Scalar>>
class DenseMHA : public detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                              OutputProjectionT, ContextProjectionT> {
  using Core = detail::AttentionCore<Scalar, ScoreKernelT, SoftmaxT, AttendValuesT,
                                     OutputProjectionT, ContextProjectionT>;
  static_assert(std::is_same<typename QueryProjectionT::ScalarType, Scalar>::value,
                "the query projection's ScalarType must be the layer's Scalar");

 public:
  using ScalarType = Scalar;
  using QueryProjection = QueryProjectionT;

  DenseMHA(const MhaConfig& config, MhaWeights<Scalar> weights) : Core(config, std::move(weights)) {}

  QueryProjection& query_projection() { return query_projection_; }

  // query (B, T, Eq) dense; key (B, S, Ek); value (B, S, Ev) → output (B, T, O). Thread-safe.
  // options.score_strategy is ignored: a dense query has only the project-first form.
  AttentionResult<Scalar> forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& key,
                                  const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    Workspace<Scalar> workspace;
    AttentionResult<Scalar> result;
    forward(query, key, value, options, workspace, result);
    return result;
  }

  // The same into `result`, working in `workspace` (see SparseDenseMHA).
  void forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
               const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
               AttentionResult<Scalar>& result) const {
    constexpr const char* where = "DenseMHA::forward";
    const LayerDims& dims = this->dims_;
    if (query.dimension(2) != dims.query_dim)
      detail::fail<ShapeError>(where, "query has width ", query.dimension(2),
                               "; expected the query kernel's input width ", dims.query_dim);
    const Index B = query.dimension(0), T = query.dimension(1), Dk = dims.key_dim;
    if (query.data() == nullptr && B * T * dims.query_dim > 0)
      detail::fail<ShapeError>(where, "query has no data; expected ", B, " x ", T, " x ",
                               dims.query_dim, " values");
    this->check_context(where, B, key, value);
    auto inputs = this->check_options(where, B, T, value.dimension(1), options);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    inputs.pool = &buffers.pool;
    const auto& context = buffers.context;
    this->project_checked(key, value, inputs.threads, inputs.pool, buffers.context);
    RowMatrix<Scalar>& projected_query = buffers.projected_query;
    projected_query.resize(B * T, dims.projected_key_width());
    this->project_rows(query_projection_, query.as_matrix(), this->weights_.query_kernel,
                       this->weights_.query_bias, projected_query, inputs.threads, inputs.pool);
    const Scalar scale = this->score_scale();
    this->attend(inputs, context, options, detail::kQueryTile,
                        [&](Index b, Index h, Index first_step, const ConstMatrixRef<Scalar>& key_bh,
                            const BatchMask& mask, MatrixRef<Scalar> scores) {
      typename ScoreKernelT::Arguments args{
          projected_query.block(b * T + first_step, h * Dk, scores.rows(), Dk), key_bh, scale, mask, scores};
      ScoreKernelT::can_implement(args);
      this->score_kernel_(args);
    }, buffers, result);
  }

  AttentionResult<Scalar> forward(const TensorRef3<Scalar>& query, const TensorRef3<Scalar>& value,
                                  const AttentionOptions<Scalar>& options = {}) const {
    return forward(query, value, value, options);
  }

 private:
  QueryProjection query_projection_;
};

}  // namespace sdmha
