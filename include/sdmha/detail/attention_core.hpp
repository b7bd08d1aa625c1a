// sdmha/detail/attention_core.hpp — the state a layer holds: its configuration, its weights
// (owned or shared), its stage objects, the bfloat16 copies of its dense kernels and the
// workspaces it keeps for calls given none. The passes of a call are free functions over this
// state (detail/forward_pass.hpp, sdmha/detail/backward_pass.hpp), the checks
// detail/validation.hpp's, the plan's stage scratch finish_plan below.
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
#include "sdmha/detail/cpu_features.hpp"
#include "sdmha/detail/forward_pass.hpp"
#include "sdmha/detail/stage_traits.hpp"
#include "sdmha/detail/validation.hpp"
#include "sdmha/detail/dropout.hpp"
#include "sdmha/detail/finite.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/gemm_bfloat16.hpp"
#include "sdmha/detail/gemm_onednn.hpp"
#include "sdmha/detail/parallel.hpp"
#include "sdmha/detail/softmax_exp.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/kernels.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/options.hpp"
#include "sdmha/projected_context.hpp"
#include "sdmha/stage.hpp"
#include "sdmha/stages/attend_values.hpp"
#include "sdmha/stages/masked_softmax.hpp"
#include "sdmha/weights.hpp"
#include "sdmha/workspace.hpp"

namespace sdmha::detail {

// The one door to a layer's private state for code outside the library that must reach it: the
// tests (which lower the streaming sizes to stream small problems) and the bench (which walks the
// layer's own plan stage by stage). Declared here, never defined: each of them defines its own
// specialization, on a tag of its own, beside its code (tests/support/, bench/).
template <typename Tag>
struct InternalAccess;

// The stage scratch of the context projection for a plan's row blocks, or all rows (backward,
// or fused: projection_scratch_rows).
template <typename ContextProjection>
std::size_t context_scratch_bytes(const AttentionPlan& plan) {
  const Index rows = std::max(plan.batch * plan.key_steps, Index(1));
  TileSizes sizes;
  sizes.rows = plan.pass == Pass::forward ? projection_scratch_rows<ContextProjection>(rows) : rows;
  sizes.input_width = std::max(plan.dims.key_in_dim, plan.dims.value_in_dim);
  sizes.output_width = std::max(plan.dims.projected_key_width(), plan.dims.projected_value_width());
  return stage_workspace_size<ContextProjection>(sizes);
}

template <typename Scalar, typename QueryProjectionT, typename ScoreKernelT, typename SoftmaxT,
          typename AttendValuesT, typename OutputProjectionT, typename ContextProjectionT>
class AttentionCore {
  static_assert((std::is_same<typename QueryProjectionT::ScalarType, Scalar>::value &&
                 std::is_same<typename ScoreKernelT::ScalarType, Scalar>::value &&
                 std::is_same<typename SoftmaxT::ScalarType, Scalar>::value &&
                 std::is_same<typename AttendValuesT::ScalarType, Scalar>::value &&
                 std::is_same<typename OutputProjectionT::ScalarType, Scalar>::value &&
                 std::is_same<typename ContextProjectionT::ScalarType, Scalar>::value),
                "every stage's ScalarType must be the layer's Scalar");

 public:
  using ScalarType = Scalar;
  using Stages = LayerStages<QueryProjectionT, ContextProjectionT, ScoreKernelT, SoftmaxT,
                             AttendValuesT, OutputProjectionT>;
  using QueryProjection = QueryProjectionT;
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

  // The stage objects (sdmha/stage.hpp, LayerStages), for stages with parameters of their own.
  Stages& stages() { return stages_; }
  const Stages& stages() const { return stages_; }

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
    check_context<Scalar>(where, dims, key.dimension(0), key, value);
    check_dense_kernels_bfloat16(where, Pass::forward);
    if (num_threads < 0)
      fail<ConfigError>(where, "num_threads = ", num_threads,
                        "; expected >= 0 (0 means the physical cores)");
    AttentionPlan plan;
    plan.dims = dims;
    plan.batch = key.dimension(0);
    plan.key_steps = key.dimension(1);
    plan.threads = resolve_thread_count(num_threads);
    plan.worker_scratch_bytes = context_scratch_bytes<ContextProjection>(plan);
    const typename Workspace<Scalar>::Lease lease(workspace, where);
    project_context_into(*this, plan, key, value, lease.buffers(), context);
  }

