// python/src/sdmha_python.cpp — the _sdmha extension module: sdmha's SparseDenseMHA on NumPy
// arrays, in float32 and float64 (classes Layer_float32 / Layer_float64 and their companions).
//
// Memory:
//  - inputs: C-contiguous arrays of the layer's dtype are read in place (TensorRef3 over the
//    NumPy buffer, SparseQuery::view_csr over the CSR arrays); anything else is converted once.
//  - weights: the layer holds a std::shared_ptr<MhaWeights<Scalar>>; weight(name) returns a
//    writable NumPy view of that memory, never a copy, kept alive by the Python layer object.
//    sdmha.torch makes its nn.Parameters views of it, so an optimizer's in-place step updates the
//    C++ weights directly (python/sdmha/torch.py explains the choice).
//  - results: output, scores and gradients are fresh C++ objects each call, handed to NumPy
//    without a copy (the array's base owns the C++ object).
// Every call releases the GIL while it computes. sdmha's exceptions become Python exceptions of
// the same names, all subclasses of sdmha.Error (itself a ValueError), carrying the C++ message.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <sdmha/kernels.hpp>
#include <sdmha/sdmha.hpp>
#if SDMHA_PYTHON_WITH_IO
#include <sdmha/io/layer_files.hpp>
// CMake says whether sdmha::io_keras (and so HDF5) is linked; other builds go by the header.
#if !defined(SDMHA_PYTHON_WITH_KERAS_FILES) && __has_include(<sdmha/io/keras_file.hpp>)
#define SDMHA_PYTHON_WITH_KERAS_FILES 1
#endif
#if SDMHA_PYTHON_WITH_KERAS_FILES
#include <sdmha/io/keras_isolated.hpp>
#endif
#endif
#ifndef SDMHA_PYTHON_WITH_KERAS_FILES
#define SDMHA_PYTHON_WITH_KERAS_FILES 0
#endif

namespace py = pybind11;

namespace {

using sdmha::Index;

template <typename Scalar>
constexpr const char* dtype_name() {
  return sizeof(Scalar) == 4 ? "float32" : "float64";
}

template <typename Scalar>
using InArray = py::array_t<Scalar, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;
using BoolArray = py::array_t<bool, py::array::c_style | py::array::forcecast>;

// ---- exceptions ---------------------------------------------------------------------------------

struct PythonErrors {
  PyObject* error = nullptr;
  PyObject* shape = nullptr;
  PyObject* index = nullptr;
  PyObject* config = nullptr;
  PyObject* format = nullptr;
  PyObject* io = nullptr;
};
PythonErrors python_errors;

PyObject* new_exception(py::module_& module, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("sdmha._sdmha.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw py::error_already_set();
  module.add_object(name, py::handle(type));  // the module keeps its own reference
  return type;
}

template <typename Error, typename... Parts>
[[noreturn]] void fail(const char* where, Parts&&... parts) {
  sdmha::detail::fail<Error>(where, std::forward<Parts>(parts)...);
}

// ---- arrays over C++ memory ---------------------------------------------------------------------

// A capsule that owns a shared_ptr: the base of NumPy arrays viewing the object's memory.
template <typename Holder>
py::capsule owner_of(std::shared_ptr<Holder> holder) {
  return py::capsule(new std::shared_ptr<Holder>(std::move(holder)),
                     [](void* pointer) { delete static_cast<std::shared_ptr<Holder>*>(pointer); });
}

// A C-contiguous array over `data`, without a copy; `base` keeps the memory alive.
template <typename Scalar>
py::array_t<Scalar> view(const Scalar* data, std::vector<py::ssize_t> shape, py::handle base) {
  py::ssize_t size = 1;
  for (const auto extent : shape) size *= extent;
  if (size == 0) return py::array_t<Scalar>(shape);  // nothing to share (and data may be null)
  return py::array_t<Scalar>(std::move(shape), data, base);
}

// ---- recycled result buffers
// ----------------------------------------------------------------------

// A free list of result buffers of one kind (one Eigen matrix, vector or tensor per call). Every
// array that a call returns owns its buffer; when Python frees the array, the buffer comes back
// here, and the next call writes into that memory instead of fresh pages. Fresh pages are not
// free: a training step's query-kernel gradient alone is 64 MB on the bow workload, and faulting
// in 64 MB took 0.8 s on the loaded 2-core test machine. A buffer is reused only once no array
// shows it any more, so results never alias.
template <typename Buffer>
class Recycler : public std::enable_shared_from_this<Recycler<Buffer>> {
 public:
  using Scalar = typename Buffer::Scalar;
  static constexpr std::size_t kKept = 2;  // free buffers kept, at most

  // Swaps a free buffer, if there is one, into `target` (an empty buffer to be filled).
  void lend(Buffer& target) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return;
    std::swap(target, free_.back());
    free_.pop_back();
  }

  // An array of `shape` over `buffer` (moved in), which comes back here when the array dies.
  py::object adopt(Buffer&& buffer, std::vector<py::ssize_t> shape) {
    struct Owned {
      std::shared_ptr<Recycler> home;
      Buffer buffer;
    };
    auto* owned = new Owned{this->shared_from_this(), std::move(buffer)};
    const py::capsule base(owned, [](void* pointer) {
      auto* dead = static_cast<Owned*>(pointer);
      dead->home->give_back(std::move(dead->buffer));
      delete dead;
    });
    return view<Scalar>(owned->buffer.data(), std::move(shape), base);
  }

 private:
  void give_back(Buffer&& buffer) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < kKept) free_.push_back(std::move(buffer));
  }

  std::mutex mutex_;
  std::vector<Buffer> free_;
};

template <typename Buffer>
std::shared_ptr<Recycler<Buffer>> recycler() {
  return std::make_shared<Recycler<Buffer>>();
}

// ---- inputs -------------------------------------------------------------------------------------

// "(2, 3)", "(5,)": an array's shape as Python prints it.
std::string shape_text(const py::array& array) {
  std::string text = "(";
  for (py::ssize_t i = 0; i < array.ndim(); ++i)
    text += (i ? ", " : "") + std::to_string(array.shape(i));
  return text + (array.ndim() == 1 ? ",)" : ")");
}

template <typename Scalar>
sdmha::TensorRef3<Scalar> tensor3(const char* where, const char* name,
                                  const InArray<Scalar>& array) {
  if (array.ndim() != 3)
    fail<sdmha::ShapeError>(where, name, " has ", array.ndim(),
                            " dimensions; expected 3 (batch, steps, width)");
  return sdmha::TensorRef3<Scalar>(array.data(), array.shape(0), array.shape(1), array.shape(2));
}

// A 1-D integer array as int (sdmha's CSR index type): viewed when it already is C-contiguous
// int32, otherwise converted with a range check into `storage`.
const int* int_indices(const char* where, const char* name, const py::array& array,
                       std::vector<int>& storage, py::object& keep) {
  if (array.ndim() != 1)
    fail<sdmha::ShapeError>(where, name, " has ", array.ndim(), " dimensions; expected 1");
  const char kind = array.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string("sdmha: ") + where + ": " + name + " has dtype " +
                         std::string(py::str(array.dtype())) + "; expected an integer array");
  if (array.dtype().is(py::dtype::of<int>()) && (array.flags() & py::array::c_style)) {
    keep = array;
    return static_cast<const int*>(array.data());
  }
  const Int64Array wide = Int64Array::ensure(array);
  if (!wide) throw py::error_already_set();
  storage.resize(std::size_t(wide.size()));
  const std::int64_t* data = wide.data();
  for (py::ssize_t i = 0; i < wide.size(); ++i) {
    if (data[i] < 0 || data[i] > std::int64_t(std::numeric_limits<int>::max()))
      fail<sdmha::IndexError>(where, name, "[", i, "] = ", data[i],
                              " does not fit sdmha's int index type; expected 0 <= value <= ",
                              std::numeric_limits<int>::max());
    storage[std::size_t(i)] = int(data[i]);
  }
  return storage.data();
}

