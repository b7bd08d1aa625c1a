// sdmha/detail/backward_pass.hpp — SparseDenseMHA::backward: every gradient of the forward, as the
// forward's stages in reverse, each through its own backward (stages/*.hpp, beside its forward).
//
// With scale = 1/√Dk, P = softmax(S) and P' = P after dropout, the forward is
//   Q = X·Wq + bq,  K = key·Wk + bk,  V = value·Wv + bv,
//   S_bh = scale·Q_bh·K_bhᵀ + bias_bh (blocked → −∞),  A_bh = P'_bh·V_bh,  Y = A·Wo + bo,
// and from dY the backward walks the plan:
//   1. OutputProjection:  dA = dY·Woᵀ                                       (row blocks)
//   2. per (b, h), tile by tile, recomputing the forward's scores, P and P' (nothing is saved):
//      AttendValues:      dP' = dA_bh·V_bhᵀ, dV_bh += P'ᵀ·dA_bh
//      dropout:           dP = dP' ⊙ keep/(1 − rate)
//      MaskedSoftmax:     dS = P ⊙ (dP − rowsum(P ⊙ dP));  dbias += dS (when asked)
//      ScoreKernel:       dQ_bh = scale·dS·K_bh, dK_bh += scale·dSᵀ·Q_bh
//   3. OutputProjection:  dWo = Aᵀ·dY, dbo = 1ᵀ·dY                          (weight tiles)
//   4. QueryProjection:   dWq = Xᵀ·dQ, dbq = 1ᵀ·dQ, dX = dQ·Wqᵀ at X's stored positions
//   5. ContextProjection: dWk = keyᵀ·dK, dbk, dkey = dK·Wkᵀ; likewise V.
// One (b, h, group of query tiles) item owns its rows of A and dQ and adds its terms of dK_bh,
// dV_bh in group order (a broadcast bias's gradient: one task per fixed group of (b, h), tiles in
// order);
// weight and bias gradients go in fixed tiles and panels: no sum depends on the thread count.
//
// The attention's part (2, with the bias gradient) is detail/backward_attention.hpp's, the
// projections' (1, 3 to 5) detail/backward_projections.hpp's; here the checks and their order.
#pragma once

#include "sdmha/config.hpp"
#include "sdmha/detail/attention_plan.hpp"
#include "sdmha/detail/backward_attention.hpp"
#include "sdmha/detail/backward_projections.hpp"
#include "sdmha/detail/validation.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/sparse_dense_mha.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

template <typename Layer>
struct Backward {
  using Scalar = typename Layer::ScalarType;
  using Query = typename Layer::Query;
  using Buffers = CallBuffers<Scalar>;
  using Attention = BackwardAttention<Layer>;
  using Projections = BackwardProjections<Layer>;

  static void check_stages() {
    static_assert(IsDifferentiable<typename Layer::QueryProjection>::value,
                  "backward: the query projection stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(...) beside its operator())");
    static_assert(IsDifferentiable<typename Layer::ScoreKernel>::value,
                  "backward: the score kernel stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(IsDifferentiable<typename Layer::Softmax>::value,
                  "backward: the softmax stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(IsDifferentiable<typename Layer::AttendValues>::value,
                  "backward: the attend-values stage has no backward of its own (declare "
                  "`using differentiates = YourStage;` and backward(const BackwardArguments&))");
    static_assert(
        IsDifferentiable<typename Layer::OutputProjection>::value,
        "backward: the output projection stage has no backward of its own (declare "
        "`using differentiates = YourStage;` and backward(...) for both gradient Arguments)");
    static_assert(
        IsDifferentiable<typename Layer::ContextProjection>::value,
        "backward: the context projection stage has no backward of its own (declare "
        "`using differentiates = YourStage;` and backward(...) for both gradient Arguments)");
  }

  // Everything the backward checks before any work: the forward's checks with the same
  // messages (the context must hold the key and value), then d_output against (B, T, O), and
  // the plan.
  static AttentionPlan check_and_plan(const char* where, const Layer& layer, const Query& query,
                                      const Context<Scalar>& context,
                                      const TensorRef3<Scalar>& d_output,
                                      const AttentionOptions<Scalar>& options, Buffers& buffers) {
    const LayerDims dims = layer.checked_query(where, query);
    check_context<Scalar>(where, dims, query.batch(), context, true);
    const Index B = query.batch(), T = query.steps(), O = dims.output_dim;
    if (d_output.dimension(0) != B || d_output.dimension(1) != T || d_output.dimension(2) != O)
      fail<ShapeError>(where, "d_output is (", d_output.dimension(0), ", ", d_output.dimension(1),
                       ", ", d_output.dimension(2), "); expected (B, T, O) = (", B, ", ", T, ", ",
                       O, ")");
    if (d_output.data() == nullptr && B * T * O > 0)
      fail<ShapeError>(where, "d_output has no data; expected ", B, " x ", T, " x ", O, " values");
    return layer.plan_call(where, dims, query, context.key_steps(), options, Pass::backward,
                           buffers);
  }

