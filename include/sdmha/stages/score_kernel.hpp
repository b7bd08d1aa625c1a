// sdmha/stages/score_kernel.hpp — ScoreKernel: the masked scores of one (batch, head).
//
//   math:  S = (Q_h/√Dk)·K_hᵀ, or regrouped S = X_b·M + 1·c with M = Wq_h·K_hᵀ/√Dk, c = bq_h·K_hᵀ/√Dk;
//          then S[t, s] = −∞ wherever the mask blocks (t, s)
//   pre:   Q_h T × Dk (or X_b: T CSR rows over Eq features, Wq_h Eq × Dk); K_h S × Dk; S is T × S
//   cost:  project-first 2·T·S·Dk; regrouped 2·U·Dk·S + 2·nnz(X_b)·S, U = distinct features of X_b
#pragma once

#include <algorithm>
#include <vector>

#include "sdmha/config.hpp"
#include "sdmha/detail/gemm.hpp"
#include "sdmha/errors.hpp"
#include "sdmha/mask.hpp"
#include "sdmha/sparse_query.hpp"

namespace sdmha {

template <typename Scalar, typename StorageIndex = int>
struct ScoreKernel {
  using ScalarType = Scalar;
  using StorageIndexType = StorageIndex;

  // Project-first: the head's block of the projected query.
  struct Arguments {
    ConstMatrixRef<Scalar> query;  // T × Dk
    ConstMatrixRef<Scalar> key;    // S × Dk
    Scalar scale;                  // 1/√Dk
    BatchMask mask;
    mutable MatrixRef<Scalar> scores;      // T × S
  };

  // Regrouped sparse × dense: batch b's CSR rows and the head's columns of the query kernel.
  struct SparseArguments {
    CsrView<Scalar, StorageIndex> query;  // T × Eq
    ConstMatrixRef<Scalar> query_kernel;  // Eq × Dk (head h's column block of Wq)
    ConstVectorRef<Scalar> query_bias;    // Dk (head h's slice of bq), or empty
    ConstMatrixRef<Scalar> key;           // S × Dk
    Scalar scale;
    BatchMask mask;
    mutable MatrixRef<Scalar> scores;             // T × S
    // An upper bound on the distinct features (U) of any call in this pass, when the caller
    // knows one (the layer does): the stage then sizes its per-thread scratch for it once, and
    // a repeated pass allocates nothing whichever thread gets which batch. 0: unknown.
    Index feature_capacity = 0;
  };

  static void can_implement(const Arguments& args) {
    constexpr const char* where = "ScoreKernel";
    if (args.query.cols() != args.key.cols())
      detail::fail<ShapeError>(where, "query has width ", args.query.cols(), " but key has width ",
                               args.key.cols(), "; expected equal key_dim");
    check_scores(where, args.scores, args.query.rows(), args.key.rows(), args.mask);
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

  void operator()(const Arguments& args) const {
    // Keras scales the query, not the product; the scale folds into the GEMM's alpha.
    detail::gemm<Scalar>(detail::as_operand<Scalar>(args.query), detail::transposed<Scalar>(args.key),
                         args.scores, args.scale, false);
    apply_mask<Scalar>(args.mask, args.scores);
  }

  void operator()(const SparseArguments& args) const {
    const auto& query = args.query;
    RegroupScratch& scratch = regroup_scratch();
    const Index width = args.query_kernel.cols(), key_steps = args.key.rows();
    const Index capacity = std::max(args.feature_capacity, Index(0));
    // position[f]: f's row in M, or −1; sized to Eq once per thread and reset after each call.
    std::vector<Index>& position = scratch.position;
    if (position.size() < static_cast<std::size_t>(query.cols))
      position.resize(static_cast<std::size_t>(query.cols), -1);
    // U: the distinct features that these rows use, sorted; only those rows of M are needed.
    std::vector<StorageIndex>& features = scratch.features;
    if (features.capacity() < static_cast<std::size_t>(capacity)) features.reserve(static_cast<std::size_t>(capacity));
    features.clear();
    for (Index row = 0; row < query.rows; ++row)
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k) {
        Index& seen = position[std::size_t(query.column_indices[k])];
        if (seen < 0) {
          seen = 0;
          features.push_back(query.column_indices[k]);
        }
      }
    std::sort(features.begin(), features.end());
    const Index used = static_cast<Index>(features.size());
    for (Index i = 0; i < used; ++i) position[std::size_t(features[i])] = i;
    const Index rows_held = std::max(used, capacity);

    // M = (Wq_h[U] · scale) · Kᵀ, U × S: the query kernel's used rows against every key.
    Eigen::Map<RowMatrix<Scalar>> gathered(grow(scratch.gathered, rows_held * width), used, width);
    for (Index i = 0; i < used; ++i) gathered.row(i) = args.query_kernel.row(features[i]);
    Eigen::Map<RowMatrix<Scalar>> regrouped(grow(scratch.regrouped, rows_held * key_steps), used, key_steps);
    detail::gemm<Scalar>(detail::as_operand<Scalar>(gathered), detail::transposed<Scalar>(args.key),
                         regrouped, args.scale, false);

    if (args.query_bias.size() != 0 && query.rows > 0) {
      // c = (bq_h · scale) · Kᵀ into the first row, then copied to the others.
      const detail::GemmOperand<Scalar> bias_row{args.query_bias.data(), 1, width, width, true};
      detail::gemm<Scalar>(bias_row, detail::transposed<Scalar>(args.key), args.scores.topRows(1),
                           args.scale, false);
      for (Index row = 1; row < query.rows; ++row) args.scores.row(row) = args.scores.row(0);
    } else {
      args.scores.setZero();
    }
    for (Index row = 0; row < query.rows; ++row) {
      auto out = args.scores.row(row);
      for (Index k = query.row_begin(row); k < query.row_end(row); ++k)
        out.noalias() += query.values[k] * regrouped.row(position[std::size_t(query.column_indices[k])]);
    }
    for (const StorageIndex feature : features) position[std::size_t(feature)] = -1;
    apply_mask<Scalar>(args.mask, args.scores);
  }

 private:
  // The regrouped form's working memory, kept per thread and grown, never shrunk, so that the
  // steady state allocates nothing (U varies from batch to batch; Eigen's resize would reallocate).
  struct RegroupScratch {
    std::vector<Index> position;
    std::vector<StorageIndex> features;
    Vector<Scalar> gathered, regrouped;
  };
  static RegroupScratch& regroup_scratch() {
    thread_local RegroupScratch scratch;
    return scratch;
  }
  static Scalar* grow(Vector<Scalar>& buffer, Index size) {
    if (buffer.size() < size) buffer.resize(size);
    return buffer.data();
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

}  // namespace sdmha