// The query of a call: a SparseQuery and whatever memory its view needs.
template <typename Scalar>
struct PyQuery {
  sdmha::SparseQuery<Scalar> query;
  std::vector<int> offsets_storage, columns_storage;
  py::object keep_offsets, keep_columns, keep_values;  // the caller's arrays that `query` views
  bool coo_entries = false;  // made by from_coo: gradients per input entry

  static std::shared_ptr<PyQuery> from_csr(Index batch, Index steps, Index features,
                                           const py::array& indptr, const py::array& indices,
                                           const InArray<Scalar>& values) {
    constexpr const char* where = "SparseQuery.from_csr";
    auto holder = std::make_shared<PyQuery>();
    if (values.ndim() != 1)
      fail<sdmha::ShapeError>(where, "values has ", values.ndim(), " dimensions; expected 1");
    const int* offsets =
        int_indices(where, "indptr", indptr, holder->offsets_storage, holder->keep_offsets);
    const int* columns =
        int_indices(where, "indices", indices, holder->columns_storage, holder->keep_columns);
    if (indices.size() != values.size())
      fail<sdmha::ShapeError>(where, "indices has ", indices.size(), " entries but values has ",
                              values.size(), "; expected equal lengths");
    holder->keep_values = values;
    holder->query = sdmha::SparseQuery<Scalar>::view_csr(
        batch, steps, features, offsets, indptr.size(), columns, values.data(), values.size());
    return holder;
  }

  static std::shared_ptr<PyQuery> from_coo(Index batch, Index steps, Index features,
                                           const Int64Array& indices,
                                           const InArray<Scalar>& values) {
    constexpr const char* where = "SparseQuery.from_coo";
    if (indices.ndim() != 2 || indices.shape(1) != 3)
      fail<sdmha::ShapeError>(where, "indices has shape ", shape_text(indices),
                              "; expected (nnz, 3) (batch, step, feature)");
    if (values.ndim() != 1)
      fail<sdmha::ShapeError>(where, "values has ", values.ndim(), " dimensions; expected 1");
    using Coo = typename sdmha::SparseQuery<Scalar>::CooIndices;
    auto holder = std::make_shared<PyQuery>();
    const Eigen::Map<const Coo> coordinates(indices.data(), indices.shape(0), 3);
    const Eigen::Map<const sdmha::Vector<Scalar>> entries(values.data(), values.size());
    {
      py::gil_scoped_release release;
      holder->query =
          sdmha::SparseQuery<Scalar>::from_coo(batch, steps, features, coordinates, entries);
    }
    holder->coo_entries = true;
    return holder;
  }
};

// Options and the per-call objects, from keyword arguments. options.attention_mask and
// options.attention_bias are views (sdmha::BroadcastRef) of the NumPy arrays kept here, which
// live as long as the CallArguments, i.e. the whole call.
template <typename Scalar>
struct CallArguments {
  sdmha::AttentionOptions<Scalar> options;
  sdmha::Workspace<Scalar>* workspace = nullptr;
  std::shared_ptr<sdmha::ProjectedContext<Scalar>> context;
  py::object keep_workspace;
  py::object keep_mask, keep_bias;      // the contiguous arrays the options view
  py::object keep_key_mask;             // the key mask's, likewise
  std::vector<py::ssize_t> bias_shape;  // the bias as given, for its gradient
};

// A (T, S), (B, T, S) or (B, H, T, S) array as a BroadcastRef over its data (rank 3 is
// (B, T, S), as sdmha reads it); `array` must be C-contiguous and outlive the view. An array
// with no elements and every dimension 0 means none.
template <typename T>
sdmha::BroadcastRef<T> broadcast_view(const char* where, const char* name, const py::array& array) {
  const py::ssize_t rank = array.ndim();
  if (rank < 2 || rank > 4)
    fail<sdmha::ShapeError>(where, name, " has shape ", shape_text(array),
                            "; expected (T, S), (B, T, S) or (B, H, T, S) with B or H possibly 1");
  bool all_zero = true;
  for (py::ssize_t axis = 0; axis < rank; ++axis) all_zero = all_zero && array.shape(axis) == 0;
  if (all_zero) return {};
  const Index key_steps = array.shape(rank - 1), steps = array.shape(rank - 2);
  const Index batch = rank >= 3 ? array.shape(0) : 1;
  const Index heads = rank == 4 ? array.shape(1) : 1;
  return sdmha::BroadcastRef<T>(static_cast<const T*>(array.data()), batch, heads, steps, key_steps,
                                int(rank));
}

inline sdmha::CausalAlignment alignment_from(const std::string& name) {
  if (name == "top_left") return sdmha::CausalAlignment::top_left;
  if (name == "bottom_right") return sdmha::CausalAlignment::bottom_right;
  fail<sdmha::ConfigError>("options", "causal_alignment = '", name,
                           "'; expected 'top_left' or 'bottom_right'");
}

// input_gradients=("query_values", "key", "value") or any part of it: the inputs whose
// gradients backward returns.
inline sdmha::InputGradients input_gradients_from(const char* where, const py::handle& names) {
  if (py::isinstance<py::str>(names))
    fail<sdmha::ConfigError>(where, "input_gradients is the string '", names.cast<std::string>(),
                             "'; expected a tuple of names, such as ('key', 'value')");
  sdmha::InputGradients wanted{false, false, false};
  for (const py::handle item : names) {
    const std::string name = item.cast<std::string>();
    if (name == "query_values")
      wanted.query_values = true;
    else if (name == "key")
      wanted.key = true;
    else if (name == "value")
      wanted.value = true;
    else
      fail<sdmha::ConfigError>(where, "input_gradients names '", name,
                               "'; expected 'query_values', 'key' or 'value'");
  }
  return wanted;
}

inline sdmha::FullyMaskedRows fully_masked_from(const std::string& name) {
  if (name == "zeros") return sdmha::FullyMaskedRows::zeros;
  if (name == "uniform") return sdmha::FullyMaskedRows::uniform;
  fail<sdmha::ConfigError>("options", "fully_masked_rows = '", name,
                           "'; expected 'zeros' or 'uniform'");
}

inline sdmha::ScoreStrategy strategy_from(const std::string& name) {
  if (name == "automatic") return sdmha::ScoreStrategy::automatic;
  if (name == "project_first") return sdmha::ScoreStrategy::project_first;
  if (name == "sparse_regrouped") return sdmha::ScoreStrategy::sparse_regrouped;
  fail<sdmha::ConfigError>("options", "score_strategy = '", name,
                           "'; expected 'automatic', 'project_first' or 'sparse_regrouped'");
}

inline sdmha::Precision precision_from(const char* where, const std::string& name) {
  if (name == "float32") return sdmha::Precision::float32;
  if (name == "bfloat16") return sdmha::Precision::bfloat16;
  if (name == "bfloat16_query_kernel") return sdmha::Precision::bfloat16_query_kernel;
  fail<sdmha::ConfigError>(where, "precision = '", name,
                           "'; expected 'float32', 'bfloat16' or 'bfloat16_query_kernel'");
}

