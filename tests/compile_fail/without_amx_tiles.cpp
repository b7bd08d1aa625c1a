// tests/compile_fail/without_amx_tiles.cpp — compiled (never run) by the `compile.amx_tiles.*`
// tests of tests/CMakeLists.txt, once per macro setting:
//
//   SDMHA_NO_AMX_TILES   the library without its AMX tile engine (what the CMake target defines
//                        where the assembler takes no AMX)                    → must compile
//   (none)               on x86-64 with GCC or Clang the engine is there     → must fail, with
//                        the static_assert below
//
// Without the tiles every header still compiles, the emulated tiles stay (the tests' path), and
// the CPU's tiles are never usable.
#include <sdmha/sdmha.hpp>

#include "sdmha/detail/gemm_amx.hpp"

static_assert(!sdmha::detail::kHaveAmxTiles, "SDMHA_NO_AMX_TILES leaves the tiles out");
#if defined(SDMHA_NO_AMX_TILES) && defined(SDMHA_HAVE_AMX_TILES)
#error "SDMHA_HAVE_AMX_TILES is defined under SDMHA_NO_AMX_TILES"
#endif

int main() {
  sdmha::detail::amx::EmulatedTiles emulated;
  emulated.configure();
  return sdmha::detail::amx_tiles_verified() ? 1 : 0;
}
