// sdmha/sparse_dense_mha.hpp — SparseDenseMHA: multi-head attention with a sparse query.
//
// The layer composes its stages, each a template parameter with a default:
//
// clang-format off
//   X (CSR) ─QueryProjection─▶ Q ─┐      (sparse_regrouped: X itself, Q never formed)
//   key ───ContextProjection─▶ K ─┴─ScoreKernel─▶ S ─Softmax─▶ P ─┐
//   value ─ContextProjection─▶ V ─────────────────────────────────┴─AttendValues─▶ A
//   A ─OutputProjection─▶ Y
// clang-format on
//
// With ScoreStrategy::sparse_regrouped the score kernel reads X's CSR rows directly. A call
// validates its inputs, plans its work (detail::AttentionPlan), then walks the plan: forward below
// (the query's items in detail/sparse_query_source.hpp), backward in
// sdmha/detail/backward_pass.hpp, stage by stage in reverse. The math is Keras 3's
// MultiHeadAttention (docs/keras_pytorch.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include "sdmha/attention_result.hpp"
#include "sdmha/context.hpp"
#include "sdmha/detail/attention_core.hpp"
#include "sdmha/gradients.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/context_projection.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/stages/output_projection.hpp"
#include "sdmha/stages/query_projection.hpp"
#include "sdmha/stages/score_kernel.hpp"

