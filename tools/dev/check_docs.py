#!/usr/bin/env python3
"""Runs the code blocks of README.md, docs/*.md and tools/cli/README.md as tests (stdlib only).

    python3 tools/dev/check_docs.py [--build build] [--jobs 2] [--keep] [FILE.md ...]

Run from anywhere; it needs the build folder of the README's test command (build/: sdmha-run,
the examples) and, for the Python blocks, the package built there (build/python, after
tools/bootstrap-python.sh). Every fenced block is one of these, by its language and by the HTML
comment `<!-- check: ... -->` on the line just before its fence (a blank line may separate them):

  ```cpp with `int main`   a program: compiled (-O1) and run; a ```text block marked
                           `<!-- check: prints -->` right after it is its expected output, exactly
  ```cpp otherwise         must be marked `fragment of WHAT; harness NAME`: compiled inside the
                           harness NAME below (-fsyntax-only), or `excerpt of PATH`
  ```python                run (PYTHONPATH = build/python and tools/cli/); a fragment names a
                           prelude, `fragment of WHAT; prelude NAME`, run before it in the same
                           process
  ```sh                    run with bash -e (60 s at most); one file's blocks run in order in one
                           scratch folder, so a later block sees an earlier one's files
  any block                `not run: REASON` (said in the report), `excerpt of PATH` (its lines
                           appear in PATH in order, e.g. a program that is compiled elsewhere),
                           `same as .ci/run` (its commands are CI's, run there)
  ```text, no language     not code (diagrams, listings, output), unless marked `prints`

Options of a C++ fragment's marker: `, one statement a line` (each line in a scope of its own: a
synopsis whose lines redeclare a name), `, declarations first` (the lines up to the last `};` at
column 0 go to namespace scope), `; saved as FILE` (written to the scratch folder instead of
compiled here, for a later sh block of the same page that compiles it).

The scratch folder of a page links every top-level entry of the repository (so that the blocks'
relative paths resolve) and `build-py` to the build folder (docs/python.md's build of the package
alone). The C++ blocks are compiled in as few translation units as possible, in parallel.
Exit status 0 when every block passed, 1 otherwise.
"""
import argparse
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/*.md", "tools/cli/README.md"]
# The pages' sh blocks are those that take under a minute; the limit leaves room for a loaded
# machine (a g++ line of the README takes 50 s at a load of 9 on 2 cores).
SHELL_TIMEOUT = 120
PYTHON_TIMEOUT = 120
MARKER = re.compile(r"^<!--\s*check:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")

# C++ harnesses: the function a fragment's statements are compiled in (inside a scope of their
# own, so that they may redeclare the harness's names). Its #include lines go to the top of the
# unit, its namespace-scope part (`declarations first`) before the function, all in a namespace of
# the fragment's own.
HARNESS_INCLUDES = ["<sdmha/sdmha.hpp>", "<cmath>", "<iostream>", "<memory>", "<string>", "<vector>"]

CALL_HARNESS = r"""
// The names a fragment of the API pages uses and leaves to the reader.
[[maybe_unused]] static void harness() {
  using namespace sdmha;
  using Scalar = float;
  const Eigen::Index batch = 2, steps = 4, key_steps = 5, query_dim = 64, key_in_dim = 16,
                     value_in_dim = 16;
  sdmha::MhaConfig config;
  config.num_heads = 2;
  config.key_dim = 8;
  auto weights = sdmha::MhaWeights<float>::glorot_uniform(config, query_dim, key_in_dim,
                                                          value_in_dim, 1);
  sdmha::SparseDenseMHA<float> layer(config, weights);
  Eigen::Matrix<std::int64_t, Eigen::Dynamic, 3, Eigen::RowMajor> indices(1, 3);
  indices << 0, 0, 1;
  Eigen::VectorXf values = Eigen::VectorXf::Ones(1);
  auto query = sdmha::SparseQuery<float>::from_coo(batch, steps, query_dim, indices, values);
  Eigen::Tensor<float, 3, Eigen::RowMajor> key(batch, key_steps, key_in_dim),
      value(batch, key_steps, value_in_dim), d_output(batch, steps, query_dim), labels;
  sdmha::AttentionOptions<float> options;
  sdmha::Workspace<float> workspace;
  sdmha::AttentionResult<float> result;
  sdmha::MhaGradients<float> gradients;
  sdmha::ProjectedContext<float> context = layer.project_context(key, value);
  struct Request { sdmha::SparseQuery<float> query; };
  std::vector<Request> requests;
  auto loss_gradient = [](const Eigen::Tensor<float, 3, Eigen::RowMajor>& output,
                          const Eigen::Tensor<float, 3, Eigen::RowMajor>&) { return output; };
  const float rate = 0.01f;
  const std::string path = "layer.safetensors";
  {
@BODY@
  }
}
"""

# The body of a program's main.
MAIN_HARNESS = r"""
int main() {
  {
@BODY@
  }
  return 0;
}
"""

HARNESSES = {"call": CALL_HARNESS, "main": MAIN_HARNESS}

# Python preludes: what a fragment runs after, in the same process.
NUMPY_PRELUDE = r"""
import os, numpy as np
B, T, S = 2, 4, 5
rng = np.random.default_rng(0)
indptr = np.arange(B * T + 1, dtype=np.int32) * 2
indices = rng.integers(0, 32768, size=2 * B * T).astype(np.int32)
values = rng.standard_normal(2 * B * T).astype(np.float32)
coo_indices = np.array([[row // T, row % T, int(indices[k])] for row in range(B * T)
                        for k in range(indptr[row], indptr[row + 1])], dtype=np.int64)
key = rng.standard_normal((B, S, 512)).astype(np.float32)
value = rng.standard_normal((B, S, 512)).astype(np.float32)
mask = np.ones((T, S), dtype=bool)
d_output = rng.standard_normal((B, T, 32768)).astype(np.float32)
array = np.zeros(32768, dtype=np.float32)
for name, target in [("layer.safetensors", "tests/data/goldens/keras_causal_f64.safetensors"),
                     ("inputs.safetensors", "tests/data/goldens/keras_causal_f64.safetensors"),
                     ("model.keras", "tests/data/keras/functional_bias.keras")]:
    if not os.path.exists(name):
        os.symlink(os.path.abspath(target), name)
"""

TORCH_PRELUDE = r"""
import torch
B, T, S = 2, 4, 5
torch.manual_seed(0)
indices = torch.stack([torch.arange(B).repeat_interleave(T), torch.arange(T).repeat(B),
                       torch.randint(0, 32768, (B * T,))])
values = torch.randn(B * T, requires_grad=True)
key = torch.randn(B, S, 512)
value = torch.randn(B, S, 512)
mask = torch.ones(T, S, dtype=torch.bool)
bias = torch.zeros(T, S)
torch_mask = torch.zeros(T, S, dtype=torch.bool)
"""

PRELUDES = {"numpy_inputs": NUMPY_PRELUDE, "torch_inputs": TORCH_PRELUDE}


class Block:
    def __init__(self, page, line, language, text, marker):
        self.page, self.line, self.language, self.text, self.marker = page, line, language, text, marker
        self.expected_output = None  # the text of a following `prints` block

    @property
    def where(self):
        return f"{self.page}:{self.line}"


def parse(page):
    """The fenced blocks of a page, each with the marker just before its fence."""
    lines = (ROOT / page).read_text().split("\n")
    blocks, marker, index = [], None, 0
    while index < len(lines):
        line = lines[index]
        found = MARKER.match(line)
        fence = FENCE.match(line)
        if found:
            marker = found.group(1)
        elif fence:
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            blocks.append(Block(page, index + 1, fence.group(1), "\n".join(lines[index + 1:end]), marker))
            marker, index = None, end
        elif line.strip():
            marker = None
        index += 1
    for previous, block in zip(blocks, blocks[1:]):
        if block.marker == "prints":
            previous.expected_output = block.text
    return blocks


def option(marker, name):
    """The value after `name ` in a marker's `;`-separated parts, or None."""
    for part in (marker or "").split(";"):
        part = part.strip()
        if part.startswith(name + " "):
            return part[len(name) + 1:].strip()
    return None


class Report:
    def __init__(self):
        self.passed, self.failed, self.not_run = [], [], []

    def result(self, block, ok, what, detail=""):
        (self.passed if ok else self.failed).append((block.where, what, detail))
        shown = f"\n{detail}" if detail and not ok else ""
        print(f"{'ok  ' if ok else 'FAIL'} {block.where} {what}{shown}", flush=True)


def check_excerpt(block, path, report):
    source = [line.strip() for line in (ROOT / path).read_text().split("\n")]
    position = 0
    for line in block.text.split("\n"):
        wanted = line.strip()
        if not wanted or wanted in ("// …", "# …", "…"):
            continue
        try:
            position = source.index(wanted, position) + 1
        except ValueError:
            report.result(block, False, f"excerpt of {path}", f"not found in order in {path}: {wanted}")
            return
    report.result(block, True, f"excerpt of {path}")


def check_ci_commands(block, report):
    ci = (ROOT / ".ci/run").read_text()
    missing = [line for line in block.text.split("\n") if line.strip() and line.strip() not in ci]
    report.result(block, not missing, "same as .ci/run", "not in .ci/run: " + "; ".join(missing))


def fragment_parts(block):
    """A fragment in its harness: (its #include lines, the namespace-scope text with the function)."""
    harness_name = option(block.marker, "harness") or ""
    one_per_line = "one statement a line" in harness_name
    declarations_first = "declarations first" in harness_name
    harness = HARNESSES[harness_name.split(",")[0].strip()]
    lines = block.text.split("\n")
    includes = [line for line in lines if line.startswith("#include")]
    rest = [line if not line.startswith("#include") else "" for line in lines]  # keeps #line right
    declarations = []
    if declarations_first:
        last = max(i for i, line in enumerate(rest) if line.startswith("};"))
        declarations, rest = rest[:last + 1], [""] * (last + 1) + rest[last + 1:]
    if one_per_line:  # each statement in a scope of its own, on its own line number
        statement = lambda line: line.strip() and not line.strip().startswith("//")
        rest = [f"#line {block.line + 1 + i}\n{{ {line}\n}}" if statement(line) else ""
                for i, line in enumerate(rest)]
    located = f'#line {block.line + 1} "{block.page}"\n'
    function = harness.replace("@BODY@", located + "\n".join(rest))
    return includes, located + "\n".join(declarations) + "\n" + function


def fragments_unit(blocks):
    """Every fragment in one translation unit, each in a namespace of its own."""
    includes, parts = ["#include " + name for name in HARNESS_INCLUDES], []
    for number, block in enumerate(blocks):
        own_includes, text = fragment_parts(block)
        includes += [line for line in own_includes if line not in includes]
        text = text.replace("int main()", "[[maybe_unused]] static int fragment_main()")
        parts.append(f"namespace fragment_{number} {{\n{text}\n}}  // namespace fragment_{number}")
    return "\n".join(includes) + "\n" + "\n".join(parts) + "\n"


def saved_unit(block):
    """A fragment in its harness as a file of its own (`saved as`), for a later sh block."""
    own_includes, text = fragment_parts(block)
    includes = own_includes + ["#include " + name for name in HARNESS_INCLUDES[1:]]
    return "\n".join(includes) + "\n" + text.replace(f'#line {block.line + 1} "{block.page}"\n', "")


def program_unit(blocks):
    """Programs in one translation unit: each in a namespace of its own, main renamed, and a main
    that runs the one named by argv[1]."""
    includes, bodies, calls = set(), [], []
    for number, block in enumerate(blocks):
        own = [line if not line.startswith("#include") else "" for line in block.text.split("\n")]
        includes.update(line for line in block.text.split("\n") if line.startswith("#include"))
        body = "\n".join(own).replace("int main(", "int program_main(")
        bodies.append(f'namespace program_{number} {{\n#line {block.line + 1} "{block.page}"\n{body}\n}}')
        calls.append(f"  if (which == {number}) return program_{number}::program_main();")
    return ("\n".join(sorted(includes)) + "\n#include <string>\n" + "\n".join(bodies) +
            "\nint main(int argc, char** argv) {\n  const int which = argc > 1 ? std::stoi(argv[1]) : -1;\n" +
            "\n".join(calls) + "\n  return 2;\n}\n")


def blame(blocks, errors):
    """The blocks that the compiler's errors point into (by page and line)."""
    found = set()
    for page, line in re.findall(r"^(\S+\.md):(\d+):\d+: error", errors, re.MULTILINE):
        for block in blocks:
            if block.page == page and block.line < int(line) <= block.line + block.text.count("\n") + 1:
                found.add(block)
    return found


def compiler_flags(source):
    flags = ["-std=c++17", "-Werror=return-type", "-I", str(ROOT / "include"), "-I", str(ROOT / "bench"),
             "-I", "/usr/include/eigen3"]
    if "keras_file.hpp" in source:
        flags += ["-I", "/usr/include/hdf5/serial"]
    return flags


def link_flags(source):
    flags = ["-pthread"]
    if "sdmha/io/" in source:
        flags += ["-lzip"]
    if "keras_file.hpp" in source:
        flags += ["-L/usr/lib/x86_64-linux-gnu/hdf5/serial", "-lhdf5"]
    return flags


def compile_unit(name, source, scratch, link):
    path = scratch / (name + ".cpp")
    path.write_text(source)
    command = ["g++"] + compiler_flags(source) + [str(path)]
    command += (["-O1", "-o", str(scratch / name)] + link_flags(source)) if link else ["-fsyntax-only"]
    started = time.time()
    run = subprocess.run(command, capture_output=True, text=True)
    return run.returncode, run.stderr, time.time() - started


def scratch_folder(base, page, build):
    folder = base / re.sub(r"[^A-Za-z0-9]+", "_", page)
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (folder / entry.name).symlink_to(entry)
    if not (folder / "build-py").exists():
        (folder / "build-py").symlink_to(build)
    if build != ROOT / "build" and not (ROOT / "build").exists():
        (folder / "build").symlink_to(build)
    return folder


def package_interpreter(build):
    """The interpreter the Python package was built for (build/CMakeCache.txt), else this one."""
    cache = build / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text(errors="replace").split("\n"):
            if line.startswith("SDMHA_PYTHON_EXECUTABLE:") and line.partition("=")[2]:
                return line.partition("=")[2]
    return sys.executable


def outcome(block, run):
    """(passed, what to show): exit status 0 and, where the page says, exactly its output."""
    if run.returncode != 0:
        return False, f"exit {run.returncode}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    if block.expected_output is not None and run.stdout.strip() != block.expected_output.strip():
        return False, f"printed:\n{run.stdout}\nthe page says:\n{block.expected_output}"
    return True, ""


def run_block(block, folder, build, report):
    """Runs one sh or Python block in the page's scratch folder."""
    if block.language == "python":
        prelude = PRELUDES[option(block.marker, "prelude")] if option(block.marker, "prelude") else ""
        script = folder / f"block_{block.line}.py"
        script.write_text(prelude + "\n" + block.text + "\n")
        command, timeout = [package_interpreter(build), str(script)], PYTHON_TIMEOUT
    else:
        command, timeout = ["bash", "-e", "-o", "pipefail", "-c", block.text], SHELL_TIMEOUT
    environment = dict(os.environ)
    # The pages' `python3` is the one the package was built for (docs/python.md: a pyenv or
    # virtualenv python3 first on PATH usually lacks Debian's torch).
    environment["PATH"] = str(folder.parent / "bin") + os.pathsep + environment.get("PATH", "")
    if block.language == "python":
        paths = [str(build / "python"), str(ROOT / "tools" / "cli"),
                 environment.get("PYTHONPATH", "")]
        environment["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    started = time.time()
    try:
        run = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout,
                             env=environment)
    except subprocess.TimeoutExpired:
        report.result(block, False, f"{block.language} block", f"over {timeout} s")
        return
    seconds = time.time() - started
    ok, detail = outcome(block, run)
    report.result(block, ok, f"{block.language} block ({seconds:.1f} s)", detail)


def run_page(page, blocks, base, build, report):
    folder = scratch_folder(base, page, build)
    for block in blocks:
        if block.marker and option(block.marker, "saved as"):
            (folder / option(block.marker, "saved as")).write_text(saved_unit(block))
        elif block.language in ("sh", "python") and not is_settled(block):
            run_block(block, folder, build, report)


def is_settled(block):
    """Whether the block is checked (or set aside) without running it as a page step."""
    marker = block.marker or ""
    return marker.startswith("not run") or marker.startswith("excerpt of") or marker == "same as .ci/run"


def classify(blocks, report):
    """Checks the markers; returns the C++ programs and the C++ fragments to compile."""
    programs, fragments = [], []
    for block in blocks:
        marker = block.marker or ""
        if marker == "prints" or (not block.language or block.language == "text") and not marker:
            continue
        if marker.startswith("not run"):
            reason = marker.partition(":")[2].strip()
            if not reason:
                report.result(block, False, "not run", "a `not run` marker must give its reason")
            else:
                report.not_run.append((block.where, reason))
        elif marker.startswith("excerpt of"):
            check_excerpt(block, marker[len("excerpt of"):].strip(), report)
        elif marker == "same as .ci/run":
            check_ci_commands(block, report)
        elif block.language == "cpp":
            if option(marker, "saved as"):
                name = option(marker, "saved as")
                later = [b for b in blocks if b.line > block.line and b.language == "sh" and name in b.text]
                if not later or is_settled(later[0]):
                    report.result(block, False, f"saved as {name}", "no later sh block of the page runs it")
                continue
            if option(marker, "harness"):
                fragments.append(block)
            elif re.search(r"\bint main\(", block.text):
                programs.append(block)
            else:
                report.result(block, False, "C++ block",
                              "neither a program nor marked (fragment of …; harness …, excerpt of …, "
                              "not run: …)")
        elif block.language in ("sh", "python"):
            if block.language == "python" and marker and not option(marker, "prelude"):
                report.result(block, False, "Python block", f"unknown marker: {marker}")
        else:
            report.result(block, False, f"```{block.language} block", "unmarked; expected a check marker")
    return programs, fragments


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("pages", nargs="*")
    arguments = parser.parse_args()
    build = pathlib.Path(arguments.build).resolve()
    pages = arguments.pages or sorted({str(p.relative_to(ROOT)) for g in PAGES for p in ROOT.glob(g)})
    started = time.time()
    report = Report()
    parsed = {page: parse(page) for page in pages}
    programs, fragments = [], []
    for page in pages:
        page_programs, page_fragments = classify(parsed[page], report)
        programs += page_programs
        fragments += page_fragments
    base = pathlib.Path(tempfile.mkdtemp(prefix="sdmha_check_docs_"))
    (base / "bin").mkdir()
    (base / "bin" / "python3").symlink_to(package_interpreter(build))
    try:
        with concurrent.futures.ThreadPoolExecutor(arguments.jobs) as pool:
            nothing = concurrent.futures.Future()
            nothing.set_result((0, "", 0.0))
            compiled_programs = nothing
            if programs:
                compiled_programs = pool.submit(compile_unit, "programs", program_unit(programs), base, True)
            compiled_fragments = nothing
            if fragments:
                compiled_fragments = pool.submit(compile_unit, "fragments", fragments_unit(fragments), base,
                                                 False)
            page_runs = [pool.submit(run_page, page, parsed[page], base, build, report) for page in pages]
            code, errors, seconds = compiled_fragments.result()
            located = blame(fragments, errors) if code != 0 else set()
            for block in fragments:
                failed = code != 0 and (block in located or not located)
                report.result(block, not failed, f"C++ fragment (all compiled together in {seconds:.0f} s)",
                              errors[-6000:])
            code, errors, seconds = compiled_programs.result()
            for number, block in enumerate(programs):
                if code != 0:
                    report.result(block, False, "C++ program", errors[-6000:])
                    continue
                run = subprocess.run([str(base / "programs"), str(number)], cwd=ROOT, capture_output=True,
                                     text=True, timeout=SHELL_TIMEOUT)
                ok, detail = outcome(block, run)
                report.result(block, ok, f"C++ program (all compiled together in {seconds:.0f} s)", detail)
            for future in page_runs:
                future.result()
    finally:
        if arguments.keep:
            print(f"scratch folder kept: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    for where, reason in report.not_run:
        print(f"not run {where}: {reason}")
    print(f"check_docs.py: {len(report.passed)} passed, {len(report.failed)} failed, "
          f"{len(report.not_run)} not run (reasons above), {time.time() - started:.0f} s")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