template <typename Scalar>
CallArguments<Scalar> call_arguments(const char* where, const py::dict& kwargs) {
  CallArguments<Scalar> call;
  auto& options = call.options;
  for (const auto& item : kwargs) {
    const std::string key = py::str(item.first);
    const py::handle value = item.second;
    try {
      if (key == "attention_mask") {
        if (value.is_none()) continue;
        const py::array given = py::array::ensure(value);
        if (!given) throw py::error_already_set();
        if (given.dtype().kind() != 'b')
          throw py::type_error(std::string("sdmha: ") + where + ": attention_mask has dtype " +
                               std::string(py::str(given.dtype())) +
                               "; expected bool (True = may attend)");
        const BoolArray mask = BoolArray::ensure(given);  // a copy only if not C-contiguous
        if (!mask) throw py::error_already_set();
        call.keep_mask = mask;
        options.attention_mask = broadcast_view<bool>(where, "attention_mask", mask);
      } else if (key == "attention_bias") {
        if (value.is_none()) continue;
        const InArray<Scalar> bias = InArray<Scalar>::ensure(value);  // the layer's dtype
        if (!bias) throw py::error_already_set();
        call.keep_bias = bias;
        call.bias_shape.assign(bias.shape(), bias.shape() + bias.ndim());
        options.attention_bias = broadcast_view<Scalar>(where, "attention_bias", bias);
      } else if (key == "compute_bias_gradient") {
        options.compute_bias_gradient = value.cast<bool>();
      } else if (key == "input_gradients") {
        options.input_gradients = input_gradients_from(where, value);
      } else if (key == "scale") {
        if (value.is_none()) continue;
        options.scale = value.cast<double>();
      } else if (key == "causal_alignment") {
        options.causal_alignment = alignment_from(value.cast<std::string>());
      } else if (key == "fully_masked_rows") {
        options.fully_masked_rows = fully_masked_from(value.cast<std::string>());
      } else if (key == "key_mask") {
        if (value.is_none()) continue;
        const BoolArray mask = BoolArray::ensure(value);  // a copy only if not C-contiguous bool
        if (!mask) throw py::error_already_set();
        if (mask.ndim() != 2)
          fail<sdmha::ShapeError>(where, "key_mask has ", mask.ndim(),
                                  " dimensions; expected 2 (B, S)");
        call.keep_key_mask = mask;
        options.key_mask = sdmha::TensorRef<bool, 2>(mask.data(), mask.shape(0), mask.shape(1));
      } else if (key == "key_padding_mask") {
        throw py::type_error(std::string("sdmha: ") + where +
                             ": key_padding_mask (PyTorch's, True = padding) is not taken here; "
                             "expected key_mask (True = may attend): pass ~key_padding_mask");
      } else if (key == "use_causal_mask") {
        options.use_causal_mask = value.cast<bool>();
      } else if (key == "return_attention_scores") {
        options.return_attention_scores = value.cast<bool>();
      } else if (key == "num_threads") {
        options.num_threads = value.cast<int>();
      } else if (key == "training") {
        options.training = value.cast<bool>();
      } else if (key == "dropout_rate") {
        options.dropout_rate = value.cast<double>();
      } else if (key == "dropout_seed") {
        options.dropout_seed = value.cast<std::uint64_t>();
      } else if (key == "score_strategy") {
        options.score_strategy = strategy_from(value.cast<std::string>());
      } else if (key == "workspace") {
        if (value.is_none()) continue;
        if (!py::isinstance<sdmha::Workspace<Scalar>>(value))
          throw py::type_error(std::string("sdmha: ") + where + ": workspace is a " +
                               std::string(py::str(py::type::of(value).attr("__name__"))) +
                               "; expected a Workspace of the layer's dtype (" +
                               dtype_name<Scalar>() + ")");
        call.workspace = &value.cast<sdmha::Workspace<Scalar>&>();
        call.keep_workspace = py::reinterpret_borrow<py::object>(value);
      } else if (key == "context") {
        if (value.is_none()) continue;
        if (!py::isinstance<sdmha::ProjectedContext<Scalar>>(value))
          throw py::type_error(
              std::string("sdmha: ") + where + ": context is not a Context of the layer's dtype (" +
              dtype_name<Scalar>() +
              "); expected the result of this layer's project_context(key, value)");
        call.context = value.cast<std::shared_ptr<sdmha::ProjectedContext<Scalar>>>();
      } else {
        throw py::type_error(std::string("sdmha: ") + where + ": unexpected keyword argument '" +
                             key + "'");
      }
    } catch (const py::cast_error&) {
      throw py::type_error(std::string("sdmha: ") + where + ": keyword argument '" + key +
                           "' has the wrong type (" +
                           std::string(py::str(py::type::of(value).attr("__name__"))) + ")");
    }
  }
  return call;
}

template <typename Scalar>
const PyQuery<Scalar>& query_of(const char* where, const py::handle& query) {
  if (!py::isinstance<PyQuery<Scalar>>(query))
    throw py::type_error(std::string("sdmha: ") + where + ": query is a " +
                         std::string(py::str(py::type::of(query).attr("__name__"))) +
                         "; expected a SparseQuery_" + dtype_name<Scalar>() +
                         " (sdmha.csr_query / sdmha.coo_query with the layer's dtype)");
  return query.cast<const PyQuery<Scalar>&>();
}

// ---- the layer ----------------------------------------------------------------------------------

template <typename Scalar>
sdmha::MhaWeights<Scalar> zero_weights(const sdmha::MhaConfig& config, Index query_dim,
                                       Index key_in_dim, Index value_in_dim) {
  // glorot_uniform checks the configuration and the widths with its own messages; the zeros
  // then cost nothing more than the draw.
  auto weights =
      sdmha::MhaWeights<Scalar>::glorot_uniform(config, query_dim, key_in_dim, value_in_dim, 0);
  for (auto* kernel :
       {&weights.query_kernel, &weights.key_kernel, &weights.value_kernel, &weights.output_kernel})
    kernel->setZero();
  return weights;
}

template <typename Scalar>
class PyLayer {
 public:
  using Layer = sdmha::SparseDenseMHA<Scalar>;
  static constexpr const char* weight_names[8] = {"query_kernel",  "query_bias",   "key_kernel",
                                                  "key_bias",      "value_kernel", "value_bias",
                                                  "output_kernel", "output_bias"};

  PyLayer(const sdmha::MhaConfig& config, std::shared_ptr<sdmha::MhaWeights<Scalar>> weights)
      : weights_(std::move(weights)), layer_(config, weights_) {}

  const Layer& layer() const { return layer_; }
  const sdmha::MhaConfig& config() const { return layer_.config(); }
  sdmha::LayerDims dims() const { return layer_.weights().validate(layer_.config()); }

  // The weight `name` as (data, shape) of the shared MhaWeights.
  std::pair<Scalar*, std::vector<py::ssize_t>> weight(const std::string& name) const {
    auto& w = *weights_;
    auto matrix = [](auto& m) {
      return std::make_pair(m.data(), std::vector<py::ssize_t>{m.rows(), m.cols()});
    };
    auto vector = [](auto& v) {
      return std::make_pair(v.data(), std::vector<py::ssize_t>{v.size()});
    };
    if (name == "query_kernel") return matrix(w.query_kernel);
    if (name == "key_kernel") return matrix(w.key_kernel);
    if (name == "value_kernel") return matrix(w.value_kernel);
    if (name == "output_kernel") return matrix(w.output_kernel);
    if (name == "query_bias") return vector(w.query_bias);
    if (name == "key_bias") return vector(w.key_bias);
    if (name == "value_bias") return vector(w.value_bias);
    if (name == "output_bias") return vector(w.output_bias);
    throw py::key_error(
        "sdmha: Layer: no weight named '" + name +
        "'; expected query_kernel, query_bias, key_kernel, key_bias, value_kernel, value_bias, "
        "output_kernel or output_bias");
  }