  // ---- for the passes (the layers inherit this class privately: none of it is public API) ----

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

  // Wk, Wv and Wo rounded to bfloat16 and packed for the bfloat16 GEMM (and handed to oneDNN
  // when it is the engine), with the engine and what they were rounded from: the float kernels'
  // places and the count of write accesses at the time.
  struct DenseKernelsBFloat16 {
    BFloat16Kernel key, value, output;
    BFloat16GemmEngine engine = BFloat16GemmEngine::pairs;
    const Scalar *key_source = nullptr, *value_source = nullptr, *output_source = nullptr;
    std::uint64_t weight_accesses = 0;
  };

  // Rounds Wk, Wv and Wo now (Precision::bfloat16, where cpu_features.hpp's rule or
  // SDMHA_BFLOAT16_GEMMS gives a bfloat16 engine), or drops the copies (float32, or bfloat16
  // where no engine beats float32). `where` names the public call in errors: a double layer, or a
  // context or output projection stage that takes no kernel_bfloat16, is a ConfigError whatever
  // the CPU, as is an SDMHA_BFLOAT16_GEMMS this build or CPU cannot take (cpu_features.hpp).
  void set_dense_kernel_precision(const char* where, Precision precision) {
    if (precision == Precision::float32) {
      dense_bfloat16_.reset();
      return;
    }
    const BFloat16GemmMachine machine = bfloat16_gemm_machine();  // asks for AMX's tile data
    const BFloat16GemmEngine engine = bfloat16_gemm_engine(
        bfloat16_gemms_from_environment(where, kHaveOneDnnGemm, machine.amx_usable), machine);
    if constexpr (!std::is_same<Scalar, float>::value) {
      fail<ConfigError>(where,
                        "precision is bfloat16 for a double layer; expected float32 "
                        "(bfloat16 kernels need Scalar = float)");
    } else if constexpr (!reads_bfloat16_kernel<ContextProjection>::value ||
                         !reads_bfloat16_kernel<OutputProjection>::value) {
      fail<ConfigError>(where,
                        "precision is bfloat16 but the context or output projection "
                        "stage takes no kernel_bfloat16; expected float32");
    } else if (engine == BFloat16GemmEngine::float32) {
      dense_bfloat16_.reset();
    } else {
      const MhaWeights<Scalar>& weights = *weights_;
      auto kernels = std::make_shared<DenseKernelsBFloat16>();
      kernels->key = BFloat16Kernel(weights.key_kernel);
      kernels->value = BFloat16Kernel(weights.value_kernel);
      kernels->output = BFloat16Kernel(weights.output_kernel);
      kernels->engine = engine;
      if (engine == BFloat16GemmEngine::amx || engine == BFloat16GemmEngine::amx_emulated)
        for (BFloat16Kernel* kernel : {&kernels->key, &kernels->value, &kernels->output})
          hand_to_amx(*kernel, engine == BFloat16GemmEngine::amx_emulated);
#if defined(SDMHA_WITH_ONEDNN)
      // The projections call it a fixed row block at a time (row_projection.hpp).
      if (engine == BFloat16GemmEngine::onednn)
        for (BFloat16Kernel* kernel : {&kernels->key, &kernels->value, &kernels->output})
          hand_to_onednn(*kernel, kProjectionRowBlock);
#endif
      kernels->key_source = weights.key_kernel.data();
      kernels->value_source = weights.value_kernel.data();
      kernels->output_source = weights.output_kernel.data();
      kernels->weight_accesses = weight_accesses_;
      dense_bfloat16_ = std::move(kernels);
    }
  }
  bool dense_kernels_bfloat16() const { return dense_bfloat16_ != nullptr; }
  // The engine of the bfloat16 GEMMs (float32 where there are none).
  BFloat16GemmEngine dense_gemm_engine() const {
    return dense_bfloat16_ != nullptr ? dense_bfloat16_->engine : BFloat16GemmEngine::float32;
  }
  // Whether the scores and P·V round their operands (Q, K, P, V) to bfloat16, and on which
  // engine: in the bfloat16 mode on the pairs engine or the tiles (with oneDNN they stay float32:
  // cpu_features.hpp says why), when the score and attend-values stages both can.
  BFloat16Operands attends_in_bfloat16() const {
    using Engine = BFloat16Operands::Engine;
    if (!std::is_same<Scalar, float>::value || !reads_bfloat16_operands<ScoreKernel>::value ||
        !reads_bfloat16_operands<AttendValues>::value)
      return {};
    switch (dense_gemm_engine()) {
      case BFloat16GemmEngine::pairs:
        return Engine::pairs;
      case BFloat16GemmEngine::amx:
        return Engine::amx;
      case BFloat16GemmEngine::amx_emulated:
        return Engine::amx_emulated;
      default:
        return {};
    }
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

  // The bfloat16 copy of one kernel for a projection, or nullptr in float32.
  const BFloat16Kernel* dense_kernel_bfloat16(BFloat16Kernel DenseKernelsBFloat16::*kernel) const {
    return dense_bfloat16_ != nullptr ? &((*dense_bfloat16_).*kernel) : nullptr;
  }

  // The sizes beyond which a forward given key and value streams K and V (plan_context_chunk).
  const ContextStreaming& context_streaming() const { return context_streaming_; }

 private:
  MhaConfig config_;
  std::shared_ptr<MhaWeights<Scalar>> weights_;
  Stages stages_;
  ContextStreaming context_streaming_;  // see plan_context_chunk
  std::shared_ptr<const DenseKernelsBFloat16> dense_bfloat16_;
  std::uint64_t weight_accesses_ = 0;       // calls of the non-const weights()
  WorkspaceCache<Scalar> workspace_cache_;  // for the calls given no Workspace

  template <typename Tag>
  friend struct InternalAccess;
};

// Fills in the plan's tiles and each worker's scratch: the largest of what the stages ask for
// (`query_stage_bytes` is the query source's own projection's). The online softmax is taken for
// long key ranges when both the softmax and the attend-values stage declare it
// (online_softmax_allowed); otherwise a worker holds a tile of query rows × S scores.
template <typename Core>
void finish_plan(const Core& core, AttentionPlan& plan, std::size_t query_stage_bytes) {
  using Scalar = typename Core::ScalarType;
  plan.online_softmax =
      plan.pass == Pass::forward && !plan.regrouped() && !plan.return_scores &&
      plan.fully_masked_rows == FullyMaskedRows::zeros && plan.key_steps > kKeyTile &&
      online_softmax_allowed<typename Core::Softmax, typename Core::AttendValues>();
  plan.key_tile = plan.online_softmax ? kKeyTile : plan.key_steps;
  plan.query_tile =
      plan_query_tile(plan.pass, plan.regrouped(), plan.causal, plan.batch * plan.heads(),
                      plan.steps, plan.key_steps, plan.key_tile);
  plan.query_tiles = AttentionPlan::block_count(plan.steps, plan.query_tile);
  const Index rows = std::min(plan.query_tile, plan.steps);
  plan.tile_entries = rows * std::max(plan.key_tile, Index(2));
  TileSizes tile;
  tile.rows = rows;
  tile.key_steps = plan.key_tile;
  tile.key_dim = plan.dims.key_dim;
  tile.value_dim = plan.dims.value_dim;
  tile.features = plan.dims.query_dim;
  tile.bfloat16_operands = bool(core.attends_in_bfloat16());
  if (plan.regrouped()) {
    tile.distinct_features = plan.query.distinct_largest;
    tile.nonzeros = plan.query.batch_nonzeros_largest;
  }
  TileSizes output;
  const Index output_rows = std::max(plan.batch * plan.steps, Index(1));
  output.rows = plan.pass == Pass::forward
                    ? projection_scratch_rows<typename Core::OutputProjection>(output_rows)
                    : output_rows;
  output.input_width = plan.dims.projected_value_width();
  output.output_width = plan.dims.output_dim;
  plan.worker_scratch_bytes =
      std::max({query_stage_bytes, context_scratch_bytes<typename Core::ContextProjection>(plan),
                stage_workspace_size<typename Core::OutputProjection>(output),
                stage_workspace_size<typename Core::ScoreKernel>(tile),
                stage_workspace_size<typename Core::Softmax>(tile),
                stage_workspace_size<typename Core::AttendValues>(tile)});
  plan.context_chunk = plan_context_chunk(plan, sizeof(Scalar), core.context_streaming());
}

}  // namespace sdmha::detail
