// sdmha/stage.hpp — what every stage shares: where its tile sits, the sizes its scratch is
// planned for, the scratch itself, and the traits the layer checks stages with.
//
// A stage is a functor with a nested `Arguments`, a static `can_implement(args)` that throws a
// typed error naming the argument, and `operator()(args)`. Its backward sits beside it with the
// same shape: `BackwardArguments`, `can_implement(backward_args)`, `backward(backward_args)`, and
// `using differentiates = TheStage;` saying whose derivative that is. A stage derived from a
// default one inherits the default's backward but not its claim to differentiate the derived
// stage, so backward refuses it at compile time until it declares a backward of its own (or
// the alias, when the inherited backward is right for it, as for an additive constant bias).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/errors.hpp"

namespace sdmha {

// Where one tile of the attention sits in the (B, H, T, S) problem: rows are query steps
// query_begin …, columns key steps key_begin … of batch entry `batch`, head `head`. A
// position-dependent stage (a relative-position bias, ALiBi, a decay) reads these.
struct TilePosition {
  Index batch = 0;
  Index head = 0;
  Index query_begin = 0;  // absolute query step of the tile's first row
  Index key_begin = 0;    // absolute key step of the tile's first column
};

// The stage objects of a layer, one member per stage in pipeline order, through the layer's one
// accessor stages(). A stage with parameters of its own is set up there, before the layer is
// shared between threads: forward and backward only read the stages.
template <typename QueryProjectionT, typename ContextProjectionT, typename ScoreKernelT,
          typename SoftmaxT, typename AttendValuesT, typename OutputProjectionT>
struct LayerStages {
  using QueryProjection = QueryProjectionT;
  using ContextProjection = ContextProjectionT;
  using ScoreKernel = ScoreKernelT;
  using Softmax = SoftmaxT;
  using AttendValues = AttendValuesT;
  using OutputProjection = OutputProjectionT;

  QueryProjection query_projection;      // Q = X·Wq + bq
  ContextProjection context_projection;  // K = key·Wk + bk, V = value·Wv + bv
  ScoreKernel score_kernel;              // S = scale·Q·Kᵀ, masked
  Softmax softmax;                       // P = softmax(S)
  AttendValues attend_values;            // A = P·V
  OutputProjection output_projection;    // Y = A·Wo + bo
};

// Working memory a stage call may use as it likes: `bytes` bytes at `data`, aligned to
// kScratchAlignment, owned by the caller's Workspace (one block per worker), valid for the call.
struct StageScratch {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
};

inline constexpr std::size_t kScratchAlignment = 64;

// How a tile's products take their operands (the score and attend-values stages'
// `bfloat16_operands`): as they are (false), or rounded to bfloat16 with exact products and float32
// sums, on one of the bfloat16 mode's engines. Made from a bool (true: the vdpbf16ps pairs
// engine) and read as one in a condition; it turns into a bool only explicitly, so that no call
// on the way from the layer to a stage can drop the engine.
class BFloat16Operands {
 public:
  enum class Engine : std::uint8_t {
    none,
    pairs,        // detail/gemm_bfloat16.hpp: vdpbf16ps, or its portable loop
    amx,          // detail/gemm_amx.hpp on the CPU's tiles
    amx_emulated  // detail/gemm_amx.hpp on its emulated tiles (tests on any CPU)
  };
  constexpr BFloat16Operands(bool rounded = false)
      : engine_(rounded ? Engine::pairs : Engine::none) {}
  constexpr BFloat16Operands(Engine engine) : engine_(engine) {}
  constexpr explicit operator bool() const { return engine_ != Engine::none; }
  constexpr Engine engine() const { return engine_; }