  void set_weight(const std::string& name, const InArray<Scalar>& array) {
    const auto [data, shape] = weight(name);
    bool same = array.ndim() == py::ssize_t(shape.size());
    for (std::size_t i = 0; same && i < shape.size(); ++i)
      same = array.shape(py::ssize_t(i)) == shape[i];
    if (!same) {
      std::string expected = "(";
      for (std::size_t i = 0; i < shape.size(); ++i)
        expected += (i ? ", " : "") + std::to_string(shape[i]);
      fail<sdmha::ShapeError>("Layer.set_weight", name, " has shape ", shape_text(array),
                              "; expected ", expected, shape.size() == 1 ? ",)" : ")");
    }
    // Exclusive: no call that released the GIL reads the weights or their copies meanwhile.
    const std::unique_lock<std::shared_mutex> lock = exclusive();
    if (array.size() > 0 && array.data() != data)
      std::copy(array.data(), array.data() + array.size(), data);
    // bfloat16 kernels are snapshots: round the new one (the mode stays what it was). Wq is
    // rounded in both bfloat16 modes, Wk, Wv and Wo in bfloat16 only.
    const sdmha::Precision precision = layer_.precision();
    const bool rounded = name == "query_kernel"
                             ? precision != sdmha::Precision::float32
                             : precision == sdmha::Precision::bfloat16 && name.size() > 7 &&
                                   name.compare(name.size() - 7, 7, "_kernel") == 0;
    if (rounded) layer_.set_precision(precision);
  }

  void set_precision(const std::string& precision) {
    const sdmha::Precision value = precision_from("Layer.set_precision", precision);
    const std::unique_lock<std::shared_mutex> lock = exclusive();
    layer_.set_precision(value);
  }
  std::string precision() const { return sdmha::to_string(layer_.precision()); }
  // Read under the GIL, as precision: the setters hold it while they change the engine.
  std::string bfloat16_gemm_engine() const { return layer_.bfloat16_gemm_engine(); }

  // What forward and backward read from their arguments, checked in this order: the query, the
  // call's keywords, then key and value (value None: the key again) as views; the value array is
  // kept here, since its view points into it.
  struct CallInputs {
    CallInputs(const char* where, const py::object& query_object, const InArray<Scalar>& key,
               const py::object& value_object, const py::kwargs& kwargs)
        : query(query_of<Scalar>(where, query_object)),
          call(call_arguments<Scalar>(where, kwargs)),
          value(value_object.is_none() ? key : value_object.cast<InArray<Scalar>>()),
          key_ref(tensor3<Scalar>(where, "key", key)),
          value_ref(tensor3<Scalar>(where, "value", value)) {}
    const PyQuery<Scalar>& query;
    CallArguments<Scalar> call;
    const InArray<Scalar> value;
    const sdmha::TensorRef3<Scalar> key_ref, value_ref;
  };

  // Runs body(workspace) without the GIL, under the shared side of the calls' lock (weights and
  // precision change under the exclusive side), on the call's workspace or one borrowed from the
  // layer's cache for the call.
  template <typename Body>
  void run_released(const CallArguments<Scalar>& call, Body&& body) const {
    py::gil_scoped_release release;
    const std::shared_lock<std::shared_mutex> lock(calls_mutex_);
    std::optional<typename sdmha::detail::WorkspaceCache<Scalar>::Borrowed> borrowed;
    body(call.workspace ? *call.workspace : borrowed.emplace(workspaces_).workspace());
  }

  py::tuple forward(const py::object& query_object, const InArray<Scalar>& key,
                    const py::object& value_object, const py::kwargs& kwargs) const {
    CallInputs in("Layer.forward", query_object, key, value_object, kwargs);
    const PyQuery<Scalar>& query = in.query;
    auto& call = in.call;
    const auto &key_ref = in.key_ref, &value_ref = in.value_ref;
    sdmha::AttentionResult<Scalar> result;
    recycled_.output->lend(result.output);
    const bool scores_wanted = call.options.return_attention_scores;
    if (scores_wanted) recycled_.scores->lend(result.attention_scores);
    run_released(call, [&](sdmha::Workspace<Scalar>& workspace) {
      if (call.context)
        layer_.forward(query.query, *call.context, call.options, workspace, result);
      else
        layer_.forward(query.query, {key_ref, value_ref}, call.options, workspace, result);
    });
    auto& out = result.output;
    const std::vector<py::ssize_t> output_shape{out.dimension(0), out.dimension(1),
                                                out.dimension(2)};
    py::object output = recycled_.output->adopt(std::move(out), output_shape);
    py::object scores = py::none();
    if (scores_wanted) {
      auto& s = result.attention_scores;
      const std::vector<py::ssize_t> shape{s.dimension(0), s.dimension(1), s.dimension(2),
                                           s.dimension(3)};
      scores = recycled_.scores->adopt(std::move(s), shape);
    }
    return py::make_tuple(output, scores);
  }

  py::dict backward(const py::object& query_object, const InArray<Scalar>& key,
                    const py::object& value_object, const InArray<Scalar>& d_output,
                    const py::kwargs& kwargs) const {
    constexpr const char* where = "Layer.backward";
    CallInputs in(where, query_object, key, value_object, kwargs);
    const PyQuery<Scalar>& query = in.query;
    auto& call = in.call;
    const auto &key_ref = in.key_ref, &value_ref = in.value_ref;
    const auto d_output_ref = tensor3<Scalar>(where, "d_output", d_output);
    sdmha::MhaGradients<Scalar> g;
    const bool bias = config().use_bias;
    RowMatrix* kernels[4] = {&g.query_kernel, &g.key_kernel, &g.value_kernel, &g.output_kernel};
    Vector* biases[4] = {&g.query_bias, &g.key_bias, &g.value_bias, &g.output_bias};
    for (int i = 0; i < 4; ++i) {
      recycled_.kernels[i]->lend(*kernels[i]);
      if (bias) recycled_.biases[i]->lend(*biases[i]);
    }
    const sdmha::InputGradients& wanted = call.options.input_gradients;
    if (wanted.query_values) recycled_.query_values->lend(g.query_values);
    if (wanted.key) recycled_.key->lend(g.key);
    if (wanted.value) recycled_.value->lend(g.value);
    run_released(call, [&](sdmha::Workspace<Scalar>& workspace) {
      if (call.context)
        layer_.backward(query.query, {key_ref, value_ref, *call.context}, d_output_ref,
                        call.options, workspace, g);
      else
        layer_.backward(query.query, {key_ref, value_ref}, d_output_ref, call.options, workspace,
                        g);
    });
    auto tensor = [](Recycler<Tensor3>& home, Tensor3& t) {
      const std::vector<py::ssize_t> shape{t.dimension(0), t.dimension(1), t.dimension(2)};
      return home.adopt(std::move(t), shape);
    };
    py::dict result;
    for (int i = 0; i < 4; ++i) {
      RowMatrix& kernel = *kernels[i];
      const std::vector<py::ssize_t> shape{kernel.rows(), kernel.cols()};
      result[kKernelNames[i]] = recycled_.kernels[i]->adopt(std::move(kernel), shape);
      Vector& b = *biases[i];
      const std::vector<py::ssize_t> length{b.size()};
      result[kBiasNames[i]] = bias ? recycled_.biases[i]->adopt(std::move(b), length) : py::none();
    }
    const std::vector<py::ssize_t> nonzeros{g.query_values.size()};
    result["query_values"] =
        wanted.query_values ? recycled_.query_values->adopt(std::move(g.query_values), nonzeros)
                            : py::none();
    result["key"] = wanted.key ? tensor(*recycled_.key, g.key) : py::none();
    result["value"] = wanted.value ? tensor(*recycled_.value, g.value) : py::none();
    if (call.options.compute_bias_gradient && !call.options.attention_bias.empty())
      result["attention_bias"] = bias_gradient(call, std::move(g.attention_bias));
    return result;
  }

