#!/usr/bin/env node
// ONNX Runtime peer for sdmha_bench, step 2 of 2: times the graphs that onnx_peer.py wrote, with the
// npm package onnxruntime-node (CPU execution provider), the way a user without sdmha would deploy
// the Keras MultiHeadAttention layer on a densified query.
//
//   cd bench/peers && ONNXRUNTIME_NODE_INSTALL=skip npm install      # onnxruntime-node from package.json
//   node bench/peers/onnx_peer.mjs [--dir /tmp/sdmha_onnx] [--threads 1,2] [--repetitions 20]
//        [--warmup 3] [--graphs keras,matmul,mha] [--workloads seed,bow,long] [--json FILE] [--check]
//        [--wait-idle SECONDS] [--retries N]
//
// First it runs the three graphs of the small "check" case and prints their largest error against
// onnx_peer.py's float64 numpy reference (max |y - ref| / max |ref|); a graph off by more than 1e-4
// stops the run (--check: only this). Then, for every workload × density × graph × thread count, a
// fresh node process (this file with --child) creates the session (intraOpNumThreads = threads,
// interOpNumThreads = 1, graphOptimizationLevel 'all', executionMode 'sequential'), runs it
// --warmup times, times --repetitions runs of session.run (inputs already in tensors; the times
// include copying the (B, T, O) output into JavaScript), compares the output's batch element 0
// with the float64 reference, and reports the median and minimum in ms and its memory from
// /proc/self/status: VmRSS once ONNX Runtime is loaded, the bytes of the inputs, and VmHWM (peak
// resident set) after the runs. One process a graph makes the peak that graph's own. It also
// reports how many cores other processes kept busy during the timed runs (from /proc/stat): times
// taken beside a compiler are worth little. --wait-idle S waits up to S seconds before each line
// until other processes have used less than 0.1 core for 3 seconds; --retries N takes a line again,
// up to N times, while others used more than 0.1 core during it, and keeps the least disturbed.
import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { availableParallelism } from "node:os";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const ort = require("onnxruntime-node");

function parseArgs(argv) {
  const args = { dir: "/tmp/sdmha_onnx", threads: "1,2", repetitions: 20, warmup: 3,
                 graphs: "keras,matmul,mha", workloads: "", json: "", check: false, child: "",
                 "wait-idle": 0, retries: 0 };
  for (let i = 0; i < argv.length; ++i) {
    const name = argv[i].replace(/^--/, "");
    if (!(name in args)) throw new Error(`unknown option ${argv[i]}`);
    if (typeof args[name] === "boolean") args[name] = true;
    else if (typeof args[name] === "number") args[name] = Number(argv[++i]);
    else args[name] = argv[++i];
  }
  return args;
}

function procStatus() {
  const text = readFileSync("/proc/self/status", "utf8");
  const kb = (key) => Number(new RegExp(`^${key}:\\s+(\\d+) kB`, "m").exec(text)[1]);
  return { rssMB: kb("VmRSS") / 1024, hwmMB: kb("VmHWM") / 1024 };
}

// Busy and total jiffies of the whole machine (/proc/stat), and this process's own CPU jiffies
// (/proc/self/stat utime + stime, all threads), to tell how much of the machine others used.
function cpuJiffies() {
  const cpu = readFileSync("/proc/stat", "utf8").split("\n")[0].trim().split(/\s+/).slice(1).map(Number);
  const idle = cpu[3] + cpu[4];
  const total = cpu.slice(0, 8).reduce((a, b) => a + b, 0);
  const self = readFileSync("/proc/self/stat", "utf8").split(") ")[1].split(" ");
  return { busy: total - idle, total, self: Number(self[11]) + Number(self[12]) };
}

// Cores kept busy by other processes between two cpuJiffies() samples.
function othersCores(before, after, cores) {
  const total = after.total - before.total;
  return total > 0 ? (cores * (after.busy - before.busy - (after.self - before.self))) / total : 0;
}

function sleep(ms) { Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms); }

