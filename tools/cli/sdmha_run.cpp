// sdmha-run — runs a sparse-query multi-head attention layer stored in files, writes its output.
//
// The weights and the inputs come from safetensors or .npz files in the names of
// tests/data/goldens/README.md (the names Keras and PyTorch export); the result goes to a
// safetensors file. Everything is read and computed before anything is written, and the writer
// replaces the output file atomically, so a failed run leaves no output behind.
#include <sdmha/io/layer_files.hpp>
#ifdef SDMHA_HAS_KERAS_IO
#include <sdmha/io/keras_isolated.hpp>
#endif
#include <sdmha/sdmha.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace {

constexpr const char* kProgram = "sdmha-run";

constexpr const char* kUsage =
    R"(Usage: sdmha-run --weights W --inputs I --out O.safetensors [options]

Runs sdmha's SparseDenseMHA (Keras 3 MultiHeadAttention math, sparse query) on a layer's
weights, read from safetensors (.safetensors), NumPy (.npz) or Keras (.keras, .weights.h5)
files, and inputs read from safetensors or .npz files, and writes
`output` (B, T, O) -- and with --scores `attention_scores` (B, H, T, S) -- to a safetensors file.
W and I may be the same file. Tensor names: see sdmha's tests/data/goldens/README.md.

Required:
  --weights PATH    Keras names (query/kernel, ...; a layer prefix is allowed) or PyTorch
                    nn.MultiheadAttention names (in_proj_weight, out_proj.weight, ...); or a
                    Keras 3 file (model.keras, its unzipped directory, or x.weights.h5),
                    recognised by its content, read in an isolated child process
  --inputs PATH     query/indices, query/values, query/dense_shape, value, and optionally
                    key (default: key = value), attention_mask (BOOL, True = may attend)
                    and attention_bias (F32/F64, added to the scaled scores before the
                    softmax; -inf blocks), each (T, S), (B, T, S) or (B, H, T, S) with B
                    or H possibly 1 (broadcast over the batch or the heads)
  --out PATH        the safetensors file to write (not .npy/.npz); replaced atomically

Options (--num-heads, --layout and --causal/--no-causal override the weights file's
__metadata__; an option with a value also takes the form --option=value):
  --scores          also write attention_scores, the softmax probabilities
  --threads N       worker threads, 0 = the physical cores (default 0, at most 1024)
  --num-heads H     number of heads (metadata num_heads; required for PyTorch weights)
  --layout L        keras or torch (metadata layout, else detected from the tensor names)
  --prefix P        Keras layer prefix such as "multi_head_attention/" (default: detected)
  --causal          apply the causal mask (metadata use_causal_mask, else off)
  --no-causal       do not apply the causal mask, whatever the metadata says
  --strategy S      project_first (default) or sparse_regrouped; both give the same result
  --layer NAME      Keras files: the MultiHeadAttention to run, by its Keras name or HDF5
                    group (default: the file's only one)
  --allow-non-finite-weights
                    load weights that hold NaN or +-Inf (refused by default, naming the
                    tensor and its first such entry)
  --trusted-file    Keras files: read in this process instead of an isolated child (libhdf5
                    can crash or hang on a damaged or hostile file; only for files you trust)
  --help            print this text and exit

Precision: the run takes the dtype of the inputs' query/values: F64 runs in float64;
F32, F16 and BF16 run in float32. Every other floating tensor (weights, key, value,
attention_bias) is converted to that precision (F64 to float32 rounds to nearest). output and
attention_scores are written as F32 or F64 accordingly, with metadata num_heads, key_dim,
value_dim, output_dim, layout, use_causal_mask, causal_alignment, fully_masked_rows, scale (when
set), score_strategy and dtype.

Semantics: the weights file's metadata (else the inputs file's) may carry use_causal_mask,
causal_alignment (top_left, the default, or bottom_right: step t sees keys s <= t + S - T),
scale (a decimal number; default 1/sqrt(key_dim)) and fully_masked_rows (zeros, the default,
or uniform: 1/S on every key of a row whose keys are all blocked).

A query/dense_shape whose batch * steps rows would not fit in this machine's memory is refused
before anything is allocated.

A Keras file holds no call-time settings: use_causal_mask (--causal) and the rest come from the
inputs file's metadata. The isolated reader gets 5 s plus 30 s per GiB of file (at most 60 s) and 4 GiB
of address space; a reader that crashes, hangs or runs past them ends the run with status 1,
naming the file.

