#!/usr/bin/env python3
"""Regenerates the NumPy fixtures in tests/data/npy/ that tests/io/test_io_npy.cpp reads.

Usage (needs numpy; on Debian, python3-numpy):

    python3 tools/testdata/make_npy_test_data.py

Every array is fixed and numpy.savez stamps members with a fixed date, so every file comes out
byte for byte the same for a given numpy version (checked with numpy 1.24). The tests compare
sdmha's .npy writer byte for byte against several of the .npy files and patch bytes of the .npz
archives to build corrupt ones, so regenerate them only together with the tests.

Files:
    f64_2x3.npy, f32_4.npy, f16_5.npy, i32_3.npy, i64_2x2.npy, u8_4.npy, bool_2x2.npy
                            one file per supported descr, written by numpy.save (version 1.0)
    scalar_f64.npy          a 0-d array, shape ()
    empty_0x3.npy           a float32 array with no elements, shape (0, 3)
    v2_i64.npy, v3_f32.npy  format versions 2.0 and 3.0
    fortran.npy             a (2, 3, 4) float64 array stored in Fortran order
    big_endian.npy          '>f8', which sdmha rejects
    complex.npy             '<c16', which sdmha rejects
    arrays.npz              numpy.savez: weights (f64 2x3), ids (i64 [3]), mask (bool 2x2)
    arrays_compressed.npz   numpy.savez_compressed of the same arrays
"""

import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "npy"


def main():
    OUT.mkdir(parents=True, exist_ok=True)

    f64_2x3 = np.arange(6, dtype="<f8").reshape(2, 3) * 0.5 - 1.0
    np.save(OUT / "f64_2x3.npy", f64_2x3)
    np.save(OUT / "f32_4.npy", np.array([1.5, -2.25, 3.0e38, 1e-45], dtype="<f4"))
    np.save(OUT / "f16_5.npy", np.array([1.0, -2.0, 65504.0, 2.0**-24, np.inf], dtype="<f2"))
    np.save(OUT / "i32_3.npy", np.array([-(2**31), 0, 2**31 - 1], dtype="<i4"))
    i64_2x2 = np.array([[-(2**63), 1], [2, 2**63 - 1]], dtype="<i8")
    np.save(OUT / "i64_2x2.npy", i64_2x2)
    np.save(OUT / "u8_4.npy", np.array([0, 1, 128, 255], dtype="|u1"))
    mask = np.array([[True, False], [False, True]])
    np.save(OUT / "bool_2x2.npy", mask)
    np.save(OUT / "scalar_f64.npy", np.array(3.25, dtype="<f8"))
    np.save(OUT / "empty_0x3.npy", np.zeros((0, 3), dtype="<f4"))

    with open(OUT / "v2_i64.npy", "wb") as f:
        np.lib.format.write_array(f, np.array([7, -8, 9], dtype="<i8"), version=(2, 0))
    with open(OUT / "v3_f32.npy", "wb") as f:
        np.lib.format.write_array(f, np.array([0.25, -0.5], dtype="<f4"), version=(3, 0))

    fortran = np.asfortranarray(np.arange(24, dtype="<f8").reshape(2, 3, 4))
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    np.save(OUT / "fortran.npy", fortran)

    np.save(OUT / "big_endian.npy", np.arange(3, dtype=">f8"))
    np.save(OUT / "complex.npy", np.array([1 + 2j], dtype="<c16"))

    ids = np.array([3, -1, 4], dtype="<i8")
    np.savez(OUT / "arrays.npz", weights=f64_2x3, ids=ids, mask=mask)
    np.savez_compressed(OUT / "arrays_compressed.npz", weights=f64_2x3, ids=ids, mask=mask)


if __name__ == "__main__":
    main()