// Waits (at most maxSeconds) until other processes have used less than 0.1 core in each of 3
// consecutive seconds; returns the load of the last second.
function waitIdle(maxSeconds, cores) {
  const deadline = Date.now() + maxSeconds * 1000;
  for (let quiet = 0; ;) {
    const before = cpuJiffies();
    sleep(1000);
    const load = othersCores(before, cpuJiffies(), cores);
    quiet = load < 0.1 ? quiet + 1 : 0;
    if (quiet >= 3 || Date.now() > deadline) return load;
  }
}

function readFloat32(path) {
  const buffer = readFileSync(path);
  // Large files get their own ArrayBuffer at offset 0; copy only when the view would be unaligned.
  if (buffer.byteOffset % 4 === 0) return new Float32Array(buffer.buffer, buffer.byteOffset, buffer.length / 4);
  return new Float32Array(new Uint8Array(buffer).buffer);
}

function readFloat64(path) {
  const buffer = readFileSync(path);
  return new Float64Array(new Uint8Array(buffer).buffer);
}

function sessionOptions(threads) {
  return { executionProviders: ["cpu"], intraOpNumThreads: threads, interOpNumThreads: 1,
           graphOptimizationLevel: "all", executionMode: "sequential", logSeverityLevel: 3 };
}

// max |y - ref| / max |ref| over the first ref.length values of y.
function relativeError(y, ref) {
  let err = 0, scale = 0;
  for (let i = 0; i < ref.length; ++i) {
    err = Math.max(err, Math.abs(y[i] - ref[i]));
    scale = Math.max(scale, Math.abs(ref[i]));
  }
  return err / scale;
}

