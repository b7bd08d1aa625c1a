#!/usr/bin/env python3
"""Merges sdmha_scaling's JSON and peers.py's JSON into one markdown table and one JSON file.

    report.py --sdmha SDMHA.json [--peers PEERS.json] --markdown TABLE.md --json RESULTS.json
              [--note TEXT]...

Standard library only. Per workload and thread count: sdmha's forward and training step (median
ms), its speedup over one thread, the scaling model's prediction, and each peer's median beside
them; "sdmha ahead" is the fastest peer's time over sdmha's (above 1: sdmha is faster).
"""
import argparse
import json


def load(path):
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        return {"error": f"{path}: {error}"}


def peer_rows(peers, name):
    """{(workload, threads): row} of one peer, or {} when it was skipped."""
    section = peers.get(name, {})
    return {(row["workload"], row["threads"]): row for row in section.get("rows", [])}


def cell(value, digits=2, unit=""):
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def ratio(numerator, denominator):
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def merge(sdmha, peers):
    onnx, torch = peer_rows(peers, "onnxruntime"), peer_rows(peers, "torch")
    rows = []
    for workload in sdmha.get("workloads", []):
        name = workload["workload"]
        if workload.get("error"):
            continue
        for step in ("forward", "training"):
            measured = workload[step]["measured_ms"]
            predicted = workload[step].get("predicted_ms", {})
            one = measured.get("1")
            for threads, ms in sorted(measured.items(), key=lambda item: int(item[0])):
                key = (name, int(threads))
                shape = workload.get("shape", {})
                label = f"{name} {workload['density'] * 100:g} %" + \
                    ("" if not shape else " (B {B}, T {T}, S {S})".format(**shape)
                     if workload.get("quick") else "")
                row = {"workload": name, "label": label, "density": workload["density"], "step": step,
                       "threads": int(threads), "sdmha_ms": ms, "sdmha_speedup": ratio(one, ms),
                       "model_ms": predicted.get(threads) if threads != "1" else workload[step].get("model_one_thread_ms"),
                       "model_speedup": ratio(workload[step].get("model_one_thread_ms"),
                                              predicted.get(threads) if threads != "1"
                                              else workload[step].get("model_one_thread_ms")),
                       "onnxruntime_ms": onnx.get(key, {}).get("forward_ms") if step == "forward" else None,
                       "torch_sparse_ms": torch.get(key, {}).get(f"{step}_sparse_ms"),
                       "torch_dense_ms": torch.get(key, {}).get(f"{step}_dense_ms")}
                candidates = [row[k] for k in ("onnxruntime_ms", "torch_sparse_ms", "torch_dense_ms")
                              if row[k] is not None]
                row["fastest_peer_ms"] = min(candidates) if candidates else None
                row["sdmha_ahead"] = ratio(row["fastest_peer_ms"], ms)
                rows.append(row)
    return rows


def markdown(rows, sdmha, peers, notes):
    lines = [f"# sdmha at several thread counts, beside its peers", "",
             f"Host: {sdmha.get('cpu', '?')}, {sdmha.get('hardware_threads', '?')} hardware threads; "
             f"sdmha built with {sdmha.get('flags', '?')}; medians of {sdmha.get('repetitions', '?')} "
             f"(sdmha) and {peers.get('repetitions', '?')} (peers) timed calls, in ms.",
             f"ONNX Runtime {peers.get('onnxruntime', {}).get('version', '(not run: ' + str(peers.get('onnxruntime', {}).get('skipped', 'no peers file')) + ')')}, "
             f"PyTorch {peers.get('torch', {}).get('version', '(not run: ' + str(peers.get('torch', {}).get('skipped', 'no peers file')) + ')')}. "
             "Model = the scaling model's prediction from this host's one-thread item times "
             "(it ignores memory bandwidth and L3 contention); sdmha ahead = fastest peer ÷ sdmha.", ""]
    for note in notes:
        lines += [note, ""]
    for workload in sdmha.get("workloads", []):
        if workload.get("error"):
            lines += [f"**{workload['workload']} failed: {workload['error']}**", ""]
        if not workload.get("bitwise_same", True):
            lines += [f"**{workload['workload']}: results differ between thread counts: "
                      f"{workload.get('bitwise_difference')}**", ""]
    for step, title in (("forward", "Forward"), ("training", "Training step (forward + backward to every weight)")):
        lines += [f"## {title}", ""]
        peers_header = ("ONNX Runtime | " if step == "forward" else "") + "PyTorch sparse | PyTorch dense"
        lines.append(f"| workload | threads | sdmha | speedup | model | model speedup | {peers_header} | sdmha ahead |")
        lines.append("| --- " * (9 + (1 if step == "forward" else 0)) + "|")
        for r in (r for r in rows if r["step"] == step):
            peer_cells = ([cell(r["onnxruntime_ms"])] if step == "forward" else []) + \
                         [cell(r["torch_sparse_ms"]), cell(r["torch_dense_ms"])]
            lines.append(f"| {r['label']} | {r['threads']} | {cell(r['sdmha_ms'])} | "
                         f"{cell(r['sdmha_speedup'], unit='×')} | {cell(r['model_ms'])} | "
                         f"{cell(r['model_speedup'], unit='×')} | " + " | ".join(peer_cells) +
                         f" | {cell(r['sdmha_ahead'], unit='×')} |")
        lines.append("")
    if peers.get("skipped"):
        lines += ["Skipped for the time budget: " + ", ".join(peers["skipped"]), ""]
    for name in ("onnxruntime",):
        for error in peers.get(name, {}).get("errors", []):
            lines += [f"{name} check failed: {error}", ""]
    return "\n".join(lines)


def run(merge_rows, write_markdown, description):
    """The command line both reports share: the two JSON inputs, notes, the table and the JSON
    written, the table printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sdmha", required=True)
    parser.add_argument("--peers")
    parser.add_argument("--markdown", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--note", action="append", default=[])
    args = parser.parse_args()
    sdmha, peers = load(args.sdmha), load(args.peers)
    rows = merge_rows(sdmha, peers)
    notes = args.note + [v for v in (sdmha.get("error"), peers.get("error")) if v]
    with open(args.markdown, "w") as out:
        out.write(write_markdown(rows, sdmha, peers, notes))
    with open(args.json, "w") as out:
        json.dump({"rows": rows, "notes": notes, "sdmha": sdmha, "peers": peers}, out, indent=1)
    print(open(args.markdown).read())


def main():
    run(merge, markdown, __doc__.split("\n")[0])


if __name__ == "__main__":
    main()
