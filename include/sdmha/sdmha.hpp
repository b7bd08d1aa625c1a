// sdmha/sdmha.hpp — everything of sdmha's core, in pipeline order.
#pragma once

#include "sdmha/config.hpp"  // version, SDMHA_ASSERT, RowMatrix/Vector/Ref aliases
#include "sdmha/errors.hpp"  // Error and its kinds: ShapeError, IndexError, ConfigError, FormatError, IoError
#include "sdmha/sparse_query.hpp"  // SparseQuery: the query as CSR rows (from COO, Eigen, raw CSR)
#include "sdmha/weights.hpp"       // MhaConfig, MhaWeights (Keras layout), glorot_uniform
#include "sdmha/broadcast_ref.hpp"  // BroadcastRef: a mask or bias of (T, S) … (B, H, T, S), a view
#include "sdmha/tensor_ref.hpp"     // TensorRef: the dense key, value (and key mask) as views
#include "sdmha/options.hpp"        // AttentionOptions, DropoutGenerator, Precision, ScoreStrategy
#include "sdmha/attention_result.hpp"   // AttentionResult: what forward returns
#include "sdmha/projected_context.hpp"  // ProjectedContext: K and V projected once, reused
#include "sdmha/context.hpp"  // Context: what forward and backward attend to: {key, value}, projected, or both
#include "sdmha/workspace.hpp"  // Workspace: per-worker memory and threads kept across calls
#include "sdmha/mask.hpp"       // BatchMask and the −∞ convention for blocked scores
#include "sdmha/stage.hpp"      // TilePosition, TileSizes, StageScratch: what every stage is given
#include "sdmha/stages/query_projection.hpp"  // 1. SparseQueryProjection: Q = X·Wq + bq from CSR, and back
#include "sdmha/stages/context_projection.hpp"  // 1'. ContextProjection: K and V (a DenseProjection), and back
#include "sdmha/stages/score_kernel.hpp"  // 2. ScoreKernel: masked scores, project-first or regrouped
#include "sdmha/stages/masked_softmax.hpp"  // 3. MaskedSoftmax: probabilities, fully blocked rows by policy
#include "sdmha/stages/attend_values.hpp"      // 4. AttendValues: P·V per head
#include "sdmha/stages/output_projection.hpp"  // 5. OutputProjection: heads·Wo + bo
#include "sdmha/sparse_dense_mha.hpp"  // SparseDenseMHA: the layer; forward and backward over one plan
#include "sdmha/gradients.hpp"         // MhaGradients: what backward fills
