// sdmha/detail/dropout.hpp — the dropout mask on the attention probabilities, as a pure function
// of (seed, b, h, t, s).
//
// Keras applies dropout to the probabilities after the softmax (the returned scores are before
// it). Here a probability is kept when a 64-bit hash of its coordinates and the seed falls below
// (1 − rate)·2⁶⁴, and a kept one is scaled by 1/(1 − rate) so that the expectation is unchanged.
// Being a function of the coordinates, the mask is the same in forward and backward, for any
// tiling and any thread count.
#pragma once

#include <cstdint>

#include "sdmha/config.hpp"

namespace sdmha::detail {

// SplitMix64's finaliser: a bijective mix with full avalanche, enough for a Bernoulli draw.
inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

class DropoutMask {
 public:
  DropoutMask() = default;
  DropoutMask(double rate, std::uint64_t seed) : rate_(rate), seed_(seed) {
    const double keep = 1.0 - rate;
    // keep ∈ (0, 1]: the threshold on the hash; keep = 1 keeps everything.
    threshold_ = keep >= 1.0 ? ~std::uint64_t(0) : std::uint64_t(keep * 18446744073709551616.0);
    scale_ = rate > 0.0 ? 1.0 / keep : 1.0;
  }

  bool active() const { return rate_ > 0.0; }
  double scale() const { return scale_; }

  // The hash of one (b, h) pair; per-entry draws then mix in t and s.
  std::uint64_t head_key(Index b, Index h) const {
    return mix64(seed_ ^ mix64(std::uint64_t(b) * 0x9e3779b97f4a7c15ULL + std::uint64_t(h)));
  }
  bool keep(std::uint64_t head_key, Index t, Index s) const {
    if (rate_ <= 0.0) return true;
    const std::uint64_t draw =
        mix64(head_key + mix64(std::uint64_t(t) * 0xd1b54a32d192ed03ULL + std::uint64_t(s)));
    return threshold_ == ~std::uint64_t(0) || draw < threshold_;
  }

  // probabilities (rows × cols) of block (b, h) starting at (first_step, first_key_step):
  // dropped entries to 0, kept ones scaled by 1/(1 − rate).
  template <typename Block>
  void apply(Block& probabilities, Index b, Index h, Index first_step, Index first_key_step) const {
    if (!active()) return;
    const std::uint64_t key = head_key(b, h);
    using Scalar = typename Block::Scalar;
    const Scalar kept_scale = Scalar(scale_);
    for (Index t = 0; t < probabilities.rows(); ++t)
      for (Index s = 0; s < probabilities.cols(); ++s)
        probabilities(t, s) = keep(key, first_step + t, first_key_step + s)
                                  ? probabilities(t, s) * kept_scale
                                  : Scalar(0);
  }

 private:
  double rate_ = 0.0;
  std::uint64_t seed_ = 0;
  std::uint64_t threshold_ = ~std::uint64_t(0);
  double scale_ = 1.0;
};

}  // namespace sdmha::detail