Exit status: 0 on success; 1 for a bad, missing or inconsistent file or tensor (a mask or a
bias of the wrong shape or dtype included), or a failure to write (one line "sdmha-run: error: ..." on stderr, no output file); 2 for bad usage.
)";

// Bad command-line usage: exit status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Arguments {
  std::string weights_path;
  std::string inputs_path;
  std::string output_path;
  bool return_scores = false;
  int threads = 0;
  sdmha::ScoreStrategy strategy = sdmha::ScoreStrategy::project_first;
  sdmha::io::LayerFileOptions layer_options;
  std::optional<std::string> keras_layer;  // --layer
  bool trusted_file = false;               // --trusted-file
  bool help = false;
};

constexpr int kMaxThreads = 1024;

bool ends_with_ignoring_case(const std::string& text, const std::string& suffix) {
  if (text.size() < suffix.size()) return false;
  return std::equal(suffix.begin(), suffix.end(), text.end() - suffix.size(), [](char a, char b) {
    return std::tolower(static_cast<unsigned char>(a)) ==
           std::tolower(static_cast<unsigned char>(b));
  });
}

// A decimal integer in [minimum, maximum], the whole argument and nothing else.
long long parse_integer(const std::string& flag, const std::string& text, long long minimum,
                        long long maximum) {
  long long value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  const auto [end, error] = std::from_chars(first, last, value);
  if (text.empty() || error != std::errc() || end != last || value < minimum || value > maximum) {
    throw UsageError(flag + " '" + text + "' is not an integer in [" + std::to_string(minimum) +
                     ", " + std::to_string(maximum) + "]");
  }
  return value;
}

// The paths a run needs (all given, none empty) and what they may be: --out a safetensors file,
// not one of the inputs.
void check_paths(const Arguments& arguments, const std::vector<std::string>& seen) {
  for (const auto& [flag, path] :
       {std::pair<const char*, const std::string*>{"--weights", &arguments.weights_path},
        {"--inputs", &arguments.inputs_path},
        {"--out", &arguments.output_path}}) {
    if (std::find(seen.begin(), seen.end(), flag) == seen.end()) {
      throw UsageError(std::string("missing ") + flag + " (see --help)");
    }
    if (path->empty()) throw UsageError(std::string(flag) + " is an empty path");
  }
  if (ends_with_ignoring_case(arguments.output_path, ".npy") ||
      ends_with_ignoring_case(arguments.output_path, ".npz")) {
    throw UsageError(
        "--out '" + arguments.output_path +
        "': sdmha-run writes safetensors only; expected a path not ending in .npy or .npz");
  }
  // The writer replaces --out atomically, which would replace an input file after reading it.
  for (const std::string* input : {&arguments.weights_path, &arguments.inputs_path}) {
    std::error_code error;
    if (std::filesystem::equivalent(arguments.output_path, *input, error) && !error) {
      throw UsageError("--out '" + arguments.output_path + "' is the input file '" + *input +
                       "'; expected a new path");
    }
  }
}