  // One backward call: checks, plan, then the passes, in `workspace`, K and V the context's
  // projected ones or, with none, projected now.
  static void call(const Layer& layer, const Query& query, const Context<Scalar>& context,
                   const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options,
                   Workspace<Scalar>& workspace, MhaGradients<Scalar>& gradients) {
    check_stages();
    constexpr const char* where = "SparseDenseMHA::backward";
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    const auto plan = check_and_plan(where, layer, query, context, d_output, options, buffers);
    const ProjectedContext<Scalar>* saved = context.projected();
    if (saved == nullptr)
      layer.project_context_into(plan, context.key(), context.value(), buffers, buffers.context);
    run(layer, plan, query, context.key(), context.value(),
        saved != nullptr ? *saved : buffers.context, d_output, options, buffers, gradients);
  }

  // The backward on a validated call, K and V being `context`'s.
  static void run(const Layer& layer, const AttentionPlan& plan, const Query& query,
                  const TensorRef3<Scalar>& key, const TensorRef3<Scalar>& value,
                  const ProjectedContext<Scalar>& context, const TensorRef3<Scalar>& d_output,
                  const AttentionOptions<Scalar>& options, Buffers& buffers,
                  MhaGradients<Scalar>& gradients) {
    const MhaWeights<Scalar>& weights = layer.weights();
    const bool use_bias = layer.config().use_bias;
    const auto d_output_matrix = d_output.as_matrix();
    BackwardBuffers<Scalar>& scratch = buffers.backward;
    layer.project_query(plan, query, buffers,
                        buffers.projected_query);  // dK needs Q whatever the strategy
    scratch.d_heads.resize(plan.batch * plan.steps, plan.dims.projected_value_width());
    Projections::input_gradient(plan, layer.stages().output_projection, d_output_matrix,
                                weights.output_kernel, scratch.d_heads, buffers);
    // A tile's masked scores by the plan's strategy, through the layer's private tile_scores;
    // the backward differentiates float32 (no bfloat16 operands).
    const auto tile_scores = [&](const AttentionTile& tile, const BatchMask& mask,
                                 const ConstMatrixRef<Scalar>& keys, StageScratch stage,
                                 MatrixRef<Scalar> out) {
      layer.tile_scores(plan, tile, query, buffers.projected_query, mask, keys, false, stage, out);
    };
    Attention::attention(layer, plan, tile_scores, context, options, buffers, gradients);
    Projections::kernel_gradient(plan, layer.stages().output_projection, buffers.heads,
                                 d_output_matrix, buffers, gradients.output_kernel);
    Projections::bias_gradient(plan, use_bias, d_output_matrix, gradients.output_bias, buffers);
    const auto& wanted = options.input_gradients;
    Projections::query_gradients(layer, plan, query, wanted.query_values, buffers, gradients);
    Projections::bias_gradient(plan, use_bias, scratch.d_queries, gradients.query_bias, buffers);
    Projections::context_gradients(plan, layer.stages().context_projection, key.as_matrix(),
                                   weights.key_kernel, scratch.d_keys, use_bias, wanted.key,
                                   buffers, gradients.key_kernel, gradients.key_bias,
                                   gradients.key);
    Projections::context_gradients(plan, layer.stages().context_projection, value.as_matrix(),
                                   weights.value_kernel, scratch.d_values, use_bias, wanted.value,
                                   buffers, gradients.value_kernel, gradients.value_bias,
                                   gradients.value);
  }
};

}  // namespace sdmha::detail

namespace sdmha {

// The layer's backward entry points, declared in sparse_dense_mha.hpp.
template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
void SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const Context<Scalar>& context, const TensorRef3<Scalar>& d_output,
    const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
    MhaGradients<Scalar>& gradients) const {
  detail::Backward<SparseDenseMHA>::call(*this, query, context, d_output, options, workspace,
                                         gradients);
}

template <typename Scalar, typename QP, typename SK, typename SM, typename AV, typename OP,
          typename CP>
MhaGradients<Scalar> SparseDenseMHA<Scalar, QP, SK, SM, AV, OP, CP>::backward(
    const Query& query, const Context<Scalar>& context, const TensorRef3<Scalar>& d_output,
    const AttentionOptions<Scalar>& options) const {
  const auto borrowed = this->borrow_workspace();
  MhaGradients<Scalar> gradients;
  backward(query, context, d_output, options, borrowed.workspace(), gradients);
  return gradients;
}

}  // namespace sdmha
