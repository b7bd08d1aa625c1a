#!/usr/bin/env python3
"""Writes the regression inputs of tests/data/keras/damaged/all_ones_words.txt into a directory,
as seeds of fuzz_keras: each a test file of tests/data/keras with one 8-byte word set to all ones
(for a .keras file, a word of its model.weights.h5, the archive written again, stored, with a
correct CRC). tests/io/test_keras_damaged.cpp makes the same files in C++.

    python3 tests/fuzz/make_keras_seeds.py OUT_DIR
"""
import pathlib
import sys
import zipfile

KERAS = pathlib.Path(__file__).resolve().parents[1] / "data" / "keras"


def damaged(fixture, offset):
    path = KERAS / fixture
    if fixture.endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            members = {name: archive.read(name) for name in archive.namelist()}
        weights = bytearray(members["model.weights.h5"])
    else:
        weights = bytearray(path.read_bytes())
    weights[offset:offset + 8] = b"\xff" * 8
    if not fixture.endswith(".keras"):
        return bytes(weights)
    members["model.weights.h5"] = bytes(weights)
    out = pathlib.Path(sys.argv[1]) / "archive.tmp"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(zipfile.ZipInfo(name, (2000, 1, 1, 0, 0, 0)), data)
    data = out.read_bytes()
    out.unlink()
    return data


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for line in (KERAS / "damaged" / "all_ones_words.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fixture, offset = line.split()[:2]
        (out / f"all_ones_{offset}_{fixture}").write_bytes(damaged(fixture, int(offset)))


if __name__ == "__main__":
    main()
