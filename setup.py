"""The CMake build step of `pip install .` (pyproject.toml holds the metadata).

setuptools builds the pure-Python files of python/sdmha; the extension modules come from the
project's own CMake tree (python/CMakeLists.txt): configured for this interpreter with only the
Python package on (no tests, bench, examples or tools), its target `_sdmha` built, and every
module it puts in <cmake build>/python/sdmha copied next to the .py files. Build-time settings,
from the environment:

  SDMHA_PYTHON_KERNELS    dispatch (the default: portable + AVX-512 modules, chosen at import),
                          native (-march=native, this CPU only) or portable
  SDMHA_CMAKE_BUILD_DIR   the CMake build directory (default: build-python/ in the source tree;
                          kept between builds, so a rebuild compiles only what changed). An
                          existing tree (say, build/) keeps its own settings and targets
  SDMHA_CMAKE_ARGS        more arguments for the configure step, split on spaces
  CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_CXX_COMPILER_LAUNCHER (e.g. ccache): read by CMake itself
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """The extension modules of python/CMakeLists.txt: no sources for setuptools to compile."""

    def __init__(self):
        super().__init__("sdmha._sdmha_portable", sources=[])


def _pybind11_arguments():
    try:
        import pybind11
    except ImportError:  # CMake may still find pybind11-dev's own configuration
        return []
    return [f"-DSDMHA_PYBIND11_HINT={pybind11.get_cmake_dir()}"]


def _check_version():
    cmake = (SOURCE / "CMakeLists.txt").read_text()
    found = re.search(r"project\(sdmha VERSION ([0-9.]+)", cmake)
    meta = re.search(r'^version = "([0-9.]+)"', (SOURCE / "pyproject.toml").read_text(), re.MULTILINE)
    if not found or not meta or found.group(1) != meta.group(1):
        raise RuntimeError(f"sdmha: pyproject.toml's version {meta and meta.group(1)} is not CMakeLists.txt's "
                           f"{found and found.group(1)}; make them agree")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        _check_version()
        build = pathlib.Path(os.environ.get("SDMHA_CMAKE_BUILD_DIR", SOURCE / "build-python")).resolve()
        configure = ["cmake", "-S", str(SOURCE), "-B", str(build), "-DSDMHA_BUILD_PYTHON=ON",
                     f"-DSDMHA_PYTHON_EXECUTABLE={sys.executable}", f"-DPython3_EXECUTABLE={sys.executable}"]
        if not (build / "CMakeCache.txt").exists():
            # A tree of its own: the package only. A configured tree (SDMHA_CMAKE_BUILD_DIR) keeps
            # its settings, so that its compiled modules stay up to date and are not rebuilt.
            configure += ["-DCMAKE_BUILD_TYPE=Release", "-DSDMHA_BUILD_TESTS=OFF", "-DSDMHA_BUILD_BENCH=OFF",
                          "-DSDMHA_BUILD_EXAMPLES=OFF", "-DSDMHA_BUILD_TOOLS=OFF", "-DSDMHA_INSTALL=OFF",
                          *_pybind11_arguments()]
        if "SDMHA_PYTHON_KERNELS" in os.environ:
            configure.append(f"-DSDMHA_PYTHON_KERNELS={os.environ['SDMHA_PYTHON_KERNELS']}")
        configure += os.environ.get("SDMHA_CMAKE_ARGS", "").split()
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "_sdmha"], check=True)
        modules = sorted((build / "python" / "sdmha").glob("_*.so")) + sorted(
            (build / "python" / "sdmha").glob("_*.pyd"))
        if not any(path.name.startswith("_sdmha") for path in modules):
            raise RuntimeError(f"sdmha: the CMake build in {build} made no extension module; its configure "
                               "output above says why (Python headers, pybind11 or Eigen missing?)")
        destination = pathlib.Path(self.get_ext_fullpath(ext.name)).parent
        destination.mkdir(parents=True, exist_ok=True)
        for path in modules:
            shutil.copy2(path, destination / path.name)


setup(ext_modules=[CMakeExtension()], cmdclass={"build_ext": CMakeBuild},
      options={"build": {"build_base": "build-python/setuptools"}})