  // K and V into a context of the layer's pool: one that no Python object holds any more (the
  // same memory again), or a new one. With a workspace, no thread is started either.
  std::shared_ptr<sdmha::ProjectedContext<Scalar>> project_context(
      const InArray<Scalar>& key, const py::object& value_object, int num_threads,
      const py::object& workspace_object) {
    constexpr const char* where = "Layer.project_context";
    const InArray<Scalar> value =
        value_object.is_none() ? key : value_object.cast<InArray<Scalar>>();
    const auto key_ref = tensor3<Scalar>(where, "key", key);
    const auto value_ref = tensor3<Scalar>(where, "value", value);
    py::dict options;
    options["workspace"] = workspace_object;
    auto call = call_arguments<Scalar>(where, options);
    std::shared_ptr<sdmha::ProjectedContext<Scalar>> context;
    {
      // Under the GIL: Python objects hold the other references, and they change only under it.
      const std::lock_guard<std::mutex> lock(contexts_mutex_);
      for (const auto& pooled : contexts_)
        if (pooled.use_count() == 1) context = pooled;
      if (!context) {
        context = std::make_shared<sdmha::ProjectedContext<Scalar>>();
        if (contexts_.size() < 2) contexts_.push_back(context);
      }
    }
    run_released(call, [&](sdmha::Workspace<Scalar>& workspace) {
      layer_.project_context(key_ref, value_ref, workspace, *context, num_threads);
    });
    return context;
  }

 private:
  // The (B', H', T, S) bias gradient in the shape the bias was given in (same element order).
  static py::object bias_gradient(const CallArguments<Scalar>& call,
                                  Eigen::Tensor<Scalar, 4, Eigen::RowMajor>&& gradient) {
    auto owned = std::make_shared<Eigen::Tensor<Scalar, 4, Eigen::RowMajor>>(std::move(gradient));
    return view<Scalar>(owned->data(), call.bias_shape, owner_of(owned));
  }

  using RowMatrix = sdmha::RowMatrix<Scalar>;
  using Vector = sdmha::Vector<Scalar>;
  using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;
  using Tensor4 = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;
  static constexpr const char* kKernelNames[4] = {"query_kernel", "key_kernel", "value_kernel",
                                                  "output_kernel"};
  static constexpr const char* kBiasNames[4] = {"query_bias", "key_bias", "value_bias",
                                                "output_bias"};

  // One free list per result, so that each buffer comes back to a call of the same shape.
  struct Recycled {
    std::shared_ptr<Recycler<RowMatrix>> kernels[4] = {
        recycler<RowMatrix>(), recycler<RowMatrix>(), recycler<RowMatrix>(), recycler<RowMatrix>()};
    std::shared_ptr<Recycler<Vector>> biases[4] = {recycler<Vector>(), recycler<Vector>(),
                                                   recycler<Vector>(), recycler<Vector>()};
    std::shared_ptr<Recycler<Vector>> query_values = recycler<Vector>();
    std::shared_ptr<Recycler<Tensor3>> key = recycler<Tensor3>(), value = recycler<Tensor3>();
    std::shared_ptr<Recycler<Tensor3>> output = recycler<Tensor3>();
    std::shared_ptr<Recycler<Tensor4>> scores = recycler<Tensor4>();
  };

  std::shared_ptr<sdmha::MhaWeights<Scalar>> weights_;
  Layer layer_;
  Recycled recycled_;
  std::mutex contexts_mutex_;
  std::vector<std::shared_ptr<sdmha::ProjectedContext<Scalar>>> contexts_;  // at most 2 kept
  // Workspaces for the calls given none (one per call that ran at the same time), so that a
  // repeated call reuses memory and threads instead of allocating and starting them again.
  sdmha::detail::WorkspaceCache<Scalar> workspaces_;
  // Calls that release the GIL (forward, backward, project_context) hold it shared; set_weight
  // and the precision setters exclusively, so that they never free or rewrite the bfloat16
  // copies or the weights under a running call. Taken after the GIL is released and released
  // before it is taken back, so a waiting setter (holding the GIL) cannot deadlock a call.
  mutable std::shared_mutex calls_mutex_;
  // The exclusive lock, waited for without the GIL (the running calls never need it to finish).
  std::unique_lock<std::shared_mutex> exclusive() const {
    py::gil_scoped_release release;
    return std::unique_lock<std::shared_mutex>(calls_mutex_);
  }
};

template <typename Scalar>
std::shared_ptr<PyLayer<Scalar>> make_layer(Index num_heads, Index key_dim, Index query_dim,
                                            Index key_in_dim, Index value_in_dim, Index value_dim,
                                            Index output_dim, bool use_bias,
                                            const std::optional<std::uint64_t>& seed) {
  const sdmha::MhaConfig config{num_heads, key_dim, value_dim, output_dim, use_bias};
  auto weights = std::make_shared<sdmha::MhaWeights<Scalar>>(
      seed ? sdmha::MhaWeights<Scalar>::glorot_uniform(config, query_dim, key_in_dim, value_in_dim,
                                                       *seed)
           : zero_weights<Scalar>(config, query_dim, key_in_dim, value_in_dim));
  return std::make_shared<PyLayer<Scalar>>(config, std::move(weights));
}

// Workspace_<dtype> and Context_<dtype>: the per-call memory and the projected K and V.
template <typename Scalar>
void bind_workspace_and_context(py::module_& m, const std::string& suffix) {
  py::class_<sdmha::Workspace<Scalar>>(
      m, ("Workspace" + suffix).c_str(),
      "Per-call memory and worker threads kept between calls (sdmha::Workspace). "
      "Serves one call at a time: a concurrent second user gets ConfigError.")
      .def(py::init<>())
      .def_property_readonly("bytes", &sdmha::Workspace<Scalar>::bytes,
                             "bytes held, all buffers included")
      .def_property_readonly("threads", &sdmha::Workspace<Scalar>::threads,
                             "worker threads started so far")
      .def_property_readonly("dtype",
                             [](const sdmha::Workspace<Scalar>&) { return dtype_name<Scalar>(); });

  py::class_<sdmha::ProjectedContext<Scalar>, std::shared_ptr<sdmha::ProjectedContext<Scalar>>>(
      m, ("Context" + suffix).c_str(),
      "K and V projected once by Layer.project_context (sdmha::ProjectedContext)")
      .def_property_readonly("batch",
                             [](const sdmha::ProjectedContext<Scalar>& c) { return c.batch; })
      .def_property_readonly("key_steps",
                             [](const sdmha::ProjectedContext<Scalar>& c) { return c.key_steps; })
      .def_property_readonly(
          "dtype", [](const sdmha::ProjectedContext<Scalar>&) { return dtype_name<Scalar>(); });
}