 private:
  Engine engine_;
};

// The largest tile a stage will see in one call, for its workspace_size(). The plan fills what
// applies to the stage: rows and widths always, the sparse fields for stages that read the CSR.
struct TileSizes {
  Index rows = 0;                  // query rows of a tile, or rows of a projection block
  Index key_steps = 0;             // key columns of a score tile
  Index key_dim = 0;               // Dk
  Index value_dim = 0;             // Dv
  Index input_width = 0;           // a projection's input width (E)
  Index output_width = 0;          // a projection's output width (N)
  Index features = 0;              // the query's feature width Eq
  Index distinct_features = 0;     // the most distinct features of one batch entry's rows (U_b)
  Index nonzeros = 0;              // the most stored values of one tile's or block's rows
  bool bfloat16_operands = false;  // the tile's products round their operands (bfloat16 mode)
};

namespace detail {

// Stage::workspace_size(sizes) when the stage declares one, else 0 (a stage without scratch).
template <typename Stage, typename = void>
struct HasWorkspaceSize : std::false_type {};
template <typename Stage>
struct HasWorkspaceSize<
    Stage, std::void_t<decltype(Stage::workspace_size(std::declval<const TileSizes&>()))>>
    : std::true_type {};

template <typename Stage>
std::size_t stage_workspace_size(const TileSizes& sizes) {
  if constexpr (HasWorkspaceSize<Stage>::value)
    return Stage::workspace_size(sizes);
  else
    return 0;
}

// Whether Stage brings the backward of itself, not only that of a stage it derives from: it
// declares `using differentiates = Stage;`, or it declares a single (non-template) backward of
// its own. A stage derived from a default one inherits both the default's alias and its
// backward, so neither counts for it.
template <typename Stage, typename = void>
struct DeclaresDifferentiates : std::false_type {};
template <typename Stage>
struct DeclaresDifferentiates<Stage, std::void_t<typename Stage::differentiates>>
    : std::is_same<typename Stage::differentiates, Stage> {};

template <typename MemberPointer>
struct MemberClass {
  using type = void;
};
template <typename Function, typename Class>
struct MemberClass<Function Class::*> {
  using type = Class;
};
template <typename Stage, typename = void>
struct DeclaresBackward : std::false_type {};
template <typename Stage>
struct DeclaresBackward<Stage, std::void_t<decltype(&Stage::backward)>>
    : std::is_same<typename MemberClass<decltype(&Stage::backward)>::type, Stage> {};

template <typename Stage>
struct IsDifferentiable : std::integral_constant<bool, DeclaresDifferentiates<Stage>::value ||
                                                           DeclaresBackward<Stage>::value> {};

// A projection stage's check of its Arguments::kernel_bfloat16 (null: none given): a bfloat16
// copy of the kernel only serves a float stage, and only with the float kernel's shape.
template <typename Scalar, typename RoundedKernel, typename Kernel>
void check_kernel_bfloat16(const char* where, const RoundedKernel* kernel_bfloat16,
                           const Kernel& kernel) {
  if (kernel_bfloat16 == nullptr) return;
  if (!std::is_same<Scalar, float>::value)
    fail<ConfigError>(where,
                      "kernel_bfloat16 is set for a double stage; expected none "
                      "(bfloat16 kernels need Scalar = float)");
  if (kernel_bfloat16->rows() != kernel.rows() || kernel_bfloat16->cols() != kernel.cols())
    fail<ShapeError>(where, "kernel_bfloat16 is ", kernel_bfloat16->rows(), " x ",
                     kernel_bfloat16->cols(), "; expected the kernel's ", kernel.rows(), " x ",
                     kernel.cols());
}

// A stage asked to round its operands to bfloat16 (`bfloat16_operands`) must be a float stage.
template <typename Scalar>
void check_bfloat16_operands(const char* where, BFloat16Operands bfloat16_operands) {
  if (bfloat16_operands && !std::is_same<Scalar, float>::value)
    fail<ConfigError>(where,
                      "bfloat16_operands is set for a double stage; expected false (bfloat16 "
                      "operands need Scalar = float)");
}

}  // namespace detail
}  // namespace sdmha