Arguments parse_arguments(int argc, char** argv) {
  Arguments arguments;
  std::vector<std::string> seen;
  std::optional<bool> causal;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::optional<std::string> inline_value;  // --flag=value
    if (const auto equals = flag.find('=');
        flag.compare(0, 2, "--") == 0 && equals != std::string::npos) {
      inline_value = flag.substr(equals + 1);
      flag.resize(equals);
    }
    if (std::find(seen.begin(), seen.end(), flag) != seen.end()) {
      throw UsageError(flag + " is given more than once");
    }
    seen.push_back(flag);
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(flag + " needs a value");
      return argv[++i];
    };
    const auto no_value = [&] {
      if (inline_value) throw UsageError(flag + " takes no value");
    };

    if (flag == "--help" || flag == "-h") {
      no_value();
      arguments.help = true;
    } else if (flag == "--weights") {
      arguments.weights_path = value();
    } else if (flag == "--inputs") {
      arguments.inputs_path = value();
    } else if (flag == "--out") {
      arguments.output_path = value();
    } else if (flag == "--scores") {
      no_value();
      arguments.return_scores = true;
    } else if (flag == "--threads") {
      arguments.threads = static_cast<int>(parse_integer(flag, value(), 0, kMaxThreads));
    } else if (flag == "--num-heads") {
      arguments.layer_options.num_heads = static_cast<sdmha::Index>(
          parse_integer(flag, value(), 1, std::numeric_limits<int>::max()));
    } else if (flag == "--layout") {
      const std::string layout = value();
      if (layout == "keras") {
        arguments.layer_options.layout = sdmha::io::WeightLayout::keras;
      } else if (layout == "torch") {
        arguments.layer_options.layout = sdmha::io::WeightLayout::torch;
      } else {
        throw UsageError("--layout '" + layout + "' is not keras or torch");
      }
    } else if (flag == "--prefix") {
      arguments.layer_options.prefix = value();
    } else if (flag == "--layer") {
      arguments.keras_layer = value();
    } else if (flag == "--allow-non-finite-weights") {
      no_value();
      arguments.layer_options.allow_non_finite_weights = true;
    } else if (flag == "--trusted-file") {
      no_value();
      arguments.trusted_file = true;
    } else if (flag == "--causal" || flag == "--no-causal") {
      no_value();
      const bool requested = flag == "--causal";
      if (causal && *causal != requested) throw UsageError("--causal and --no-causal contradict");
      causal = requested;
    } else if (flag == "--strategy") {
      const std::string strategy = value();
      if (strategy == "project_first") {
        arguments.strategy = sdmha::ScoreStrategy::project_first;
      } else if (strategy == "sparse_regrouped") {
        arguments.strategy = sdmha::ScoreStrategy::sparse_regrouped;
      } else {
        throw UsageError("--strategy '" + strategy + "' is not project_first or sparse_regrouped");
      }
    } else {
      throw UsageError("unknown argument '" + flag + "'");
    }
  }
  arguments.layer_options.use_causal_mask = causal;
  if (!arguments.help) check_paths(arguments, seen);
  return arguments;
}

// What the run is doing, so that an error can say which file it concerns.
struct Step {
  std::string description;  // "reading the weights from 'W'"
  std::string file;         // the file this step reads or writes
  // Said before a library message that does not name `file` itself, e.g. "'I': ".
  std::string context;
};

std::string in_quotes(const std::string& path) { return "'" + path + "'"; }

// One line: control characters (a path or a corrupt header quoted by a parser may hold them)
// are escaped as \xNN.
std::string single_line(const std::string& text) {
  std::string line;
  for (const char character : text) {
    const auto byte = static_cast<unsigned char>(character);
    if (byte < 0x20 || byte == 0x7f) {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      line += escaped;
    } else {
      line += character;
    }
  }
  return line;
}

// sdmha's messages read "sdmha: <where>: <problem>"; the tool's own prefix replaces "sdmha: ".
std::string library_message(const sdmha::Error& error, const Step& step) {
  std::string message = error.what();
  const std::string library_prefix = "sdmha: ";
  if (message.compare(0, library_prefix.size(), library_prefix) == 0) {
    message.erase(0, library_prefix.size());
  }
  // TensorSource names an .npz source "<npz>" instead of its path; put the path back.
  const std::string npz_placeholder = "<npz>";
  if (const auto at = message.find(npz_placeholder);
      at != std::string::npos && !step.file.empty()) {
    message.replace(at, npz_placeholder.size(), in_quotes(step.file));
  }
  if (step.file.empty() || message.find(step.file) == std::string::npos) {
    message = step.context + message;
  }
  return message;
}

// Prints the one-line error and gives the exit status back.
int report(const std::string& message, int status) {
  std::cerr << kProgram << ": error: " << single_line(message) << '\n' << std::flush;
  return status;
}

template <typename Scalar>
std::string dtype_name() {
  return sdmha::io::dtype_name(sdmha::detail::IoElement<Scalar>::dtype);
}

std::string shape_text(std::initializer_list<sdmha::Index> dims) {
  std::string text = "(";
  for (const sdmha::Index dim : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(dim);
  return text + ")";
}

// The machine's physical memory in bytes, or nothing where the platform does not say.
std::optional<long double> physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0) return static_cast<long double>(pages) * page_size;
#endif
  return std::nullopt;
}

// A file of a few hundred bytes can declare a query of a billion steps (query/dense_shape holds
// only three numbers), whose output alone outgrows the machine: the library's row limit
// (SparseQueryLimits, checked by load_inputs before it allocates) is set to the rows that fit in
// this machine's memory, so the run is refused up front rather than killed by the system halfway
// through allocating. A row needs at least its output, projected query, attended values, its
// scores when written, and its CSR bookkeeping.
struct RowBudget {
  sdmha::SparseQueryLimits limits;
  long double memory = 0;     // bytes; 0 when the platform does not say (the default limit holds)
  long double row_bytes = 0;  // per (batch, step) row
};