// SparseQuery_<dtype>: the sparse query from CSR or COO arrays.
template <typename Scalar>
void bind_query(py::module_& m, const std::string& suffix) {
  py::class_<PyQuery<Scalar>, std::shared_ptr<PyQuery<Scalar>>>(
      m, ("SparseQuery" + suffix).c_str(),
      "The sparse query (B, T, Eq) as B*T CSR rows (sdmha::SparseQuery)")
      .def_static("from_csr", &PyQuery<Scalar>::from_csr, py::arg("batch"), py::arg("steps"),
                  py::arg("features"), py::arg("indptr"), py::arg("indices"), py::arg("values"),
                  "Views CSR arrays for batch*steps rows without copying them (int32 indices are "
                  "viewed, other "
                  "integer types converted once); the query keeps the arrays alive.")
      .def_static("from_coo", &PyQuery<Scalar>::from_coo, py::arg("batch"), py::arg("steps"),
                  py::arg("features"), py::arg("indices"), py::arg("values"),
                  "From COO coordinates (nnz, 3) int64 (batch, step, feature) in any order; "
                  "duplicates are summed. "
                  "Layer.backward then gives query_values per input entry, in input order.")
      .def_property_readonly("batch", [](const PyQuery<Scalar>& q) { return q.query.batch(); })
      .def_property_readonly("steps", [](const PyQuery<Scalar>& q) { return q.query.steps(); })
      .def_property_readonly("features",
                             [](const PyQuery<Scalar>& q) { return q.query.features(); })
      .def_property_readonly("nonzeros",
                             [](const PyQuery<Scalar>& q) { return q.query.nonzeros(); })
      .def_property_readonly("from_coo_entries",
                             [](const PyQuery<Scalar>& q) { return q.coo_entries; })
      .def_property_readonly("dtype", [](const PyQuery<Scalar>&) { return dtype_name<Scalar>(); })
      .def("coo_to_stored",
           [](const PyQuery<Scalar>& q) {
             const auto& map = q.query.coo_to_stored();
             py::array_t<std::int64_t> result(py::ssize_t(map.size()));
             std::copy(map.begin(), map.end(), result.mutable_data());
             return result;
           })
      .def("to_dense", [](const PyQuery<Scalar>& q) {
        auto dense = std::make_shared<sdmha::RowMatrix<Scalar>>(q.query.to_dense());
        return view<Scalar>(dense->data(), {q.query.batch(), q.query.steps(), q.query.features()},
                            owner_of(dense));
      });
}

// Layer_<dtype>: sdmha::SparseDenseMHA on NumPy arrays.
template <typename Scalar>
void bind_layer(py::module_& m, const std::string& suffix) {
  using L = PyLayer<Scalar>;
  py::class_<L, std::shared_ptr<L>>(
      m, ("Layer" + suffix).c_str(),
      "sdmha::SparseDenseMHA on NumPy arrays; weights in Keras' layout, shared with "
      "the views that weight(name) returns")
      .def(py::init(&make_layer<Scalar>), py::arg("num_heads"), py::arg("key_dim"),
           py::arg("query_dim"), py::arg("key_in_dim"), py::arg("value_in_dim"),
           py::arg("value_dim") = 0, py::arg("output_dim") = 0, py::arg("use_bias") = true,
           py::arg("seed") = py::none(),
           "seed=None: zero weights; an integer: sdmha's glorot_uniform(seed) (Keras' limits, "
           "biases zero)")
      .def_property_readonly("num_heads", [](const L& l) { return l.config().num_heads; })
      .def_property_readonly("key_dim", [](const L& l) { return l.config().key_dim; })
      .def_property_readonly("value_dim", [](const L& l) { return l.dims().value_dim; })
      .def_property_readonly("query_dim", [](const L& l) { return l.dims().query_dim; })
      .def_property_readonly("key_in_dim", [](const L& l) { return l.dims().key_in_dim; })
      .def_property_readonly("value_in_dim", [](const L& l) { return l.dims().value_in_dim; })
      .def_property_readonly("output_dim", [](const L& l) { return l.dims().output_dim; })
      .def_property_readonly("use_bias", [](const L& l) { return l.config().use_bias; })
      .def_property_readonly("dtype", [](const L&) { return dtype_name<Scalar>(); })
      .def_property_readonly_static("weight_names",
                                    [](const py::object&) {
                                      return std::vector<std::string>(std::begin(L::weight_names),
                                                                      std::end(L::weight_names));
                                    })
      .def(
          "weight",
          [](const py::object& self, const std::string& name) -> py::object {
            const L& layer = self.cast<const L&>();
            const auto [data, shape] = layer.weight(name);
            if (shape.size() == 1 && !layer.config().use_bias) return py::none();
            return view<Scalar>(data, shape, self);
          },
          py::arg("name"),
          "a writable view (no copy) of the weight; None for a bias when use_bias is False")
      .def("set_weight", &L::set_weight, py::arg("name"), py::arg("array"),
           "copies `array` (same shape) into the weight, in place (and rounds a bfloat16 kernel "
           "again)")
      .def("set_precision", &L::set_precision, py::arg("precision"),
           "'bfloat16' (float32 layers): every kernel rounded to bfloat16 now, a snapshot (call "
           "again after writing a kernel through weight(name); set_weight does it); the "
           "projections, scores and P·V run on bfloat16 dot products with float32 sums, their "
           "inputs rounded as read; backward then refuses. 'bfloat16_query_kernel': only Wq "
           "rounded, likewise a snapshot, the rest float32. 'float32': the weights as they are.")
      .def_property_readonly("precision", &L::precision,
                             "the mode set_precision last set ('float32' at first)")
      .def_property_readonly(
          "bfloat16_gemm_engine", &L::bfloat16_gemm_engine,
          "what the projections, scores and P·V run on, by the SDMHA_BFLOAT16_GEMMS value that "
          "forces it: 'off' (float32: precision is not 'bfloat16', or nothing beats float32 on "
          "this CPU), 'on' (vdpbf16ps), 'onednn', 'amx' (the CPU's tiles), 'amx-emulated'")
      .def("forward", &L::forward, py::arg("query"), py::arg("key"), py::arg("value") = py::none(),
           "forward(query, key, value=None, *, attention_mask=None, attention_bias=None, "
           "use_causal_mask=False, causal_alignment='top_left', scale=None, "
           "fully_masked_rows='zeros', key_mask=None, return_attention_scores=False, "
           "num_threads=0, training=False, dropout_rate=0.0, dropout_seed=0, "
           "score_strategy='automatic', workspace=None, context=None) -> (output (B, T, O), scores "
           "(B, H, T, S) or None). value=None means value = key; with a context, key and value are "
           "not read. attention_mask (bool, True = may attend) and attention_bias (the layer's "
           "dtype, added to the scaled scores) are (T, S), (B, T, S), (B, 1, T, S), (B, H, T, S) "
           "or (1, H, T, S) arrays, read in place when C-contiguous. key_mask: bool (B, S), True "
           "= key step s of batch entry b may be attended (the negation of PyTorch's "
           "key_padding_mask), read in place when C-contiguous bool.")
      .def("backward", &L::backward, py::arg("query"), py::arg("key"), py::arg("value"),
           py::arg("d_output"),
           "backward(query, key, value, d_output, **the forward's options) -> dict of gradients: "
           "the weights' "
           "names (biases None without use_bias), query_values, key, value, and attention_bias "
           "(in the bias's shape as given; only with an attention_bias and "
           "compute_bias_gradient=True). value=None means value = key (the two gradients are "
           "returned apart; add them). input_gradients=('query_values', 'key', 'value') by "
           "default: those left out are None and not computed (key and value each cost as much "
           "as their projection).")
      .def("project_context", &L::project_context, py::arg("key"), py::arg("value") = py::none(),
           py::arg("num_threads") = 0, py::arg("workspace") = py::none(),
           "K = key·Wk + bk and V = value·Wv + bv once, for forward/backward(context=). The layer "
           "keeps "
           "two contexts and reuses one that no Python object holds any more; with a workspace no "
           "thread is started.")
      .def(
          "resolve_strategy",
          [](const L& l, const py::object& query, Index key_steps, bool causal,
             const std::string& requested) {
            const auto& q = query_of<Scalar>("Layer.resolve_strategy", query);
            return std::string(sdmha::to_string(
                l.layer().resolve_strategy(strategy_from(requested), q.query, key_steps, causal)));
          },
          py::arg("query"), py::arg("key_steps"), py::arg("use_causal_mask") = false,
          py::arg("requested") = "automatic", "the score strategy a call would use");
}

