// sdmha/detail/stage_traits.hpp — what the pipeline asks of a stage type beyond the stage
// contract (Arguments, can_implement, operator(), workspace_size): optional fields of its
// Arguments and optional declarations, each a trait that is false for a stage without them.
#pragma once

#include <type_traits>
#include <utility>

namespace sdmha::detail {

// Whether a projection stage's Arguments take a bfloat16 kernel (`kernel_bfloat16`).
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

// Whether a projection stage says when fused blocks give the same bits as its fixed ones
// (a static same_bits_in_any_block(bool bfloat16_kernel)), and says so for this call.
template <typename Stage, typename = void>
struct declares_block_invariance : std::false_type {};
template <typename Stage>
struct declares_block_invariance<Stage, std::void_t<decltype(Stage::same_bits_in_any_block(false))>>
    : std::true_type {};
template <typename Stage>
bool same_bits_in_any_block(bool bfloat16_kernel) {
  if constexpr (declares_block_invariance<Stage>::value)
    return Stage::same_bits_in_any_block(bfloat16_kernel);
  return false;
}

// Whether an attend-values stage can add P·V into its output (`accumulate` in its Arguments):
// the online softmax sums a row's output over key tiles.
template <typename Stage, typename = void>
struct accumulates_values : std::false_type {};
template <typename Stage>
struct accumulates_values<
    Stage, std::void_t<decltype(std::declval<typename Stage::Arguments&>().accumulate)>>
    : std::true_type {};

// Whether a query projection stage can run on a window of Wq's columns (`first_column`,
// `kernel_columns` in its Arguments and a static column_window_width(bool bfloat16)), and
// whether its windows can share one CSC by feature per row block (build_query_groups).
template <typename Stage, typename = void>
struct splits_columns : std::false_type {};
template <typename Stage>
struct splits_columns<
    Stage, std::void_t<decltype(Stage::column_window_width(false)),
                       decltype(std::declval<typename Stage::Arguments&>().first_column)>>
    : std::true_type {};
template <typename Stage, typename = void>
struct shares_feature_groups : std::false_type {};
template <typename Stage>
struct shares_feature_groups<
    Stage, std::void_t<decltype(std::declval<typename Stage::Arguments&>().feature_groups),
                       decltype(&Stage::build_query_groups)>> : std::true_type {};

// Whether a softmax stage computes MaskedSoftmax's math (a row's probabilities exp(s − max) / sum
// over the keys it may see, 0 for a fully blocked row), so that the forward may compute them
// online, key tile by key tile, without storing a row of S: the stage declares
// `using computes_online = ItsOwnType;` (a declaration inherited from a base names the base, and
// does not count).
template <typename Stage, typename = void>
struct supports_online_softmax : std::false_type {};
template <typename Stage>
struct supports_online_softmax<Stage, std::void_t<typename Stage::computes_online>>
    : std::is_same<typename Stage::computes_online, Stage> {};

// The online softmax runs only when both stages declare it (the attend-values stage's
// declaration says that it honours `accumulate`); otherwise the forward is tiled, and a worker's
// memory grows with S (a tile of query rows × S scores).
template <typename Softmax, typename AttendValues>
constexpr bool online_softmax_allowed() {
  return supports_online_softmax<Softmax>::value && supports_online_softmax<AttendValues>::value &&
         accumulates_values<AttendValues>::value;
}

}  // namespace sdmha::detail
