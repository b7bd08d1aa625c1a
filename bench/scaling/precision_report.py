#!/usr/bin/env python3
"""Puts `sdmha_scaling --precision bfloat16`'s JSON and peers.py's JSON in one markdown table.

    precision_report.py --sdmha PRECISION.json [--peers PEERS.json] --markdown TABLE.md
                        --json RESULTS.json [--note TEXT]...

Standard library only (report.py's helpers). Per workload and thread count: sdmha's float32
forward, its bfloat16 forward on each engine asked for (SDMHA_BFLOAT16_GEMMS = off, on, onednn,
amx, ...) with its speedup over float32, ONNX Runtime's and PyTorch's forward (peers.py), and the
fastest bfloat16 engine against ONNX Runtime; then per workload and engine what set_precision
chose or why it refused, the error against the float32 output and whether every thread count gave
the same bits. Medians in ms.
"""
from report import cell, peer_rows, ratio, run


def accepted(workload):
    """The bfloat16 variants that ran (not refused), by their SDMHA_BFLOAT16_GEMMS value."""
    return [v for v in workload.get("variants", [])[1:] if not v.get("refused")]


def merge(sdmha, peers):
    onnx, torch = peer_rows(peers, "onnxruntime"), peer_rows(peers, "torch")
    rows = []
    for workload in sdmha.get("workloads", []):
        if workload.get("error"):
            continue
        name = workload["workload"]
        float32 = workload["variants"][0]
        for threads, ms in sorted(float32["forward_ms"].items(), key=lambda item: int(item[0])):
            key = (name, int(threads))
            bfloat16 = {v["gemms"]: v["forward_ms"].get(threads) for v in accepted(workload)}
            timed = {gemms: t for gemms, t in bfloat16.items() if t is not None}
            best = min(timed, key=timed.get) if timed else None
            row = {"workload": name, "density": workload["density"], "threads": int(threads),
                   "quick": workload.get("quick", False), "shape": workload.get("shape", {}),
                   "float32_ms": ms, "bfloat16_ms": bfloat16,
                   "bfloat16_speedup": {g: ratio(ms, t) for g, t in bfloat16.items()},
                   "best_bfloat16": best, "best_bfloat16_ms": timed.get(best),
                   "onnxruntime_ms": onnx.get(key, {}).get("forward_ms"),
                   "torch_dense_ms": torch.get(key, {}).get("forward_dense_ms"),
                   "torch_sparse_ms": torch.get(key, {}).get("forward_sparse_ms")}
            row["onnxruntime_over_best_bfloat16"] = ratio(row["onnxruntime_ms"], row["best_bfloat16_ms"])
            row["onnxruntime_over_float32"] = ratio(row["onnxruntime_ms"], ms)
            rows.append(row)
    return rows


def scientific(value):
    return "–" if value is None else f"{value:.2e}"


def label(row):
    text = f"{row['workload']} {row['density'] * 100:g} %"
    if row["quick"] and row["shape"]:
        text += " (B {B}, T {T}, S {S})".format(**row["shape"])
    return text


def markdown(rows, sdmha, peers, notes):
    engines = []
    for workload in sdmha.get("workloads", []):
        for variant in workload.get("variants", [])[1:]:
            if variant["gemms"] not in engines:
                engines.append(variant["gemms"])
    onnx, torch = peers.get("onnxruntime", {}), peers.get("torch", {})
    lines = ["# sdmha's forward in float32 and bfloat16, beside ONNX Runtime and PyTorch", "",
             f"Host: {sdmha.get('cpu', '?')}, {sdmha.get('hardware_threads', '?')} hardware threads; "
             f"CPU flags: {sdmha.get('cpu_flags', '?')}; {sdmha.get('onednn', '?')}. "
             f"sdmha built with {sdmha.get('flags', '?')}; medians of {sdmha.get('repetitions', '?')} "
             f"(sdmha, every layer and thread count interleaved in one process) and "
             f"{peers.get('repetitions', '?')} (peers) timed forwards, in ms.",
             f"ONNX Runtime {onnx.get('version', '(not run: ' + str(onnx.get('skipped', 'no peers file')) + ')')} "
             "(the faster of its keras and matmul graphs on the densified query), "
             f"PyTorch {torch.get('version', '(not run: ' + str(torch.get('skipped', 'no peers file')) + ')')} "
             "(dense: the densified query; sparse: torch.sparse.mm); their inputs are numpy's, the work the same.",
             "bfloat16 columns: `set_precision(Precision::bfloat16)` with SDMHA_BFLOAT16_GEMMS = that value "
             "(off: the GEMM stages in float32, Wq in bfloat16; on: the vdpbf16ps pairs engine; onednn: "
             "oneDNN's matmul for the projections; amx: the library's AMX tiles for every GEMM stage; "
             "amx-emulated: those tiles emulated, for checking only), each cell "
             "`ms (float32 ÷ bfloat16)`; ORT ÷ bf16: ONNX Runtime's time over the fastest bfloat16 "
             "engine's (above 1: sdmha is faster).", ""]
    for note in notes:
        lines += [note, ""]
    for workload in sdmha.get("workloads", []):
        if workload.get("error"):
            lines += [f"**{workload['workload']} failed: {workload['error']}**", ""]
    header = ["workload", "threads", "float32"] + [f"bf16 {e}" for e in engines] + \
             ["fastest bf16", "ONNX Runtime", "PyTorch dense", "PyTorch sparse", "ORT ÷ bf16", "ORT ÷ float32"]
    lines += ["## Forward, median ms", "", "| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    for r in rows:
        cells = [label(r), str(r["threads"]), cell(r["float32_ms"])]
        for engine in engines:
            if engine not in r["bfloat16_ms"]:
                cells.append("refused")
            else:
                ms = r["bfloat16_ms"][engine]
                cells.append(f"{cell(ms)} ({cell(r['bfloat16_speedup'][engine], unit='×')})")
        cells += [r["best_bfloat16"] or "–", cell(r["onnxruntime_ms"]), cell(r["torch_dense_ms"]),
                  cell(r["torch_sparse_ms"]), cell(r["onnxruntime_over_best_bfloat16"], unit="×"),
                  cell(r["onnxruntime_over_float32"], unit="×")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## The bfloat16 engines", "",
              "Error: max |y − y_float32| ÷ max |y_float32| over the whole output (one thread).", "",
              "| workload | SDMHA_BFLOAT16_GEMMS | engine chosen | error | same bits at every thread count |",
              "| --- | --- | --- | --- | --- |"]
    for workload in sdmha.get("workloads", []):
        for v in workload.get("variants", [])[1:]:
            name = f"{workload['workload']} {workload['density'] * 100:g} %"
            if v.get("refused"):
                lines.append(f"| {name} | {v['gemms']} | refused: {v['refused']} | – | – |")
            else:
                same = "yes" if v.get("thread_invariant") else f"**no: {v.get('thread_difference')}**"
                lines.append(f"| {name} | {v['gemms']} | {v['engine']} | "
                             f"{scientific(v.get('max_relative_error'))} | {same} |")
    lines.append("")
    if peers.get("skipped"):
        lines += ["Peers skipped for the time budget: " + ", ".join(peers["skipped"]), ""]
    for error in onnx.get("errors", []):
        lines += [f"onnxruntime check failed: {error}", ""]
    return "\n".join(lines)


def main():
    run(merge, markdown, __doc__.split("\n")[0])


if __name__ == "__main__":
    main()