template <typename Scalar>
RowBudget row_budget(const sdmha::io::TensorSource& inputs, const sdmha::MhaConfig& config,
                     bool return_scores) {
  RowBudget budget;
  const auto memory = physical_memory_bytes();
  if (!memory) return budget;
  long double key_steps = 0;
  if (inputs.contains("value") && inputs.shape("value").size() == 3)
    key_steps = static_cast<long double>(inputs.shape("value")[1]);
  const long double heads = static_cast<long double>(config.num_heads);
  const long double per_row_elements =
      static_cast<long double>(config.resolved_output_dim(0)) + heads * config.key_dim +
      heads * config.resolved_value_dim() + (return_scores ? heads * key_steps : 0.0L);
  budget.memory = *memory;
  budget.row_bytes = per_row_elements * sizeof(Scalar) + 2 * sizeof(std::int64_t);
  const long double rows = *memory / budget.row_bytes;
  constexpr auto most = static_cast<long double>(std::numeric_limits<sdmha::Index>::max());
  budget.limits.max_rows = static_cast<sdmha::Index>(std::min(rows, most));
  return budget;
}

// load_inputs under the row budget; a query past it is said to be past this machine's memory.
template <typename Scalar>
sdmha::io::LayerInputs<Scalar> load_inputs_within(const sdmha::io::TensorSource& inputs,
                                                  const RowBudget& budget) {
  try {
    return sdmha::io::load_inputs<Scalar>(inputs, budget.limits);
  } catch (const sdmha::ShapeError& error) {
    const std::string message = error.what();
    if (budget.memory <= 0 || message.find("max_rows") == std::string::npos) throw;
    constexpr long double gibibyte = 1024.0L * 1024.0L * 1024.0L;
    std::ostringstream why;
    why.precision(3);
    why << message << "; max_rows here is what this machine's "
        << static_cast<double>(budget.memory / gibibyte) << " GiB of memory holds at "
        << static_cast<double>(budget.row_bytes) << " bytes a row";
    throw sdmha::ShapeError(why.str());
  }
}

// Reads the layer and its inputs, runs it, and only then writes the output file.
// The layer of a Keras file (isolated unless --trusted-file), as a LayerFile: Keras' layout, and
// no call-time settings (a Keras file holds none).
template <typename Scalar>
sdmha::io::LayerFile<Scalar> load_keras_weights(const Arguments& arguments) {
#ifdef SDMHA_HAS_KERAS_IO
  const std::string& path = arguments.weights_path;
  const std::string name = arguments.keras_layer.value_or("");
  sdmha::io::KerasReadOptions options;
  options.allow_non_finite_weights = arguments.layer_options.allow_non_finite_weights;
  auto keras = arguments.trusted_file
                   ? sdmha::io::load_keras_layer<Scalar>(path, name, options)
                   : sdmha::io::load_keras_layer_isolated<Scalar>(path, name, options);
  sdmha::io::LayerFile<Scalar> layer_file;
  layer_file.config = keras.config;
  layer_file.weights = std::move(keras.weights);
  layer_file.use_causal_mask = arguments.layer_options.use_causal_mask.value_or(false);
  return layer_file;
#else
  throw sdmha::IoError("sdmha: " + in_quotes(arguments.weights_path) +
                       ": a Keras file, and this sdmha-run was built without Keras support "
                       "(SDMHA_WITH_KERAS_IO=OFF)");
#endif
}

// The weights: from `weights_source` (safetensors or .npz), or a Keras file where there is none.
template <typename Scalar>
sdmha::io::LayerFile<Scalar> load_weights(const Arguments& arguments,
                                          const sdmha::io::TensorSource* weights_source) {
  if (weights_source == nullptr) return load_keras_weights<Scalar>(arguments);
  return sdmha::io::load_layer<Scalar>(*weights_source, arguments.layer_options);
}

