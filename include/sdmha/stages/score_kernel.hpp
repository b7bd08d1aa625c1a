// sdmha/stages/score_kernel.hpp — ScoreKernel: the masked scores of one tile, and their backward.
//
//   math:  S = (Q_h/√Dk)·K_hᵀ, or regrouped S = X_b·M + 1·c with M = Wq_h·K_hᵀ/√Dk, c =
//   bq_h·K_hᵀ/√Dk;
//          then S[t, s] = −∞ wherever the mask blocks (t, s)
//   pre:   Q_h rows × Dk (or X_b: CSR rows over Eq features, Wq_h Eq × Dk); K_h keys × Dk; S rows ×
//   keys cost:  project-first 2·rows·keys·Dk; regrouped 2·U·Dk·keys + 2·nnz(X_b)·keys, U = distinct
//   features
//
// Backward, given dS (zero at blocked entries): dQ_h = scale·dS·K_h, dK_h += scale·dSᵀ·Q_h, for
// either form (the regrouped form's Q is the projected query too).
// Every Arguments says where its tile sits (TilePosition: batch, head, query_begin, key_begin),
// so a stage derived from this one can edit `scores` by absolute position after calling it.
#pragma once

#include <algorithm>
#include <type_traits>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/detail/gemm_amx.hpp"
#include "sdmha/detail/scratch.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/sparse_query.hpp"
#include "sdmha/stage.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct ScoreKernel {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;
  using differentiates = ScoreKernel;

  // Project-first: the tile's rows of the head's block of the projected query.
  struct Arguments : TilePosition {
    ConstMatrixRef<Scalar> query;      // rows × Dk
    ConstMatrixRef<Scalar> key;        // keys × Dk
    Scalar scale;                      // 1/√Dk
    BatchMask mask;                    // of this tile
    mutable MatrixRef<Scalar> scores;  // rows × keys
    StageScratch workspace = {};
    // Float only: S = bf16(scale·Q)·bf16(K)ᵀ, the operands rounded to bfloat16, each product
    // exact and the sums in float32 (detail::gemm_bfloat16_operands): the bfloat16 mode.
    BFloat16Operands bfloat16_operands = false;
  };

  // Regrouped sparse × dense: the tile's CSR rows and the head's columns of the query kernel.
  struct SparseArguments : TilePosition {
    CsrView<Scalar, StorageIndex> query;  // rows × Eq
    ConstMatrixRef<Scalar> query_kernel;  // Eq × Dk (head h's column block of Wq)
    ConstVectorRef<Scalar> query_bias;    // Dk (head h's slice of bq), or empty
    ConstMatrixRef<Scalar> key;           // keys × Dk
    Scalar scale;
    BatchMask mask;
    mutable MatrixRef<Scalar> scores;  // rows × keys
    StageScratch workspace = {};
  };

  // The gradient through the scores of either form.
  struct BackwardArguments : TilePosition {
    ConstMatrixRef<Scalar> query;  // rows × Dk, the projected query's tile
    ConstMatrixRef<Scalar> key;    // keys × Dk
    Scalar scale;
    mutable MatrixRef<Scalar>
        d_scores;  // rows × keys: ∂loss/∂scores (0 where blocked); a derived stage may edit it
    mutable MatrixRef<Scalar> d_query;  // rows × Dk, overwritten
    mutable MatrixRef<Scalar> d_key;    // keys × Dk, accumulated into
    bool key_is_finite = true;          // false: K may hold NaN/Inf in rows whose dS column is 0
    StageScratch workspace = {};
  };

  // Packing for the project-first product and both gradient products (sizes.rows × sizes.key_steps
  // × sizes.key_dim), and for the regrouped form its feature table (sizes.features), distinct
  // features, gathered Wq rows and M (sizes.nonzeros, sizes.distinct_features) besides; with
  // sizes.bfloat16_operands, the rounded Kᵀ and Q of gemm_bfloat16_operands.
  static std::size_t workspace_size(const TileSizes& sizes) {
    const Index rows = sizes.rows, keys = sizes.key_steps, width = sizes.key_dim;
    const Index used = sizes.distinct_features, entries = sizes.nonzeros;
    const std::size_t dense = std::max(
        {detail::gemm_workspace_size<Scalar>(rows, keys, width),
         detail::gemm_workspace_size<Scalar>(rows, width, keys),
         detail::gemm_workspace_size<Scalar>(keys, width, rows),
         sizes.bfloat16_operands ? detail::bfloat16_operands_workspace_size(rows, keys, width)
                                 : 0});
    if (used == 0) return dense;
    const std::size_t regrouped = detail::array_bytes<StorageIndex>(sizes.features) +
                                  detail::array_bytes<StorageIndex>(entries) +
                                  detail::array_bytes<Scalar>(used * width) +
                                  detail::array_bytes<Scalar>(used * keys) +
                                  std::max(detail::gemm_workspace_size<Scalar>(used, keys, width),
                                           detail::gemm_workspace_size<Scalar>(1, keys, width));
    return std::max(dense, regrouped);
  }

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "ScoreKernel";
    if (args.query.cols() != args.key.cols())
      detail::fail<ShapeError>(where, "query has width ", args.query.cols(), " but key has width ",
                               args.key.cols(), "; expected equal key_dim");
    check_scores(where, args.scores, args.query.rows(), args.key.rows(), args.mask);
    detail::check_bfloat16_operands<Scalar>(where, args.bfloat16_operands);
  }

  static void can_implement(const SparseArguments& args) {
    constexpr const char* where = "ScoreKernel (sparse)";
    if (args.query_kernel.rows() != args.query.cols)
      detail::fail<ShapeError>(where, "query_kernel has ", args.query_kernel.rows(),
                               " rows; expected the query's feature width ", args.query.cols);
    if (args.query_kernel.cols() != args.key.cols())
      detail::fail<ShapeError>(where, "query_kernel has ", args.query_kernel.cols(),
                               " columns but key has width ", args.key.cols(), "; expected equal");
    if (args.query_bias.size() != 0 && args.query_bias.size() != args.key.cols())
      detail::fail<ShapeError>(where, "query_bias has ", args.query_bias.size(),
                               " entries; expected 0 or ", args.key.cols());
    check_scores(where, args.scores, args.query.rows, args.key.rows(), args.mask);
  }

  static void can_implement(const BackwardArguments& args) {
    constexpr const char* where = "ScoreKernel (backward)";
    const Index rows = args.query.rows(), keys = args.key.rows(), width = args.key.cols();
    if (args.query.cols() != width)
      detail::fail<ShapeError>(where, "query has width ", args.query.cols(), "; expected key's ",
                               width);
    if (args.d_scores.rows() != rows || args.d_scores.cols() != keys)
      detail::fail<ShapeError>(where, "d_scores is ", args.d_scores.rows(), " x ",
                               args.d_scores.cols(), "; expected ", rows, " x ", keys);
    if (args.d_query.rows() != rows || args.d_query.cols() != width)
      detail::fail<ShapeError>(where, "d_query is ", args.d_query.rows(), " x ",
                               args.d_query.cols(), "; expected ", rows, " x ", width);
    if (args.d_key.rows() != keys || args.d_key.cols() != width)
      detail::fail<ShapeError>(where, "d_key is ", args.d_key.rows(), " x ", args.d_key.cols(),
                               "; expected ", keys, " x ", width);
  }

  void operator()(const Arguments& args) const {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (args.bfloat16_operands) {  // Q scaled as Keras does, then rounded
        detail::gemm_bfloat16_operands(args.query, args.key, true, args.scores, false,
                                       args.workspace, args.scale, args.bfloat16_operands);
        apply_mask<Scalar>(args.mask, args.scores);
        return;
      }
    }
    // Keras scales the query, not the product; the scale folds into the GEMM's alpha.
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.query),
                         detail::transposed<Scalar>(args.key), args.scores, args.scale, false,
                         args.workspace);
    apply_mask<Scalar>(args.mask, args.scores);
  }

  void operator()(const SparseArguments& args) const;

  void backward(const BackwardArguments& args) const {
    product_skipping_zero_weights(args.scale, args.d_scores, args.key, args.key_is_finite,
                                  args.d_query, args.workspace);
    detail::gemm<Scalar>(detail::transposed<Scalar>(args.d_scores),
                         detail::as_operand<Scalar>(args.query), args.d_key, args.scale, true,
                         args.workspace);
  }

 private:
  // out = alpha · weights · rows, where a zero weight never meets its row: a row of K that every
  // query is blocked from may be NaN, and its weights (dS's column) are exactly 0.
  static void product_skipping_zero_weights(Scalar alpha, const ConstMatrixRef<Scalar>& weights,
                                            const ConstMatrixRef<Scalar>& rows,
                                            bool rows_are_finite, MatrixRef<Scalar> out,
                                            StageScratch workspace) {
    if (rows_are_finite) {
      detail::gemm<Scalar>(detail::as_operand<Scalar>(weights), detail::as_operand<Scalar>(rows),
                           out, alpha, false, workspace);
      return;
    }
    out.setZero();
    for (Index t = 0; t < weights.rows(); ++t)
      for (Index s = 0; s < weights.cols(); ++s)
        if (weights(t, s) != Scalar(0))
          out.row(t).noalias() += (alpha * weights(t, s)) * rows.row(s);
  }

  static void check_scores(const char* where, const MatrixRef<Scalar>& scores, Index steps,
                           Index key_steps, const BatchMask& mask) {
    if (scores.rows() != steps || scores.cols() != key_steps)
      detail::fail<ShapeError>(where, "scores is ", scores.rows(), " x ", scores.cols(),
                               "; expected ", steps, " x ", key_steps);
    if (!mask.empty() && (mask.steps != steps || mask.key_steps != key_steps))
      detail::fail<ShapeError>(where, "mask is for ", mask.steps, " x ", mask.key_steps,
                               "; expected ", steps, " x ", key_steps);
  }
};