// Every class of one dtype, named with its suffix (Layer_float32, ...).
template <typename Scalar>
void bind_dtype(py::module_& m) {
  const std::string suffix = std::string("_") + dtype_name<Scalar>();
  bind_workspace_and_context<Scalar>(m, suffix);
  bind_query<Scalar>(m, suffix);
  bind_layer<Scalar>(m, suffix);
}

#if SDMHA_PYTHON_WITH_IO
template <typename Scalar>
py::dict load_layer(const std::string& path, const std::optional<Index>& num_heads,
                    const std::optional<std::string>& layout,
                    const std::optional<std::string>& prefix,
                    const std::optional<bool>& use_causal_mask) {
  sdmha::io::LayerFileOptions options;
  options.num_heads = num_heads;
  options.prefix = prefix;
  options.use_causal_mask = use_causal_mask;
  if (layout) {
    if (*layout == "keras")
      options.layout = sdmha::io::WeightLayout::keras;
    else if (*layout == "torch")
      options.layout = sdmha::io::WeightLayout::torch;
    else
      fail<sdmha::ConfigError>("load_layer", "layout = '", *layout,
                               "'; expected 'keras' or 'torch'");
  }
  std::optional<sdmha::io::LayerFile<Scalar>> file;
  {
    py::gil_scoped_release release;
    file.emplace(sdmha::io::load_layer<Scalar>(sdmha::io::TensorSource::open(path), options));
  }
  auto weights = std::make_shared<sdmha::MhaWeights<Scalar>>(std::move(file->weights));
  py::dict result;
  result["layer"] = std::make_shared<PyLayer<Scalar>>(file->config, std::move(weights));
  result["layout"] = file->layout == sdmha::io::WeightLayout::keras ? "keras" : "torch";
  result["use_causal_mask"] = file->use_causal_mask;
  // The file's attention settings as forward's and backward's keyword arguments:
  // layer.forward(query, {key, value}, **loaded["options"]) runs the file's layer as the file says.
  py::dict settings;
  settings["use_causal_mask"] = file->use_causal_mask;
  settings["causal_alignment"] = sdmha::to_string(file->causal_alignment);
  settings["scale"] = file->scale ? py::cast(*file->scale) : py::none();
  settings["fully_masked_rows"] = sdmha::to_string(file->fully_masked_rows);
  result["options"] = settings;
  return result;
}

#if SDMHA_PYTHON_WITH_KERAS_FILES
// Isolated: io::load_keras_layer_isolated, the reader in a forked child (a file that crashes or
// hangs libhdf5 is an IoError, this interpreter untouched); else in this process, for trusted
// files only (docs/bad_input.md, "Trust boundary").
template <typename Scalar>
py::dict load_keras_layer(const std::string& path, const std::string& layer_name,
                          const std::optional<sdmha::MhaConfig>& config, bool isolated) {
  std::optional<sdmha::io::KerasLayer<Scalar>> file;
  {
    py::gil_scoped_release release;
    if (isolated)
      file.emplace(config ? sdmha::io::load_keras_layer_isolated<Scalar>(path, layer_name, *config)
                          : sdmha::io::load_keras_layer_isolated<Scalar>(path, layer_name));
    else
      file.emplace(config ? sdmha::io::load_keras_layer<Scalar>(path, layer_name, *config)
                          : sdmha::io::load_keras_layer<Scalar>(path, layer_name));
  }
  auto weights = std::make_shared<sdmha::MhaWeights<Scalar>>(std::move(file->weights));
  py::dict result;
  result["layer"] = std::make_shared<PyLayer<Scalar>>(file->config, std::move(weights));
  result["name"] = file->name;
  result["group"] = file->group;
  result["keras_version"] = file->keras_version;
  result["no_keras_version_reason"] = file->no_keras_version_reason;
  return result;
}
#endif

// Whether io::LayerInputs has an attention_bias member (files that carry one).
template <typename Inputs, typename = void>
struct has_attention_bias : std::false_type {};
template <typename Inputs>
struct has_attention_bias<Inputs, std::void_t<decltype(std::declval<Inputs&>().attention_bias)>>
    : std::true_type {};

// A row-major Eigen tensor of any rank as an array viewing it (None when it has no elements);
// `base` keeps it alive.
template <typename Tensor>
auto optional_tensor(const Tensor& tensor, const py::handle& base)
    -> decltype(Tensor::NumDimensions, py::object()) {
  if (tensor.size() == 0) return py::none();
  std::vector<py::ssize_t> shape;
  for (int axis = 0; axis < int(Tensor::NumDimensions); ++axis)
    shape.push_back(tensor.dimension(axis));
  return view<typename Tensor::Scalar>(tensor.data(), std::move(shape), base);
}

// io::BroadcastTensor (a (B', H', T, S) tensor and the rank it was stored with) as an array of
// the stored shape: (T, S), (B', T, S) or (B', H', T, S).
template <typename Stored>
auto optional_tensor(const Stored& stored, const py::handle& base)
    -> decltype(stored.tensor, stored.rank, py::object()) {
  if (stored.empty()) return py::none();
  const auto& t = stored.tensor;
  std::vector<py::ssize_t> shape;
  if (stored.rank == 2)
    shape = {t.dimension(2), t.dimension(3)};
  else if (stored.rank == 3)
    shape = {t.dimension(0), t.dimension(2), t.dimension(3)};
  else
    shape = {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
  using T = std::remove_const_t<std::remove_pointer_t<decltype(t.data())>>;
  return view<T>(t.data(), std::move(shape), base);
}

template <typename Scalar>
py::dict load_inputs(const std::string& path) {
  auto inputs = std::make_shared<sdmha::io::LayerInputs<Scalar>>();
  {
    py::gil_scoped_release release;
    *inputs = sdmha::io::load_inputs<Scalar>(sdmha::io::TensorSource::open(path));
  }
  auto query = std::make_shared<PyQuery<Scalar>>();
  query->query = std::move(inputs->query);
  query->coo_entries = true;
  const py::capsule base = owner_of(inputs);
  auto tensor = [&](const Eigen::Tensor<Scalar, 3, Eigen::RowMajor>& t) -> py::object {
    return view<Scalar>(t.data(), {t.dimension(0), t.dimension(1), t.dimension(2)}, base);
  };
  py::dict result;
  result["query"] = query;
  result["key"] = tensor(inputs->key);
  result["value"] = tensor(inputs->value);
  result["has_key"] = inputs->has_key;
  result["attention_mask"] = optional_tensor(inputs->attention_mask, base);
  if constexpr (has_attention_bias<sdmha::io::LayerInputs<Scalar>>::value)
    result["attention_bias"] = optional_tensor(inputs->attention_bias, base);
  else
    result["attention_bias"] = py::none();
  return result;
}
#endif

// The exception classes (sdmha.Error and its subclasses) and the translation of sdmha's.
void bind_errors(py::module_& m) {
  auto& e = python_errors;
  e.error =
      new_exception(m, "Error", PyExc_ValueError, "Bad input rejected by sdmha (sdmha::Error).");
  e.shape = new_exception(m, "ShapeError", e.error,
                          "Dimensions or shapes that disagree (sdmha::ShapeError).");
  const py::tuple index_bases = py::make_tuple(py::handle(e.error), py::handle(PyExc_IndexError));
  e.index = new_exception(
      m, "IndexError", index_bases.ptr(),
      "Sparse coordinates, CSR offsets or column indices out of range (sdmha::IndexError).");
  e.config = new_exception(
      m, "ConfigError", e.error,
      "An invalid configuration or option, or a workspace in use (sdmha::ConfigError).");
  e.format =
      new_exception(m, "FormatError", e.error, "A malformed file or tensor (sdmha::FormatError).");
  e.io = new_exception(m, "IoError", e.error,
                       "A file that cannot be opened or read (sdmha::IoError).");
  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const sdmha::ShapeError& error) {
      PyErr_SetString(python_errors.shape, error.what());
    } catch (const sdmha::IndexError& error) {
      PyErr_SetString(python_errors.index, error.what());
    } catch (const sdmha::ConfigError& error) {
      PyErr_SetString(python_errors.config, error.what());
    } catch (const sdmha::FormatError& error) {
      PyErr_SetString(python_errors.format, error.what());
    } catch (const sdmha::IoError& error) {
      PyErr_SetString(python_errors.io, error.what());
    } catch (const sdmha::Error& error) {
      PyErr_SetString(python_errors.error, error.what());
    }
  });
}