template <typename Scalar>
void run(const Arguments& arguments, const sdmha::io::TensorSource* weights_source,
         const sdmha::io::TensorSource& inputs_source, Step& step) {
  const std::string& weights = arguments.weights_path;
  const std::string& inputs = arguments.inputs_path;

  step = {"reading the weights from " + in_quotes(weights), weights, in_quotes(weights) + ": "};
  const auto layer_file = load_weights<Scalar>(arguments, weights_source);

  // load_inputs names the file in its own messages; a message that does not comes from
  // SparseQuery::from_coo, which sees only the three query tensors.
  step = {"reading the inputs from " + in_quotes(inputs), inputs,
          in_quotes(inputs) +
              ": query/indices, query/values and query/dense_shape do not form a "
              "valid sparse query: "};
  const auto layer_inputs = load_inputs_within<Scalar>(
      inputs_source, row_budget<Scalar>(inputs_source, layer_file.config, arguments.return_scores));

  step = {"running the layer", inputs,
          "the inputs in " + in_quotes(inputs) + " do not fit the layer in " + in_quotes(weights) +
              ": "};
  const sdmha::SparseDenseMHA<Scalar> layer(layer_file.config, layer_file.weights);
  // The attention's semantics: the weights file's (and --causal), each setting the weights file
  // does not carry from the inputs file's metadata.
  sdmha::AttentionOptions<Scalar> options = layer_file.attention_options();
  const auto in_weights = [&](const char* key) {
    return weights_source != nullptr && weights_source->metadata_value(key);
  };
  if (!arguments.layer_options.use_causal_mask && !in_weights("use_causal_mask"))
    options.use_causal_mask =
        sdmha::detail::metadata_bool(inputs_source, "use_causal_mask").value_or(false);
  if (!in_weights("causal_alignment"))
    options.causal_alignment = sdmha::detail::metadata_causal_alignment(inputs_source);
  if (!in_weights("scale")) options.scale = sdmha::detail::metadata_number(inputs_source, "scale");
  if (!in_weights("fully_masked_rows"))
    options.fully_masked_rows = sdmha::detail::metadata_fully_masked_rows(inputs_source);
  options.attention_mask = layer_inputs.attention_mask;
  options.attention_bias = layer_inputs.attention_bias;
  options.return_attention_scores = arguments.return_scores;
  options.num_threads = arguments.threads;
  options.score_strategy = arguments.strategy;
  const auto result =
      layer.forward(layer_inputs.query, {layer_inputs.key, layer_inputs.value}, options);

  step = {"writing " + in_quotes(arguments.output_path), arguments.output_path,
          in_quotes(arguments.output_path) + ": "};
  const auto& output = result.output;
  const auto& dims = layer.dims();
  sdmha::io::SafetensorsWriter writer;
  writer.add<Scalar>("output", {output.dimension(0), output.dimension(1), output.dimension(2)},
                     output.data());
  std::string written =
      "output " + shape_text({output.dimension(0), output.dimension(1), output.dimension(2)});
  if (arguments.return_scores) {
    const auto& scores = result.attention_scores;
    writer.add<Scalar>(
        "attention_scores",
        {scores.dimension(0), scores.dimension(1), scores.dimension(2), scores.dimension(3)},
        scores.data());
    written += ", attention_scores " + shape_text({scores.dimension(0), scores.dimension(1),
                                                   scores.dimension(2), scores.dimension(3)});
  }
  writer.set_metadata("num_heads", std::to_string(dims.num_heads));
  writer.set_metadata("key_dim", std::to_string(dims.key_dim));
  writer.set_metadata("value_dim", std::to_string(dims.value_dim));
  writer.set_metadata("output_dim", std::to_string(dims.output_dim));
  writer.set_metadata("layout",
                      layer_file.layout == sdmha::io::WeightLayout::keras ? "keras" : "torch");
  writer.set_metadata("use_causal_mask", options.use_causal_mask ? "true" : "false");
  writer.set_metadata("causal_alignment", sdmha::to_string(options.causal_alignment));
  writer.set_metadata("fully_masked_rows", sdmha::to_string(options.fully_masked_rows));
  if (options.scale) {
    std::ostringstream scale;
    scale.precision(17);
    scale << *options.scale;
    writer.set_metadata("scale", scale.str());
  }
  writer.set_metadata("score_strategy", sdmha::to_string(arguments.strategy));
  writer.set_metadata("dtype", dtype_name<Scalar>());
  writer.set_metadata("producer", "sdmha-run " + std::to_string(SDMHA_VERSION_MAJOR) + "." +
                                      std::to_string(SDMHA_VERSION_MINOR) + "." +
                                      std::to_string(SDMHA_VERSION_PATCH));
  writer.write(arguments.output_path);
  std::cout << kProgram << ": wrote " << single_line(in_quotes(arguments.output_path)) << ": "
            << written << ", " << dtype_name<Scalar>() << '\n';
}

