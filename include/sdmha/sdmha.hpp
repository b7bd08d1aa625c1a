// sdmha/sdmha.hpp — everything of sdmha's core, in pipeline order.
#pragma once

#include "sdmha/config.hpp"  // version, SDMHA_ASSERT, RowMatrix/Vector/Ref aliases
#include "sdmha/errors.hpp"  // Error and its kinds: ShapeError, IndexError, ConfigError, FormatError, IoError
#include "sdmha/sparse_query.hpp"  // SparseQuery: the query as CSR rows (from COO, Eigen, raw CSR)
#include "sdmha/weights.hpp"       // MhaConfig, MhaWeights (Keras layout), glorot_uniform
#include "sdmha/broadcast_ref.hpp"  // BroadcastRef: a mask or bias of (T, S) … (B, H, T, S), a view
#include "sdmha/options.hpp"    // AttentionOptions, DropoutGenerator, AttentionResult, TensorRef3
#include "sdmha/workspace.hpp"  // Workspace: per-worker memory and threads kept across calls
#include "sdmha/mask.hpp"       // BatchMask and the −∞ convention for blocked scores
#include "sdmha/stage.hpp"      // TilePosition, TileSizes, StageScratch: what every stage is given
#include "sdmha/stages/query_projection.hpp"  // 1. SparseQueryProjection: Q = X·Wq + bq from CSR, and back
#include "sdmha/stages/dense_projection.hpp"  // 1'. DenseProjection: K, V (and the baseline's Q), and back
#include "sdmha/stages/score_kernel.hpp"  // 2. ScoreKernel: masked scores, project-first or regrouped
#include "sdmha/stages/masked_softmax.hpp"  // 3. MaskedSoftmax: probabilities, fully blocked rows by policy
#include "sdmha/stages/attend_values.hpp"      // 4. AttendValues: P·V per head
#include "sdmha/stages/output_projection.hpp"  // 5. OutputProjection: heads·Wo + bo
#include "sdmha/sparse_dense_mha.hpp"  // SparseDenseMHA: the layer, its stages over one plan per call
#include "sdmha/dense_mha.hpp"         // DenseMHA: the dense baseline with the same math
#include "sdmha/gradients.hpp"         // MhaGradients: what backward fills
#include "sdmha/backward.hpp"  // SparseDenseMHA::backward: the stages in reverse over the plan
