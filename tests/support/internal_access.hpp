// tests/support/internal_access.hpp — what the tests reach of a layer's private state: its
// streaming sizes, lowered so that small problems stream K and V in several chunks.
//
// Through the library's one door to a layer's private state (sdmha::detail::InternalAccess,
// declared in sdmha/detail/attention_core.hpp and defined only by its users), on a tag of the
// tests' own.
#pragma once

#include "test_support.hpp"  // first: it sets SDMHA_ASSERT before the library is included

namespace sdmha_test {
struct ContextStreamingTag;
}  // namespace sdmha_test

template <>
struct sdmha::detail::InternalAccess<sdmha_test::ContextStreamingTag> {
  // The layer's streaming sizes from now on (ContextStreaming's defaults until set): its forward
  // given key and value streams K and V beyond `streaming.budget_bytes`.
  template <typename Layer>
  static void set(Layer& layer, const ContextStreaming& streaming) {
    layer.core().context_streaming_ = streaming;
  }
};

namespace sdmha_test {
using ContextStreamingHook = sdmha::detail::InternalAccess<ContextStreamingTag>;
}  // namespace sdmha_test