// The precision of the run: that of query/values (see the usage text).
bool runs_in_double(const sdmha::io::TensorSource& inputs, const std::string& path) {
  using sdmha::io::DType;
  const DType dtype = inputs.dtype("query/values");
  switch (dtype) {
    case DType::F64:
      return true;
    case DType::F32:
    case DType::F16:
    case DType::BF16:
      return false;
    default:
      break;
  }
  throw sdmha::FormatError(std::string("sdmha: ") + in_quotes(path) +
                           ": tensor 'query/values' has dtype " + sdmha::io::dtype_name(dtype) +
                           "; expected F16, BF16, F32 or F64");
}

// Whether --weights is a Keras file, by its content (a build without Keras support sees the
// HDF5 signature only, to say so rather than fail to parse it as safetensors).
bool is_keras_weights(const Arguments& arguments) {
#ifdef SDMHA_HAS_KERAS_IO
  return sdmha::io::is_keras_file(arguments.weights_path);
#else
  std::ifstream stream(arguments.weights_path, std::ios::binary);
  char magic[8] = {};
  stream.read(magic, sizeof magic);
  return stream.gcount() == 8 && std::memcmp(magic, "\x89HDF\r\n\x1a\n", 8) == 0;
#endif
}

// The options that describe a tensor file's names have no meaning for a Keras file.
void check_keras_arguments(const Arguments& arguments) {
  const auto& options = arguments.layer_options;
  if (options.layout || options.num_heads || options.prefix)
    throw UsageError("--layout, --num-heads and --prefix describe safetensors/.npz weights; '" +
                     arguments.weights_path + "' is a Keras file (use --layer to pick a layer)");
  if (arguments.inputs_path == arguments.weights_path)
    throw UsageError("--inputs '" + arguments.inputs_path +
                     "' is the Keras weights file; expected a safetensors or .npz inputs file");
}

int main_checked(int argc, char** argv) {
  Arguments arguments;
  try {
    arguments = parse_arguments(argc, argv);
  } catch (const UsageError& error) {
    return report(error.what(), 2);
  }
  if (arguments.help) {
    std::cout << kUsage;
    return 0;
  }

  Step step{"reading the weights from " + in_quotes(arguments.weights_path), arguments.weights_path,
            in_quotes(arguments.weights_path) + ": "};
  try {
    std::optional<sdmha::io::TensorSource> weights;
    if (is_keras_weights(arguments)) {
      check_keras_arguments(arguments);
    } else {
      if (arguments.keras_layer || arguments.trusted_file)
        throw UsageError("--layer and --trusted-file are for Keras weights files; '" +
                         arguments.weights_path + "' is not one");
      weights = sdmha::io::TensorSource::open(arguments.weights_path);
    }
    std::optional<sdmha::io::TensorSource> separate_inputs;
    if (arguments.inputs_path != arguments.weights_path || !weights) {
      step = {"reading the inputs from " + in_quotes(arguments.inputs_path), arguments.inputs_path,
              in_quotes(arguments.inputs_path) + ": "};
      separate_inputs = sdmha::io::TensorSource::open(arguments.inputs_path);
    }
    const auto& inputs = separate_inputs ? *separate_inputs : *weights;
    const sdmha::io::TensorSource* weights_source = weights ? &*weights : nullptr;
    step = {"reading the inputs from " + in_quotes(arguments.inputs_path), arguments.inputs_path,
            in_quotes(arguments.inputs_path) + ": "};
    if (runs_in_double(inputs, arguments.inputs_path)) {
      run<double>(arguments, weights_source, inputs, step);
    } else {
      run<float>(arguments, weights_source, inputs, step);
    }
  } catch (const UsageError& error) {
    return report(error.what(), 2);
  } catch (const sdmha::Error& error) {
    return report(library_message(error, step), 1);
  } catch (const std::bad_alloc&) {
    return report("out of memory while " + step.description, 1);
  } catch (const std::exception& error) {
    return report(step.description + ": " + error.what(), 1);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return main_checked(argc, argv);
  } catch (const std::bad_alloc&) {
    return report("out of memory", 1);
  } catch (const std::exception& error) {
    return report(error.what(), 1);
  } catch (...) {
    return report("unexpected failure", 1);
  }
}
