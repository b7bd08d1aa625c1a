"""The choice of extension module, made once at import.

The binding is compiled once per instruction set (python/CMakeLists.txt): ``_sdmha_portable``
(the compiler's baseline: any x86-64), ``_sdmha_avx512_bf16`` (AVX-512 F/CD/BW/DQ/VL, AVX512_BF16,
AVX2, FMA, ...), or, in a build configured with ``SDMHA_PYTHON_KERNELS=native``, ``_sdmha_native``
alone. Exactly one is imported: they register the same C++ types with pybind11.

The environment variable ``SDMHA_KERNELS`` decides, read here once:

* unset, empty or ``auto``: the AVX-512 module when it is installed and the CPU (and its operating
  system) has every feature it was compiled for, else the portable one;
* ``portable``: the portable module; in a native build (which has no other) its GEMMs run their
  portable paths instead (sdmha/kernels.hpp reads the same variable).
"""

import importlib
import importlib.util
import os

#: The modules a build may hold, the preferred first, each with the CPU features it needs.
MODULES = (
    ("_sdmha_native", ()),
    ("_sdmha_avx512_bf16", ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512bf16",
                            "avx2", "avx", "fma", "f16c", "bmi", "bmi2", "lzcnt", "popcnt", "movbe",
                            "sse4.2", "ssse3")),
    ("_sdmha_portable", ()),
)
CHOICES = ("auto", "portable")


def requested():
    """SDMHA_KERNELS as given ('auto' when unset or empty); ValueError for a value not in CHOICES."""
    value = os.environ.get("SDMHA_KERNELS", "").strip() or "auto"
    if value not in CHOICES:
        raise ValueError(f"sdmha: the environment variable SDMHA_KERNELS = {value!r}; expected one of "
                         f"{CHOICES} (or unset): 'portable' forces the kernels that run on any CPU")
    return value


def cpu_features():
    """{feature: bool} of this CPU (sdmha._cpu), {} when the module is not there."""
    if importlib.util.find_spec(f"{__package__}._cpu") is None:
        return {}
    return dict(importlib.import_module(f"{__package__}._cpu").features())


def choose(installed, request, features):
    """The module to import: the first of MODULES that is installed and allowed.

    `installed` is the set of module names present, `request` requested()'s value, `features`
    cpu_features()'s. A native build is taken whatever the request (it is the only module); the
    portable request skips the AVX-512 module, and so does a CPU without one of its features."""
    for name, needs in MODULES:
        if name not in installed:
            continue
        if needs and (request == "portable" or not all(features.get(f, False) for f in needs)):
            continue
        return name
    raise ImportError(f"sdmha: no extension module that this CPU can run is installed (found: "
                      f"{sorted(installed) or 'none'}); rebuild the package (docs/python.md)")


def load():
    """(module, name): the chosen extension module, imported."""
    request = requested()
    installed = {name for name, _ in MODULES if importlib.util.find_spec(f"{__package__}.{name}") is not None}
    if not installed:
        raise ImportError("sdmha: the compiled extension (sdmha._sdmha_*) is not there; build it with CMake "
                          "(docs/python.md) and put <build>/python on PYTHONPATH, or install the package "
                          "with pip")
    name = choose(installed, request, cpu_features() if "_sdmha_avx512_bf16" in installed else {})
    return importlib.import_module(f"{__package__}.{name}"), name
