// tests/reference/reference_mha.hpp — a naive dense multi-head attention in float64.
//
// Written from the math in tests/data/goldens/README.md with plain loops over std::vector and
// never calling sdmha: it is the twin that every stage and the layer are checked against. Slow on
// purpose, so that it is obviously right.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace sdmha_reference {

struct Problem {
  long batch = 0, steps = 0, key_steps = 0;              // B, T, S
  long query_dim = 0, key_in_dim = 0, value_in_dim = 0;  // Eq, Ek, Ev
  long heads = 0, key_dim = 0, value_dim = 0, output_dim = 0;
  std::vector<double> query;  // B·T·Eq, dense
  std::vector<double> key;    // B·S·Ek
  std::vector<double> value;  // B·S·Ev
  // Kernels in Keras' flattened layout (E × H·D, H·Dv × O); biases empty when absent.
  std::vector<double> query_kernel, query_bias, key_kernel, key_bias;
  std::vector<double> value_kernel, value_bias, output_kernel, output_bias;
  std::vector<char> attention_mask;  // B·T·S, 1 = may attend; empty = none
  std::vector<char> key_mask;        // B·S, 1 = key step may be attended; empty = none
  // A mask broadcast over the batch and heads, ANDed with the others: (B', H', T, S) with
  // B' ∈ {1, B}, H' ∈ {1, H}, 1 = may attend; empty = none.
  std::vector<char> broadcast_mask;
  long mask_batch = 1, mask_heads = 1;  // B', H' of broadcast_mask
  // Added to the scaled scores before the softmax, score = scale·q·k + bias, (B', H', T, S)
  // broadcast like broadcast_mask; empty = none. A blocked position stays −∞ whatever its bias;
  // a −∞ bias blocks.
  std::vector<double> attention_bias;
  long bias_batch = 1, bias_heads = 1;  // B', H' of attention_bias
  bool causal = false;
  long causal_offset = 0;             // causal: s <= t + causal_offset (bottom-right: S − T)
  double scale = 0.0;                 // the scores' factor; 0 means 1/sqrt(key_dim)
  bool uniform_fully_masked = false;  // a row with every key blocked: 1/S on every key
  // A model of sdmha's bfloat16 mode: operands rounded (round_to_bfloat16) where they meet their
  // products. bfloat16_projections: the four kernels, and the key, the value and the heads as
  // inputs of their projections (not the query's values); bfloat16_attention: scale·q and k in
  // the scores, p and v in the heads.
  bool bfloat16_projections = false, bfloat16_attention = false;
  // With bfloat16_attention and online_key_tile > 0: the online softmax's P·V, which rounds
  // unnormalised probabilities — per key tile j of this width, p = exp(score − m_j) with m_j the
  // largest score up to tile j, rounded; the partial heads and the sum of the (unrounded) p
  // rescaled by exp(m_{j−1} − m_j); the heads divided by that sum at the end.
  long online_key_tile = 0;
};

// x as a float, then rounded to the nearest bfloat16 (8 significant bits, ties to even), as a
// double; NaN stays NaN and ±∞ stays ±∞.
inline double round_to_bfloat16(double x) {
  float value = static_cast<float>(x);
  if (std::isnan(value)) return x;
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // half of the dropped part, plus one on a tie to odd
  bits &= 0xFFFF0000u;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}
inline double rounded_if(bool round, double x) { return round ? round_to_bfloat16(x) : x; }

struct Result {
  std::vector<double> query;          // projected, B·T·H·Dk
  std::vector<double> key;            // projected, B·S·H·Dk
  std::vector<double> value;          // projected, B·S·H·Dv
  std::vector<double> scores;         // B·H·T·S, scaled plus bias, blocked = −∞
  std::vector<double> probabilities;  // B·H·T·S
  std::vector<double> heads;          // B·T·H·Dv
  std::vector<double> output;         // B·T·O
};

// rows × in  ·  in × out  (+ bias), the input's and the kernel's entries rounded if asked
inline std::vector<double> project(const std::vector<double>& input, long rows, long in,
                                   const std::vector<double>& kernel,
                                   const std::vector<double>& bias, long out,
                                   bool round_input = false, bool round_kernel = false) {
  std::vector<double> result(static_cast<std::size_t>(rows * out), 0.0);
  for (long r = 0; r < rows; ++r)
    for (long o = 0; o < out; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (long i = 0; i < in; ++i)
        sum += rounded_if(round_input, input[r * in + i]) *
               rounded_if(round_kernel, kernel[i * out + o]);
      result[r * out + o] = sum;
    }
  return result;
}

inline bool allowed(const Problem& p, long b, long t, long s) {
  if (p.causal && s > t + p.causal_offset) return false;
  if (!p.key_mask.empty() && !p.key_mask[b * p.key_steps + s]) return false;
  if (!p.attention_mask.empty() && !p.attention_mask[(b * p.steps + t) * p.key_steps + s])
    return false;
  return true;
}

// Element (b, h, t, s) of a (B', H', T, S) tensor broadcast to (B, H, T, S).
inline long broadcast_index(long batch, long heads, const Problem& p, long b, long h, long t,
                            long s) {
  return (((batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h)) * p.steps + t) * p.key_steps + s;
}

// Every mask, the per-head broadcast mask included (a −∞ bias blocks too: see forward).
inline bool allowed(const Problem& p, long b, long h, long t, long s) {
  if (!allowed(p, b, t, s)) return false;
  return p.broadcast_mask.empty() ||
         p.broadcast_mask[broadcast_index(p.mask_batch, p.mask_heads, p, b, h, t, s)] != 0;
}

