"""The extension module chosen at import (sdmha/_kernels.py) and SDMHA_KERNELS.

The choice itself is tested on made-up CPUs (choose() is a pure function); the environment
variable in fresh interpreters, since the choice is made once per process. The forced portable
kernels must give what the chosen ones give, within the suite's float32 and float64 tolerances
(conftest.assert_close): the same layer, other instruction sets and GEMM engines.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import sdmha
from sdmha import _kernels
from conftest import Case, assert_close

AVX512_NEEDS = dict(_kernels.MODULES)["_sdmha_avx512_bf16"]
EVERY_FEATURE = {name: True for name in AVX512_NEEDS}


def test_choose_takes_the_best_module_the_cpu_runs():
    both = {"_sdmha_portable", "_sdmha_avx512_bf16"}
    assert _kernels.choose(both, "auto", EVERY_FEATURE) == "_sdmha_avx512_bf16"
    for missing in AVX512_NEEDS:  # one feature short (say, AVX-512 without AVX512_BF16): portable
        assert _kernels.choose(both, "auto", dict(EVERY_FEATURE, **{missing: False})) == "_sdmha_portable"
    assert _kernels.choose(both, "auto", {}) == "_sdmha_portable"  # no sdmha._cpu, or not x86
    assert _kernels.choose(both, "portable", EVERY_FEATURE) == "_sdmha_portable"
    assert _kernels.choose({"_sdmha_portable"}, "auto", EVERY_FEATURE) == "_sdmha_portable"
    assert _kernels.choose({"_sdmha_native"}, "portable", {}) == "_sdmha_native"  # the only module
    with pytest.raises(ImportError, match="no extension module that this CPU can run"):
        _kernels.choose({"_sdmha_avx512_bf16"}, "auto", {})


def test_kernels_reports_the_module_and_the_engines():
    info = sdmha.kernels()
    assert info["extension"] in ("portable", "avx512_bf16", "native")
    assert info["requested"] == (os.environ.get("SDMHA_KERNELS") or "auto")
    if info["extension"] == "portable":
        assert info["compiled_for"] == [] or "avx512f" not in info["compiled_for"]
        assert (info["float32_gemm"], info["bfloat16_gemm"]) == ("eigen", "portable")
    if info["extension"] == "avx512_bf16":
        assert {"avx512f", "avx512bf16", "fma", "avx2"} <= set(info["compiled_for"])
        assert (info["float32_gemm"], info["bfloat16_gemm"]) == ("avx512", "avx512_bf16")
    features = _kernels.cpu_features()
    if info["extension"] != "native" and features and _installed("_sdmha_avx512_bf16"):
        runs_avx512 = info["requested"] == "auto" and all(features[f] for f in AVX512_NEEDS)
        assert info["extension"] == ("avx512_bf16" if runs_avx512 else "portable")


def _installed(name):
    import importlib.util
    return importlib.util.find_spec(f"sdmha.{name}") is not None


# Runs in a fresh interpreter: a forward and backward of a fixed case, printed as JSON.
_RUN = """
import json, sys, torch, sdmha, sdmha.torch
sys.path.insert(0, {tests!r})
from conftest import Case
torch.set_num_threads(1)
out = {{"kernels": sdmha.kernels()}}
for dtype in (torch.float32, torch.float64):
    case = Case(batch=3, steps=9, features=40, key_steps=33, key_width=24, value_width=20, heads=4, key_dim=16,
                dtype=dtype, seed=35)
    module = case.module()
    values = case.values.clone().requires_grad_(True)
    output = module(case.query(values), case.key, case.value, use_causal_mask=True)
    (output * case.d_output).sum().backward()
    out[str(dtype)] = {{"output": output.detach().double().tolist(), "values": values.grad.double().tolist(),
                        "query_kernel": module.query_kernel.grad.double().tolist()}}
json.dump(out, sys.stdout)
"""


def _run(environment):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **environment)
    done = subprocess.run([sys.executable, "-c", _RUN.format(tests=tests)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_sdmha_kernels_portable_forces_the_portable_module_with_the_same_results():
    chosen = _run({"SDMHA_KERNELS": ""})
    portable = _run({"SDMHA_KERNELS": "portable"})
    info = portable["kernels"]
    assert info["requested"] == "portable"
    if info["extension"] == "native":  # a native build has one module: its GEMMs switch instead
        assert (info["float32_gemm"], info["bfloat16_gemm"]) == ("eigen", "portable")
    else:
        assert info["extension"] == "portable"
        assert (info["float32_gemm"], info["bfloat16_gemm"], info["compiled_for"]) == ("eigen", "portable", [])
    for dtype in (torch.float32, torch.float64):
        for name in ("output", "values", "query_kernel"):
            assert_close(torch.tensor(portable[str(dtype)][name]), torch.tensor(chosen[str(dtype)][name]), dtype,
                         f"{dtype} {name}, portable vs {chosen['kernels']['extension']}")


def test_an_unknown_sdmha_kernels_value_is_refused_naming_the_variable():
    env = dict(os.environ, SDMHA_KERNELS="avx9000")
    done = subprocess.run([sys.executable, "-c", "import sdmha"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "SDMHA_KERNELS = 'avx9000'" in done.stderr and "'portable'" in done.stderr