namespace sdmha {

namespace detail {
template <typename Layer>
struct Backward;
}  // namespace detail

template <typename Scalar, typename QueryProjectionT = SparseQueryProjection<Scalar>,
          typename ScoreKernelT = ScoreKernel<Scalar>, typename SoftmaxT = MaskedSoftmax<Scalar>,
          typename AttendValuesT = AttendValues<Scalar>,
          typename OutputProjectionT = OutputProjection<Scalar>,
          typename ContextProjectionT = ContextProjection<Scalar>>
class SparseDenseMHA
    : private detail::AttentionCore<Scalar, QueryProjectionT, ScoreKernelT, SoftmaxT, AttendValuesT,
                                    OutputProjectionT, ContextProjectionT> {
  using Core = detail::AttentionCore<Scalar, QueryProjectionT, ScoreKernelT, SoftmaxT,
                                     AttendValuesT, OutputProjectionT, ContextProjectionT>;
  static_assert(std::is_floating_point<Scalar>::value,
                "SparseDenseMHA: Scalar must be float or double");
  static_assert(std::is_same<typename QueryProjectionT::StorageIndexType,
                             typename ScoreKernelT::StorageIndexType>::value,
                "the query projection and the score kernel must read the same CSR StorageIndex");
  template <typename Layer>
  friend struct detail::Backward;
  template <typename Tag>
  friend struct detail::InternalAccess;
  struct QuerySource;

 public:
  // The layer's state, as the private base holds it (detail/attention_core.hpp): configuration,
  // weights, the stages (one accessor, sdmha/stage.hpp's LayerStages), project_context and the
  // workspace kept for calls given none.
  using Core::config;
  using Core::dims;
  using Core::project_context;
  using Core::release_workspace_cache;
  using Core::shared_weights;
  using Core::stages;
  using Core::weights;
  using Core::workspace_cache_bytes;
  using typename Core::AttendValues;
  using typename Core::ContextProjection;
  using typename Core::OutputProjection;
  using typename Core::QueryProjection;
  using typename Core::ScalarType;
  using typename Core::ScoreKernel;
  using typename Core::Softmax;
  using typename Core::Stages;
  using StorageIndex = typename QueryProjectionT::StorageIndexType;
  using Query = SparseQuery<Scalar, StorageIndex>;

  // Takes the weights over (move them in: no copy). Validates the configuration and the
  // weights' shapes (ConfigError, ShapeError).
  SparseDenseMHA(const MhaConfig& layer_config, MhaWeights<Scalar> layer_weights)
      : Core(layer_config, std::make_shared<MhaWeights<Scalar>>(std::move(layer_weights))) {}
  // Shares weights that the caller keeps: a training step updates them in place and calls again.
  SparseDenseMHA(const MhaConfig& layer_config, std::shared_ptr<MhaWeights<Scalar>> layer_weights)
      : Core(layer_config, std::move(layer_weights)) {}

  // The precision of the kernels (sdmha/options.hpp, Precision); float layers only for the
  // bfloat16 modes, checked here (ConfigError) before any copy is made or dropped, so nothing is
  // ever half set.
  //  bfloat16_query_kernel  Wq is rounded to the nearest bfloat16 now, and every forward is the
  //      layer whose Wq is that rounding (products and sums in float32), for half of Wq's memory
  //      traffic.
  //  bfloat16  Wq as above; and where bfloat16 products beat the float32 engine on this CPU
  //      (bfloat16_gemms() says; detail/cpu_features.hpp has the rule: AMD Zen 4 and 5, and CPUs
  //      with AMX, not Intel's AVX512_BF16 alone), Wk, Wv and Wo rounded and packed once, now;
  //      the key, the value and the concatenated heads are rounded as their projections read
  //      them, and those projections run on bfloat16 products with float32 sums (vdpbf16ps, or
  //      AMX tiles: detail/gemm_amx.hpp). Each term x·w of a projection then carries a relative
  //      error of at most 2⁻⁷ (2⁻⁸ from each operand). The scores and P·V round their operands
  //      too (scale·Q and K, P and V; stages' bfloat16_operands) and run on the same engine; the
  //      softmax stays float32. Where no engine pays, those stages stay float32: the layer is
  //      bfloat16_query_kernel's, bit for bit. SDMHA_BFLOAT16_GEMMS in the environment forces
  //      the choice: on (vdpbf16ps), off, amx, amx-emulated (the tiles' arithmetic in software,
  //      slow: for tests), onednn (a build with oneDNN: its matmul for the projections, AMX
  //      where usable; the scores and P·V then stay float32).
  //  float32  drops every copy.
  // The copies are snapshots: after a write access through weights(), or with a kernel of
  // another size or place, a forward is a ConfigError until this is called again (weights
  // shared with the caller and changed through the caller's handle are the caller's to
  // re-round). The backward differentiates the float32 layer, so it is a ConfigError under
  // either bfloat16 mode; so is the sparse_regrouped score strategy, which reads the float32 Wq
  // (automatic projects first).
  void set_precision(Precision precision) {
    constexpr const char* where = "SparseDenseMHA::set_precision";
    if (precision != Precision::float32) {
      if constexpr (!std::is_same<Scalar, float>::value)
        detail::fail<ConfigError>(where, "precision is ", to_string(precision),
                                  " for a double layer; expected float32 (bfloat16 kernels need "
                                  "Scalar = float)");
      if constexpr (!detail::reads_bfloat16_kernel<QueryProjection>::value)
        detail::fail<ConfigError>(where, "precision is ", to_string(precision),
                                  " but the query projection stage takes no kernel_bfloat16; "
                                  "expected float32");
    }
    Core::set_dense_kernel_precision(
        where, precision == Precision::bfloat16 ? Precision::bfloat16 : Precision::float32);
    round_query_kernel(precision != Precision::float32);
    precision_ = precision;
  }
  // What set_precision last set (float32 at first).
  Precision precision() const { return precision_; }
  // Whether the GEMM stages run on bfloat16 dot products: under Precision::bfloat16, on a CPU
  // where they pay (or as SDMHA_BFLOAT16_GEMMS forced them when the precision was set).
  bool bfloat16_gemms() const { return this->dense_kernels_bfloat16(); }
  // Whether those GEMMs are the projections on oneDNN's matmul (AMX where usable; a build with
  // oneDNN), the scores and P·V then float32.
  bool bfloat16_gemms_through_onednn() const {
    return this->dense_gemm_engine() == detail::BFloat16GemmEngine::onednn;
  }
  // Whether they run on AMX tiles (all of them: projections, scores, P·V), the CPU's or, forced
  // by SDMHA_BFLOAT16_GEMMS=amx-emulated, their emulation.
  bool bfloat16_gemms_on_amx() const {
    return this->dense_gemm_engine() == detail::BFloat16GemmEngine::amx ||
           this->dense_gemm_engine() == detail::BFloat16GemmEngine::amx_emulated;
  }
  // The engine of those GEMMs by the SDMHA_BFLOAT16_GEMMS value that forces it: "off" (float32:
  // not Precision::bfloat16, or no engine that beats float32 here), "on" (vdpbf16ps pairs),
  // "onednn", "amx" (the CPU's tiles) or "amx-emulated".
  const char* bfloat16_gemm_engine() const { return detail::to_string(this->dense_gemm_engine()); }

  // query (B, T, Eq) sparse, attending to `context` (sdmha/context.hpp): {key, value} with key
  // (B, S, Ek) and value (B, S, Ev), or keys and values projected once by project_context, or
  // both → output (B, T, O). Thread-safe (a DropoutGenerator in the options is not: it belongs
  // to one caller).
  AttentionResult<Scalar> forward(const Query& query, const Context<Scalar>& context,
                                  const AttentionOptions<Scalar>& options = {}) const {
    const auto borrowed = this->borrow_workspace();
    AttentionResult<Scalar> result;
    forward(query, context, options, borrowed.workspace(), result);
    return result;
  }

  // The same into `result`, working in `workspace` (sdmha/workspace.hpp): called again with the
  // same shapes, it allocates nothing and starts no threads. Thread-safe for distinct workspaces.
  void forward(const Query& query, const Context<Scalar>& context,
               const AttentionOptions<Scalar>& options, Workspace<Scalar>& workspace,
               AttentionResult<Scalar>& result) const {
    constexpr const char* where = "SparseDenseMHA::forward";
    const LayerDims shape = checked_query(where, query);
    detail::check_context<Scalar>(where, shape, query.batch(), context, false);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    auto& buffers = lease.buffers();
    const auto plan = plan_call(where, shape, query, context.key_steps(), options,
                                detail::Pass::forward, buffers);
    QuerySource source{*this, plan, query, buffers.projected_query};
    detail::run_forward(core(), plan, source, context, options, buffers, result);
  }

  // Gradients of a loss through forward(query, context, options), given d_output =
  // ∂loss/∂output (B, T, O): every weight, the query's stored values, key and value
  // (sdmha/detail/backward_pass.hpp). The context must hold the key and value ({key, value}, or
  // {key, value, projected} to reuse the forward's K and V). Same masks, dropout and threads as
  // the forward; bitwise the same for any thread count. Every stage must bring its backward (a
  // readable static_assert otherwise).
  MhaGradients<Scalar> backward(const Query& query, const Context<Scalar>& context,
                                const TensorRef3<Scalar>& d_output,
                                const AttentionOptions<Scalar>& options = {}) const;
  // The same into `gradients`, working in `workspace`: a training loop that keeps both allocates
  // nothing and starts no threads after its first step.
  void backward(const Query& query, const Context<Scalar>& context,
                const TensorRef3<Scalar>& d_output, const AttentionOptions<Scalar>& options,
                Workspace<Scalar>& workspace, MhaGradients<Scalar>& gradients) const;

  // The score strategy that `requested` resolves to for this query and S key steps (see
  // detail::regrouped_is_cheaper for the cost model).
  ScoreStrategy resolve_strategy(ScoreStrategy requested, const Query& query, Index key_steps,
                                 bool causal) const {
    if (requested != ScoreStrategy::automatic) return requested;
    if (query_kernel_bfloat16_ != nullptr) return ScoreStrategy::project_first;
    std::vector<Index> marks;
    detail::AttentionPlan plan;
    plan.dims = this->dims();
    plan.batch = query.batch();
    plan.steps = query.steps();
    plan.key_steps = key_steps;
    plan.causal = causal;
    const bool count_features = detail::counts_distinct_features(requested, plan, query.nonzeros());
    plan.query =
        detail::query_statistics(query.csr(), query.batch(), query.steps(), count_features, marks);
    return detail::choose_strategy(requested, plan, query.nonzeros());
  }

 private:
  LayerDims checked_query(const char* where, const Query& query) const {
    const LayerDims shape = this->dims();
    if (query.features() != shape.query_dim)
      detail::fail<ShapeError>(where, "query has ", query.features(),
                               " features; expected the query kernel's input width ",
                               shape.query_dim);
    return shape;
  }

  // Validates the options and decides the call: sizes, threads, strategy, tiles, scratch.
  detail::AttentionPlan plan_call(const char* where, const LayerDims& shape, const Query& query,
                                  Index key_steps, const AttentionOptions<Scalar>& options,
                                  detail::Pass pass, detail::CallBuffers<Scalar>& buffers) const {
    // Before start_plan, which draws the dropout generator's seed: a refused call draws none.
    check_query_kernel_precision(where, options, pass);
    detail::check_options(where, shape, query.batch(), query.steps(), key_steps, options);
    auto plan = detail::start_plan(shape, query.batch(), query.steps(), key_steps, options, pass);
    const ScoreStrategy requested =
        query_kernel_bfloat16_ != nullptr ? ScoreStrategy::project_first : options.score_strategy;
    const bool count_features = detail::counts_distinct_features(requested, plan, query.nonzeros());
    plan.query = detail::query_statistics(query.csr(), query.batch(), query.steps(), count_features,
                                          buffers.feature_marks);
    plan.strategy = detail::choose_strategy(requested, plan, query.nonzeros());
    TileSizes block;
    block.rows = detail::kQueryProjectionRowBlock;
    block.features = shape.query_dim;
    block.output_width = shape.projected_key_width();
    block.nonzeros = plan.query.block_nonzeros_largest;
    detail::finish_plan(core(), plan, detail::stage_workspace_size<QueryProjection>(block));
    return plan;
  }

  // A bfloat16 query kernel must be the rounding of the current Wq, in a forward that projects
  // first (see set_precision).
  void check_query_kernel_precision(const char* where, const AttentionOptions<Scalar>& options,
                                    detail::Pass pass) const {
    Core::check_dense_kernels_bfloat16(where, pass);
    if (query_kernel_bfloat16_ == nullptr) return;
    if (pass == detail::Pass::backward)
      detail::fail<ConfigError>(where,
                                "the query kernel precision is bfloat16; expected float32 "
                                "for the backward, which differentiates the float32 layer");
    const auto& kernel = Core::weights().query_kernel;
    const auto& rounded = query_kernel_bfloat16_->rounded;
    if (query_kernel_bfloat16_->weight_accesses != this->weight_accesses() ||
        kernel.data() != query_kernel_bfloat16_->source || kernel.rows() != rounded.rows() ||
        kernel.cols() != rounded.cols())
      detail::fail<ConfigError>(where,
                                "the bfloat16 query kernel was rounded before the weights' "
                                "last write access; expected set_precision again");
    if (options.score_strategy == ScoreStrategy::sparse_regrouped)
      detail::fail<ConfigError>(where,
                                "score_strategy is sparse_regrouped with a bfloat16 query "
                                "kernel; expected project_first or automatic");
  }

  // Wq rounded to bfloat16 now (a float layer whose query stage takes kernel_bfloat16), or the
  // copy dropped.
  void round_query_kernel(bool rounded) {
    if constexpr (std::is_same<Scalar, float>::value &&
                  detail::reads_bfloat16_kernel<QueryProjection>::value) {
      if (rounded) {
        const auto& kernel = std::as_const(*this).weights().query_kernel;
        auto snapshot = std::make_shared<QueryKernelSnapshot>();
        snapshot->rounded = detail::BFloat16Panels(kernel);
        snapshot->source = kernel.data();
        snapshot->weight_accesses = this->weight_accesses();
        query_kernel_bfloat16_ = std::move(snapshot);
        return;
      }
    }
    query_kernel_bfloat16_.reset();
  }

  const Core& core() const { return *this; }
  Core& core() { return *this; }

  // K and V of validated key and value into `context` (the backward's, given no context).
  void project_context_into(const detail::AttentionPlan& plan, const TensorRef3<Scalar>& key,
                            const TensorRef3<Scalar>& value, detail::CallBuffers<Scalar>& buffers,
                            ProjectedContext<Scalar>& context) const {
    detail::project_context_into(core(), plan, key, value, buffers, context);
  }

  // Q = X·Wq + bq in the plan's blocks of query rows, into `projected_query` (resized), as a
  // region of its own (the backward's, and the bench's stage case).
  void project_query(const detail::AttentionPlan& plan, const Query& query,
                     detail::CallBuffers<Scalar>& buffers,
                     RowMatrix<Scalar>& projected_query) const {
    QuerySource source{*this, plan, query, projected_query, /*always_project=*/true};
    detail::project_query_source(plan, source, buffers);
  }

  // The masked scores of one tile by the plan's strategy, before the attention bias: from X's
  // CSR rows (regrouped) or from the tile's block of Q (`projected_query`, B·T × H·Dk), Q and K
  // rounded to bfloat16 when `bfloat16_operands` (the bfloat16 mode, which projects first).
  void tile_scores(const detail::AttentionPlan& plan, const detail::AttentionTile& item,
                   const Query& query, const RowMatrix<Scalar>& projected_query,
                   const BatchMask& mask, const ConstMatrixRef<Scalar>& key,
                   BFloat16Operands bfloat16_operands, StageScratch scratch,
                   MatrixRef<Scalar> scores) const {
    const Index T = plan.steps, Dk = plan.dims.key_dim;
    const Scalar scale = Scalar(plan.scale);
    if (plan.regrouped()) {
      const auto& kernels = this->weights();
      typename ScoreKernelT::SparseArguments args{
          item.position(),
          query.csr().middle_rows(item.batch * T + item.query_begin, item.query_rows),
          kernels.query_kernel.middleCols(item.head * Dk, Dk),
          detail::bias_segment(kernels.query_bias, item.head * Dk, Dk),
          key,
          scale,
          mask,
          scores,
          scratch};
      ScoreKernelT::can_implement(args);
      this->stages().score_kernel(args);
      return;
    }
    detail::project_first_scores(core(), plan, item, projected_query, mask, key, bfloat16_operands,
                                 scratch, scores);
  }

  // Wq rounded to bfloat16 (by column panels), the float Wq it was rounded from (to see it
  // replaced) and the count of write accesses to the weights at the time (to see them written).
  struct QueryKernelSnapshot {
    detail::BFloat16Panels rounded;
    const Scalar* source = nullptr;
    std::uint64_t weight_accesses = 0;
  };

  std::shared_ptr<const QueryKernelSnapshot> query_kernel_bfloat16_;
  Precision precision_ = Precision::float32;  // what set_precision last set
};

}  // namespace sdmha

#include "sdmha/detail/sparse_query_source.hpp"
#include "sdmha/detail/backward_pass.hpp"