// Regrouped: U, the distinct features of these rows, sorted; M = (Wq_h[U]·scale)·Kᵀ (U × keys);
// then each row is c plus the sum of its values times their features' rows of M. Only U rows of
// Wq are read, and every product with K is one GEMM.
template <typename Scalar, typename StorageIndex>
void ScoreKernel<Scalar, StorageIndex>::operator()(const SparseArguments& args) const {
  const auto& query = args.query;
  const Index width = args.query_kernel.cols(), key_steps = args.key.rows();
  const Index entries = query.nonzeros(), features_count = query.cols;
  // A workspace smaller than workspace_size() (a stage called on its own, without a planned
  // workspace) gets memory of its own here: the same result, with an allocation.
  const detail::ScratchOrOwn list_memory(args.workspace,
                                         detail::array_bytes<StorageIndex>(features_count) +
                                             detail::array_bytes<StorageIndex>(entries));
  detail::ScratchCarver carver(list_memory.view());
  // position[f]: feature f's row in M, or −1: O(Eq) to clear, then O(1) per stored value.
  StorageIndex* position = carver.take<StorageIndex>(features_count);
  StorageIndex* features = carver.take<StorageIndex>(entries);  // the distinct ones, U ≤ entries
  std::fill(position, position + features_count, StorageIndex(-1));
  Index used = 0;
  for (Index row = 0; row < query.rows; ++row)
    for (Index k = query.row_begin(row); k < query.row_end(row); ++k) {
      StorageIndex& seen = position[std::size_t(query.column_indices[k])];
      if (seen < 0) {
        seen = 0;
        features[used++] = query.column_indices[k];
      }
    }
  std::sort(features, features + used);  // M's rows in feature order: Wq is read in order
  for (Index i = 0; i < used; ++i) position[std::size_t(features[i])] = StorageIndex(i);

  const std::size_t products = detail::array_bytes<Scalar>(used * width) +
                               detail::array_bytes<Scalar>(used * key_steps) +
                               std::max(detail::gemm_workspace_size<Scalar>(used, key_steps, width),
                                        detail::gemm_workspace_size<Scalar>(1, key_steps, width));
  const detail::ScratchOrOwn product_memory(carver.rest(), products);
  carver = detail::ScratchCarver(product_memory.view());
  Eigen::Map<RowMatrix<Scalar>> gathered(carver.take<Scalar>(used * width), used, width);
  Eigen::Map<RowMatrix<Scalar>> regrouped(carver.take<Scalar>(used * key_steps), used, key_steps);
  for (Index i = 0; i < used; ++i) gathered.row(i) = args.query_kernel.row(features[i]);
  detail::gemm<Scalar>(detail::as_operand<Scalar>(gathered), detail::transposed<Scalar>(args.key),
                       regrouped, args.scale, false, carver.rest());

  if (args.query_bias.size() != 0 && query.rows > 0) {
    // c = (bq_h · scale) · Kᵀ into the first row, then copied to the others.
    const detail::GemmOperand<Scalar> bias_row{args.query_bias.data(), 1, width, width, true};
    detail::gemm<Scalar>(bias_row, detail::transposed<Scalar>(args.key), args.scores.topRows(1),
                         args.scale, false, carver.rest());
    for (Index row = 1; row < query.rows; ++row) args.scores.row(row) = args.scores.row(0);
  } else {
    args.scores.setZero();
  }
  for (Index row = 0; row < query.rows; ++row) {
    auto out = args.scores.row(row);
    for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
      out.noalias() +=
          query.values[k] * regrouped.row(position[std::size_t(query.column_indices[k])]);
  }
  apply_mask<Scalar>(args.mask, args.scores);
}

}  // namespace sdmha