inline double bias_at(const Problem& p, long b, long h, long t, long s) {
  return p.attention_bias.empty()
             ? 0.0
             : p.attention_bias[broadcast_index(p.bias_batch, p.bias_heads, p, b, h, t, s)];
}

// Row t's heads (Dv values at `heads`) by the online softmax of Problem::online_key_tile, from its
// scores (−∞ where blocked) and the projected values of its batch entry and head.
inline void online_heads(const Problem& p, const double* score, const double* values, long stride,
                         double* heads) {
  const long S = p.key_steps, Dv = p.value_dim, tile = p.online_key_tile;
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  std::vector<double> sum_pv(static_cast<std::size_t>(Dv), 0.0);
  double maximum = minus_infinity, sum = 0.0;
  for (long first = 0; first < S; first += tile) {
    const long last = first + tile < S ? first + tile : S;
    double next = maximum;
    for (long s = first; s < last; ++s) next = score[s] > next ? score[s] : next;
    if (next == minus_infinity) continue;
    const double correction = maximum == minus_infinity ? 0.0 : std::exp(maximum - next);
    sum *= correction;
    for (double& x : sum_pv) x *= correction;
    for (long s = first; s < last; ++s) {
      if (score[s] == minus_infinity) continue;
      const double e = std::exp(score[s] - next);
      sum += e;
      for (long d = 0; d < Dv; ++d)
        sum_pv[d] += round_to_bfloat16(e) * round_to_bfloat16(values[s * stride + d]);
    }
    maximum = next;
  }
  for (long d = 0; d < Dv; ++d) heads[d] = sum > 0.0 ? sum_pv[d] / sum : 0.0;
}

inline Result forward(const Problem& p) {
  const long B = p.batch, T = p.steps, S = p.key_steps, H = p.heads, Dk = p.key_dim,
             Dv = p.value_dim, O = p.output_dim;
  Result r;
  const bool round = p.bfloat16_projections, round_attention = p.bfloat16_attention;
  r.query =
      project(p.query, B * T, p.query_dim, p.query_kernel, p.query_bias, H * Dk, false, round);
  r.key = project(p.key, B * S, p.key_in_dim, p.key_kernel, p.key_bias, H * Dk, round, round);
  r.value =
      project(p.value, B * S, p.value_in_dim, p.value_kernel, p.value_bias, H * Dv, round, round);
  const double scale = p.scale != 0.0 ? p.scale : 1.0 / std::sqrt(double(Dk));
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  r.scores.assign(static_cast<std::size_t>(B * H * T * S), 0.0);
  r.probabilities.assign(r.scores.size(), 0.0);
  r.heads.assign(static_cast<std::size_t>(B * T * H * Dv), 0.0);
  for (long b = 0; b < B; ++b)
    for (long h = 0; h < H; ++h)
      for (long t = 0; t < T; ++t) {
        double* score = r.scores.data() + ((b * H + h) * T + t) * S;
        double* probability = r.probabilities.data() + ((b * H + h) * T + t) * S;
        double row_max = minus_infinity;
        bool has_nan = false;  // a NaN score makes its row NaN, as the library's softmax does
        for (long s = 0; s < S; ++s) {
          const double bias = bias_at(p, b, h, t, s);
          if (!allowed(p, b, h, t, s) || bias == minus_infinity) {  // a −∞ bias blocks as a mask
            score[s] = minus_infinity;
            continue;
          }
          double dot = 0.0;
          for (long d = 0; d < Dk; ++d)
            dot += rounded_if(round_attention, r.query[(b * T + t) * H * Dk + h * Dk + d] * scale) *
                   rounded_if(round_attention, r.key[(b * S + s) * H * Dk + h * Dk + d]);
          dot += bias;  // NaN, +∞ propagate
          score[s] = dot;
          has_nan = has_nan || std::isnan(dot);
          if (dot > row_max) row_max = dot;
        }
        if (has_nan && row_max == minus_infinity) {  // only NaN besides blocked scores: NaN row
          for (long s = 0; s < S; ++s) probability[s] = std::numeric_limits<double>::quiet_NaN();
        } else if (row_max == minus_infinity) {
          if (!p.uniform_fully_masked) continue;  // probabilities stay 0
          for (long s = 0; s < S; ++s) probability[s] = 1.0 / double(S);
        } else {
          double total = 0.0;
          for (long s = 0; s < S; ++s) {
            probability[s] = score[s] == minus_infinity ? 0.0 : std::exp(score[s] - row_max);
            total += probability[s];
          }
          for (long s = 0; s < S; ++s) probability[s] /= total;
        }
        if (round_attention && p.online_key_tile > 0) {
          online_heads(p, score, r.value.data() + b * S * H * Dv + h * Dv, H * Dv,
                       r.heads.data() + (b * T + t) * H * Dv + h * Dv);
          continue;
        }
        for (long d = 0; d < Dv; ++d) {
          double sum = 0.0;
          for (long s = 0; s < S; ++s)
            if (probability[s] != 0.0)
              sum += rounded_if(round_attention, probability[s]) *
                     rounded_if(round_attention, r.value[(b * S + s) * H * Dv + h * Dv + d]);
          r.heads[(b * T + t) * H * Dv + h * Dv + d] = sum;
        }
      }
  r.output = project(r.heads, B * T, H * Dv, p.output_kernel, p.output_bias, O, round, round);
  return r;
}

}  // namespace sdmha_reference