// What this module was compiled for and which GEMM engines run (sdmha/kernels.hpp).
void bind_kernels(py::module_& m) {
  py::list compiled_for;
#if defined(__AVX2__)
  compiled_for.append("avx2");
#endif
#if defined(__FMA__)
  compiled_for.append("fma");
#endif
#if defined(__AVX512F__)
  compiled_for.append("avx512f");
#endif
#if defined(__AVX512BF16__)
  compiled_for.append("avx512bf16");
#endif
  m.attr("compiled_for") = compiled_for;
  m.def(
      "active_kernels",
      [] {
        const sdmha::ActiveKernels kernels = sdmha::active_kernels();
        py::dict result;
        result["float32_gemm"] = kernels.avx512_float_gemm ? "avx512" : "eigen";
        result["bfloat16_gemm"] = kernels.avx512_bfloat16_gemm ? "avx512_bf16" : "portable";
        return result;
      },
      "sdmha::active_kernels(): {'float32_gemm': 'avx512' | 'eigen', 'bfloat16_gemm': "
      "'avx512_bf16' | 'portable'}");
}

}  // namespace

// Compiled once per instruction set (python/CMakeLists.txt), each module under its own name.
#ifndef SDMHA_PYTHON_MODULE_NAME
#define SDMHA_PYTHON_MODULE_NAME _sdmha
#endif

PYBIND11_MODULE(SDMHA_PYTHON_MODULE_NAME, m) {
  m.doc() = "sdmha's SparseDenseMHA (multi-head attention with a sparse CSR query) on NumPy arrays";
  m.attr("__version__") = std::to_string(SDMHA_VERSION_MAJOR) + "." +
                          std::to_string(SDMHA_VERSION_MINOR) + "." +
                          std::to_string(SDMHA_VERSION_PATCH);
  m.attr("with_io") = bool(SDMHA_PYTHON_WITH_IO);
  m.attr("with_keras_files") = bool(SDMHA_PYTHON_WITH_KERAS_FILES);

  bind_errors(m);
  bind_kernels(m);

  bind_dtype<float>(m);
  bind_dtype<double>(m);

#if SDMHA_PYTHON_WITH_IO
  m.def(
      "load_layer",
      [](const std::string& path, const std::string& dtype, const std::optional<Index>& num_heads,
         const std::optional<std::string>& layout, const std::optional<std::string>& prefix,
         const std::optional<bool>& use_causal_mask) -> py::dict {
        if (dtype == "float32")
          return load_layer<float>(path, num_heads, layout, prefix, use_causal_mask);
        if (dtype == "float64")
          return load_layer<double>(path, num_heads, layout, prefix, use_causal_mask);
        throw py::type_error("sdmha: load_layer: dtype = '" + dtype +
                             "'; expected 'float32' or 'float64'");
      },
      py::arg("path"), py::arg("dtype") = "float32", py::arg("num_heads") = py::none(),
      py::arg("layout") = py::none(), py::arg("prefix") = py::none(),
      py::arg("use_causal_mask") = py::none(),
      "sdmha::io::load_layer on a safetensors or .npz file (Keras' or PyTorch's names) -> "
      "{'layer': Layer_<dtype>, 'layout': 'keras'|'torch', 'use_causal_mask': bool, 'options': "
      "the file's use_causal_mask, causal_alignment, scale and fully_masked_rows as forward's "
      "keyword arguments}");
#if SDMHA_PYTHON_WITH_KERAS_FILES
  m.def(
      "load_keras_layer",
      [](const std::string& path, const std::string& dtype, const std::string& layer_name,
         const std::optional<Index>& num_heads, Index key_dim, Index value_dim, Index output_dim,
         bool use_bias, bool isolated) -> py::dict {
        std::optional<sdmha::MhaConfig> config;
        if (num_heads) {
          config.emplace();
          config->num_heads = *num_heads;
          config->key_dim = key_dim;
          config->value_dim = value_dim;
          config->output_dim = output_dim;
          config->use_bias = use_bias;
        }
        if (dtype == "float32") return load_keras_layer<float>(path, layer_name, config, isolated);
        if (dtype == "float64") return load_keras_layer<double>(path, layer_name, config, isolated);
        throw py::type_error("sdmha: load_keras_layer: dtype = '" + dtype +
                             "'; expected 'float32' or 'float64'");
      },
      py::arg("path"), py::arg("dtype") = "float32", py::arg("layer_name") = "",
      py::arg("num_heads") = py::none(), py::arg("key_dim") = 0, py::arg("value_dim") = 0,
      py::arg("output_dim") = 0, py::arg("use_bias") = true, py::arg("isolated") = true,
      "sdmha::io::load_keras_layer_isolated (isolated=True: the reader in a child process) or "
      "sdmha::io::load_keras_layer (isolated=False, trusted files only) on a Keras 3 .keras file, "
      "its unzipped directory or a .weights.h5 file: the MultiHeadAttention called layer_name (a "
      "Keras layer name, an HDF5 group path, or '' for the file's only one). num_heads (with "
      "key_dim, value_dim, output_dim, use_bias) gives the configuration a .weights.h5 lacks; "
      "otherwise it comes from config.json or the shapes. -> {'layer', 'name', 'group', "
      "'keras_version', 'no_keras_version_reason'}");
#endif
  m.def(
      "load_inputs",
      [](const std::string& path, const std::string& dtype) -> py::dict {
        if (dtype == "float32") return load_inputs<float>(path);
        if (dtype == "float64") return load_inputs<double>(path);
        throw py::type_error("sdmha: load_inputs: dtype = '" + dtype +
                             "'; expected 'float32' or 'float64'");
      },
      py::arg("path"), py::arg("dtype") = "float32",
      "sdmha::io::load_inputs -> {'query': SparseQuery_<dtype>, 'key', 'value', 'attention_mask' "
      "(bool) or None, 'attention_bias' or None, 'has_key'}");
#endif
}