function median(values) {
  const s = [...values].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

// One graph of one workload at one density and thread count: the body of a --child process.
async function runOne(dir, w, density, graph, threads, repetitions, warmup) {
  const base = procStatus();
  const query = readFloat32(join(dir, density.query));
  const key = readFloat32(join(dir, w.key));
  const value = readFloat32(join(dir, w.value));
  const feeds = {
    query: new ort.Tensor("float32", query, [w.B, w.T, w.Eq]),
    key: new ort.Tensor("float32", key, [w.B, w.S, w.E]),
    value: new ort.Tensor("float32", value, [w.B, w.S, w.E]),
  };
  const inputsMB = (query.byteLength + key.byteLength + value.byteLength) / 2 ** 20;
  let start = performance.now();
  const session = await ort.InferenceSession.create(join(dir, w.graphs[graph].file), sessionOptions(threads));
  const createMs = performance.now() - start;
  let output;
  for (let i = 0; i < warmup; ++i) output = (await session.run(feeds)).output;
  const times = [];
  const cpuBefore = cpuJiffies();
  for (let i = 0; i < repetitions; ++i) {
    start = performance.now();
    output = (await session.run(feeds)).output;
    times.push(performance.now() - start);
  }
  const others = othersCores(cpuBefore, cpuJiffies(), availableParallelism());
  const error = relativeError(output.data, readFloat64(join(dir, density.reference)));
  const peak = procStatus();
  await session.release();
  return { workload: w.name, density: density.density, graph, threads, repetitions,
           median_ms: median(times), min_ms: Math.min(...times), times_ms: times,
           session_create_ms: createMs, max_rel_error: error, others_cores: others, base_rss_mb: base.rssMB,
           inputs_mb: inputsMB, peak_hwm_mb: peak.hwmMB,
           peak_minus_base_inputs_mb: peak.hwmMB - base.rssMB - inputsMB };
}

function runChild(args, workload, densityIndex, graph, threads) {
  const self = fileURLToPath(import.meta.url);
  const result = spawnSync(process.execPath, [self, "--child", JSON.stringify({ workload, densityIndex, graph, threads }),
    "--dir", args.dir, "--repetitions", String(args.repetitions), "--warmup", String(args.warmup)],
    { encoding: "utf8", maxBuffer: 1 << 26 });
  if (result.status !== 0) throw new Error(`child ${workload}/${graph}/t${threads} failed:\n${result.stderr}`);
  return JSON.parse(result.stdout.trim().split("\n").pop());
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const shapes = JSON.parse(readFileSync(join(args.dir, "shapes.json"), "utf8"));
  const findWorkload = (name) => (name === "check" ? shapes.check : shapes.workloads.find((w) => w.name === name));

  if (args.child) {
    const job = JSON.parse(args.child);
    const w = findWorkload(job.workload);
    const row = await runOne(args.dir, w, w.densities[job.densityIndex], job.graph, job.threads,
                             args.repetitions, args.warmup);
    process.stdout.write(JSON.stringify(row) + "\n");
    return;
  }

  const graphs = args.graphs.split(",");
  const threadCounts = args.threads.split(",").map(Number);
  console.log(`# onnxruntime-node ${ort.env.versions.node} (onnxruntime-common ${ort.env.versions.common}), ` +
              `node ${process.version}, graphs from onnx ${shapes.onnx}, opset ${shapes.opset}`);

  // Correctness first: all graphs on the small case against the float64 reference, in this process.
  const check = shapes.check;
  const checkRows = [];
  for (const graph of graphs) {
    for (const threads of threadCounts) {
      const row = await runOne(args.dir, check, check.densities[0], graph, threads, 1, 0);
      checkRows.push({ graph, threads, max_rel_error: row.max_rel_error });
      console.log(`check ${graph.padEnd(6)} threads ${threads}: max |y - ref| / max |ref| = ` +
                  `${row.max_rel_error.toExponential(2)} (B=${check.B} T=${check.T} Eq=${check.Eq} S=${check.S} ` +
                  `E=${check.E} H=${check.H} Dk=${check.Dk} O=${check.O}, float64 numpy reference)`);
      if (!(row.max_rel_error < 1e-4)) throw new Error(`graph ${graph} disagrees with the reference`);
    }
  }
  if (args.check) return;

  const wanted = args.workloads ? args.workloads.split(",") : shapes.workloads.map((w) => w.name);
  const rows = [];
  console.log(`# ${args.repetitions} timed runs after ${args.warmup} warm-up, a fresh process per line; ` +
              "error: output batch 0 vs float64 reference; memory: VmHWM, and VmHWM - (VmRSS with ORT loaded + inputs); " +
              "others: cores used by other processes during the timed runs");
  for (const w of shapes.workloads.filter((x) => wanted.includes(x.name))) {
    for (let d = 0; d < w.densities.length; ++d) {
      for (const graph of graphs) {
        for (const threads of threadCounts) {
          // A line that other processes disturbed (more than 0.1 core on average) is taken again,
          // up to --retries times, keeping the least disturbed attempt.
          let row = null;
          for (let attempt = 0; attempt <= args.retries; ++attempt) {
            if (args["wait-idle"] > 0) waitIdle(args["wait-idle"], availableParallelism());
            const next = runChild(args, w.name, d, graph, threads);
            if (row === null || next.others_cores < row.others_cores) row = next;
            row.attempts = attempt + 1;
            if (row.others_cores < 0.1) break;
          }
          rows.push(row);
          console.log(`${w.name.padEnd(5)} density ${String(row.density).padEnd(6)} ${graph.padEnd(6)} threads ${threads}: ` +
                      `median ${row.median_ms.toFixed(2).padStart(8)} ms  min ${row.min_ms.toFixed(2).padStart(8)} ms  ` +
                      `error ${row.max_rel_error.toExponential(1)}  peak ${row.peak_hwm_mb.toFixed(0).padStart(5)} MB ` +
                      `(+${row.peak_minus_base_inputs_mb.toFixed(0)} MB)  others ${row.others_cores.toFixed(2)} cores` +
                      (row.attempts > 1 ? ` (${row.attempts} attempts)` : ""));
        }
      }
    }
  }
  if (args.json) {
    writeFileSync(args.json, JSON.stringify({ onnxruntime_node: ort.env.versions.node, node: process.version,
      onnx: shapes.onnx, opset: shapes.opset, repetitions: args.repetitions, warmup: args.warmup,
      check: checkRows, rows }, null, 1));
    console.log(`wrote ${args.json}`);
  }
}

main().catch((e) => { console.error(e); process.exit(1); });
