#!/usr/bin/env python3
"""Compare an sdmha-run output file with a reference and report the largest errors.

    python3 tools/cli/sdmha_compare.py RESULT REFERENCE [--tolerance T] [--scores]

RESULT is the safetensors file sdmha-run wrote (tensor `output`, and `attention_scores` with
--scores). REFERENCE is one of
  * a safetensors file holding `expected/output` (and `expected/attention_scores`), or `output`
    (and `attention_scores`), e.g. a golden case or another sdmha-run result;
  * a .npy file holding the framework's output (B, T, O), e.g. np.save("ref.npy", keras_out);
  * an .npz file with arrays `output` (and `attention_scores`).
--name and --reference-name pick other tensors. Each element must satisfy
|got - expected| <= T * (1 + |expected|), the goldens' criterion; T defaults to 1e-10 when the
result is float64 and 2e-5 when it is float32 (loosen it for outputs computed by a framework in
float32 with another order of operations, e.g. --tolerance 1e-4).

Exit status: 0 within tolerance, 1 outside it (or shapes differ), 2 bad usage or unreadable files.
"""

import argparse
import os
import sys

try:
    import numpy as np
except ImportError:
    sys.exit(
        "sdmha_compare.py needs numpy: pip install numpy (Debian: apt-get install python3-numpy)"
    )

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdmha_export import ExportError, read_safetensors  # noqa: E402  (the directory is set above)


def load_reference(path, names):
    """The reference arrays for `names` (result names), from a safetensors, .npy or .npz file."""
    lower = path.lower()
    if lower.endswith(".npy"):
        if len(names) != 1:
            raise ExportError(
                f"{path} holds one array; compare one tensor at a time (drop --scores)"
            )
        return {names[0]: np.load(path, allow_pickle=False)}
    if lower.endswith(".npz"):
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    else:
        arrays, _ = read_safetensors(path)
    found = {}
    for name in names:
        for candidate in (f"expected/{name}", name):
            if candidate in arrays:
                found[name] = arrays[candidate]
                break
        else:
            raise ExportError(
                f"{path} holds neither 'expected/{name}' nor '{name}'; it holds "
                + ", ".join(sorted(arrays))
            )
    return found


def compare(name, got, expected, tolerance):
    """Prints the errors of one tensor; True when every element is within tolerance."""
    if got.shape != expected.shape:
        print(
            f"{name}: shape {got.shape} differs from the reference's {expected.shape}"
            + (
                "; PyTorch with batch_first=False returns (T, B, E): transpose it to (B, T, E)"
                if got.ndim == 3 and got.shape == tuple(np.array(expected.shape)[[1, 0, 2]])
                else ""
            )
        )
        return False
    got64 = got.astype(np.float64)
    expected64 = expected.astype(np.float64)
    absolute = np.abs(got64 - expected64)
    same = (got64 == expected64) | (np.isnan(got64) & np.isnan(expected64))
    absolute = np.where(same, 0.0, np.nan_to_num(absolute, nan=np.inf))
    scaled = absolute / (1.0 + np.abs(expected64))
    relative = absolute / np.maximum(np.abs(expected64), np.finfo(np.float64).tiny)
    outside = int(np.count_nonzero(~(scaled <= tolerance)))
    if got.size == 0:
        print(f"{name}: empty {got.shape}, nothing to compare")
        return True
    worst = np.unravel_index(int(np.argmax(scaled)), got.shape)
    print(
        f"{name}: {got.size} elements {got.shape}, max abs error {absolute.max():.3e}, "
        f"max rel error {relative.max():.3e}, max |error|/(1 + |expected|) {scaled.max():.3e} "
        f"at {tuple(int(i) for i in worst)} "
        f"(got {got64[worst]!r}, expected {expected64[worst]!r}), "
        f"tolerance {tolerance:g}: " + ("pass" if outside == 0 else f"{outside} elements outside")
    )
    return outside == 0


def main(argv=None):
    parser = argparse.ArgumentParser(description="Compare an sdmha-run output with a reference.")
    parser.add_argument("result", help="the safetensors file sdmha-run wrote")
    parser.add_argument("reference", help="a .safetensors, .npy or .npz reference")
    parser.add_argument(
        "--tolerance", type=float, help="T in |got - expected| <= T (1 + |expected|)"
    )
    parser.add_argument("--scores", action="store_true", help="also compare attention_scores")
    parser.add_argument("--name", default="output", help="the result's tensor (default: output)")
    parser.add_argument(
        "--reference-name", help="the reference's tensor (default: expected/NAME or NAME)"
    )
    arguments = parser.parse_args(argv)

    names = [arguments.name] + (["attention_scores"] if arguments.scores else [])
    try:
        result, _ = read_safetensors(arguments.result)
        missing = [name for name in names if name not in result]
        if missing:
            raise ExportError(
                f"{arguments.result} has no tensor {', '.join(missing)}"
                + ("; run sdmha-run with --scores" if "attention_scores" in missing else "")
            )
        if arguments.reference_name:
            reference = load_reference(arguments.reference, [arguments.reference_name])
            reference = {arguments.name: reference[arguments.reference_name]}
            names = [arguments.name]
        else:
            reference = load_reference(arguments.reference, names)
    except (OSError, ValueError) as error:  # ExportError is a ValueError
        print(f"sdmha_compare: error: {error}", file=sys.stderr)
        return 2

    passed = True
    for name in names:
        got = result[name]
        tolerance = arguments.tolerance
        if tolerance is None:
            tolerance = 1e-10 if got.dtype == np.float64 else 2e-5
        passed = compare(name, got, reference[name], tolerance) and passed
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
