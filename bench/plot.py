#!/usr/bin/env python3
"""Draws sdmha_bench's numbers: speedup over the dense baseline, and where the time goes.

    sdmha_bench --summary --repetitions 7 --json docs/results/bench.json
    python3 bench/plot.py           # reads docs/results/bench.json, writes docs/bench.png

Needs numpy and matplotlib (Debian: python3-numpy, python3-matplotlib; use /usr/bin/python3 if
another python3 comes first on PATH).

Top row, one panel per workload: speedup (dense with densify / sparse) against the query's
density, per thread count, with the ideal speedup at equal efficiency (the FLOP ratio the
bench reports as *ideal*) dashed. Bottom row: the time of every stage alone, stacked, for the
sparse path and the dense path at each density (one thread by default); the black tick on a bar
is the whole forward pass measured in one piece.
"""

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

STAGES = [
    ("densify", "densify"),
    ("query_projection", "query projection"),
    ("key_value_projection", "key + value projections"),
    ("scores", "scores"),
    ("softmax", "softmax"),
    ("attend_values", "attend values"),
    ("output_projection", "output projection"),
]
COLORS = plt.get_cmap("tab10").colors


def workloads_in_order(runs):
    names = []
    for run in runs:
        if run["workload"] not in names:
            names.append(run["workload"])
    return names


def draw_speedups(axis, runs, workload):
    mine = [r for r in runs if r["workload"] == workload]
    densities = sorted({r["density"] for r in mine})
    ideal = [next(r["ideal_speedup"] for r in mine if r["density"] == d) for d in densities]
    axis.plot(densities, ideal, "k--", marker="_", markersize=14, label="ideal (FLOP ratio)")
    for index, threads in enumerate(sorted({r["threads"] for r in mine})):
        points = sorted((r["density"], r["speedup"]) for r in mine if r["threads"] == threads)
        x, y = np.array(points).T
        axis.plot(x, y, marker="o", color=COLORS[index], label=f"sparse, {threads} thread{'s' if threads > 1 else ''}")
        regrouped = sorted(
            (r["density"], r["forward_ms"]["dense"] / r["forward_ms"]["sparse_regrouped"])
            for r in mine
            if r["threads"] == threads and r["forward_ms"].get("sparse_regrouped") is not None
        )
        if regrouped:
            x, y = np.array(regrouped).T
            axis.plot(x, y, linestyle=":", marker="s", markerfacecolor="none", color=COLORS[index],
                      label=f"regrouped scores, {threads} thread{'s' if threads > 1 else ''}")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xticks(densities)
    axis.set_xticklabels([f"{d:g}" for d in densities])
    axis.minorticks_off()
    if len(densities) == 1:
        axis.set_xlim(densities[0] / 2, densities[0] * 2)
    axis.set_ylim(bottom=0)
    axis.set_xlabel("query density")
    axis.set_ylabel("speedup over densify + dense")
    shape = mine[0]["shape"]
    axis.set_title(f"{workload}: B={shape['B']} T={shape['T']} Eq={shape['Eq']} S={shape['S']}", fontsize=10)
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize=7)


def draw_stage_bars(axis, runs, workload, threads):
    mine = sorted((r for r in runs if r["workload"] == workload and r["threads"] == threads),
                  key=lambda r: r["density"])
    labels, positions = [], []
    width = 0.38
    for group, run in enumerate(mine):
        for offset, path in ((-width / 2 - 0.01, "sparse"), (width / 2 + 0.01, "dense")):
            x = group + offset
            bottom = 0.0
            stages = run["stages_ms"][path]
            for color, (key, label) in zip(COLORS, STAGES):
                value = stages.get(key)
                if value is None:
                    continue
                axis.bar(x, value, width, bottom=bottom, color=color, label=label)
                bottom += value
            whole = run["forward_ms"][path]
            axis.plot([x - width / 2, x + width / 2], [whole, whole], color="black", linewidth=2,
                      label="whole forward, measured in one piece")
            axis.text(x, max(bottom, whole), path, ha="center", va="bottom", fontsize=7)
        labels.append(f"density {run['density']:g}")
        positions.append(group)
    axis.set_xticks(positions)
    axis.set_xticklabels(labels)
    axis.set_ylabel(f"ms, {threads} thread{'s' if threads > 1 else ''}")
    axis.set_title(f"{workload}: stages alone, sparse vs dense", fontsize=10)
    axis.margins(y=0.12)


def main():
    repository = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=pathlib.Path, nargs="?",
                        default=repository / "docs" / "results" / "bench.json",
                        help="the file of sdmha_bench --summary --json")
    parser.add_argument("--out", type=pathlib.Path, default=repository / "docs" / "bench.png")
    parser.add_argument("--threads", type=int, default=1, help="thread count of the stage bars")
    args = parser.parse_args()

    data = json.loads(args.json.read_text(encoding="utf-8"))
    runs = data["runs"]
    workloads = workloads_in_order(runs)
    figure, axes = plt.subplots(2, len(workloads), figsize=(5.2 * len(workloads), 9.5), squeeze=False)
    for column, workload in enumerate(workloads):
        draw_speedups(axes[0][column], runs, workload)
        draw_stage_bars(axes[1][column], runs, workload, args.threads)
    # One legend for the stage bars of every panel, below them.
    handles, labels = axes[1][0].get_legend_handles_labels()
    by_label = dict(zip(labels, handles))
    order = [label for _, label in STAGES] + ["whole forward, measured in one piece"]
    unique = {label: by_label[label] for label in order if label in by_label}
    figure.legend(unique.values(), unique.keys(), loc="lower center", ncol=len(unique), fontsize=8,
                  frameon=False)
    title = "sdmha: sparse query vs densify + dense, float32, median of {} runs{}".format(
        data["repetitions"], " (--quick shapes)" if data.get("quick") else "")
    load = data.get("load_average_before")
    if load is not None:
        title += f"; load average before {load}, after {data.get('load_average_after')}"
    figure.suptitle(title + "\n" + data["machine"]["line"], fontsize=9)
    figure.tight_layout(rect=(0, 0.03, 1, 0.95))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
