// sdmha_edit_safetensors — derives test files from a safetensors file, for the sdmha-run tests:
// drops tensors, overwrites an element, reshapes a tensor (same element count), relabels its
// dtype (same element size, bytes kept), sets metadata, and writes the result as safetensors or
// as a directory of .npy files ready to be zipped into an .npz (metadata as uint8 arrays
// "__metadata__/<key>.npy", the form sdmha's .npz reader takes).
//
//   sdmha_edit_safetensors IN (--out FILE | --npy-dir DIR) [--drop NAME]...
//       [--set NAME FLAT_INDEX VALUE]... [--reshape NAME D0,D1,...]... [--retype NAME DTYPE]...
//       [--metadata KEY VALUE]...
//
// Exit status: 0 on success, 2 on bad usage or a file it cannot read or write.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <sdmha/io/npy.hpp>
#include <sdmha/io/safetensors.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Tensor {
  sdmha::io::DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> bytes;  // little-endian elements, C order
};

template <typename T>
std::vector<std::uint8_t> as_bytes(const std::vector<T>& values) {
  std::vector<std::uint8_t> bytes(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

Tensor load(const sdmha::io::SafetensorsFile& file, const std::string& name) {
  using sdmha::io::DType;
  const auto& info = file.info(name);
  Tensor tensor{info.dtype, info.shape, {}};
  switch (info.dtype) {
    case DType::F32:
      tensor.bytes = as_bytes(file.read<float>(name));
      break;
    case DType::F64:
      tensor.bytes = as_bytes(file.read<double>(name));
      break;
    case DType::I64:
      tensor.bytes = as_bytes(file.read<std::int64_t>(name));
      break;
    case DType::I32:
      tensor.bytes = as_bytes(file.read<std::int32_t>(name));
      break;
    case DType::U8:
    case DType::BOOL:
      tensor.bytes = as_bytes(file.read<std::uint8_t>(name));
      break;
    default:
      throw std::runtime_error("tensor '" + name + "' has dtype " +
                               sdmha::io::dtype_name(info.dtype) +
                               ", which this tool does not copy");
  }
  return tensor;
}

template <typename T>
void store(Tensor& tensor, std::size_t index, T value) {
  std::memcpy(tensor.bytes.data() + index * sizeof(T), &value, sizeof(T));
}

void set_element(Tensor& tensor, const std::string& name, const std::string& index_text,
                 const std::string& value_text) {
  using sdmha::io::DType;
  const std::size_t size = sdmha::io::dtype_size(tensor.dtype);
  const std::size_t index = std::stoull(index_text);
  if (index >= tensor.bytes.size() / size) {
    throw std::runtime_error("--set " + name + ": index " + index_text + " is past its " +
                             std::to_string(tensor.bytes.size() / size) + " elements");
  }
  switch (tensor.dtype) {
    case DType::F32:
      store(tensor, index, std::stof(value_text));
      break;
    case DType::F64:
      store(tensor, index, std::stod(value_text));
      break;
    case DType::I64:
      store(tensor, index, static_cast<std::int64_t>(std::stoll(value_text)));
      break;
    case DType::I32:
      store(tensor, index, static_cast<std::int32_t>(std::stol(value_text)));
      break;
    default:
      store(tensor, index, static_cast<std::uint8_t>(std::stoul(value_text)));
      break;
  }
}

std::vector<std::int64_t> parse_shape(const std::string& text) {
  std::vector<std::int64_t> shape;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) shape.push_back(std::stoll(item));
  return shape;
}

int usage(const std::string& problem) {
  std::cerr
      << "sdmha_edit_safetensors: " << problem
      << "\nusage: sdmha_edit_safetensors IN (--out FILE | --npy-dir DIR) [--drop NAME]... "
         "[--set NAME FLAT_INDEX VALUE]... [--reshape NAME D0,D1,...]... [--retype NAME DTYPE]... "
         "[--metadata KEY VALUE]...\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage("too few arguments");
  try {
    const auto input = sdmha::io::SafetensorsFile::open(argv[1]);
    std::map<std::string, Tensor> tensors;
    for (const auto& name : input.names()) tensors.emplace(name, load(input, name));
    std::map<std::string, std::string> metadata = input.metadata();
    std::string out_file, npy_dir;

    auto find = [&](const std::string& name) -> Tensor& {
      const auto it = tensors.find(name);
      if (it == tensors.end()) throw std::runtime_error("no tensor named '" + name + "'");
      return it->second;
    };
    for (int i = 2; i < argc; ++i) {
      const std::string flag = argv[i];
      const auto take = [&](int count) {
        if (i + count >= argc)
          throw std::runtime_error(flag + " needs " + std::to_string(count) + " values");
        std::vector<std::string> values(argv + i + 1, argv + i + 1 + count);
        i += count;
        return values;
      };
      if (flag == "--out") {
        out_file = take(1)[0];
      } else if (flag == "--npy-dir") {
        npy_dir = take(1)[0];
      } else if (flag == "--drop") {
        const auto name = take(1)[0];
        find(name);
        tensors.erase(name);
      } else if (flag == "--set") {
        const auto values = take(3);
        set_element(find(values[0]), values[0], values[1], values[2]);
      } else if (flag == "--reshape") {
        const auto values = take(2);
        find(values[0]).shape = parse_shape(values[1]);
      } else if (flag == "--retype") {
        const auto values = take(2);
        Tensor& tensor = find(values[0]);
        const auto dtype = sdmha::detail::dtype_from_name(values[1]);
        if (!dtype || sdmha::io::dtype_size(*dtype) != sdmha::io::dtype_size(tensor.dtype)) {
          throw std::runtime_error("--retype " + values[0] + " " + values[1] +
                                   ": expected a dtype of the same element size");
        }
        tensor.dtype = *dtype;
      } else if (flag == "--metadata") {
        const auto values = take(2);
        metadata[values[0]] = values[1];
      } else {
        return usage("unknown argument '" + flag + "'");
      }
    }
    if (out_file.empty() == npy_dir.empty())
      return usage("expected exactly one of --out and --npy-dir");

    if (!out_file.empty()) {
      sdmha::io::SafetensorsWriter writer;
      for (const auto& [name, tensor] : tensors) {
        writer.add(name, tensor.dtype, tensor.shape, tensor.bytes.data(), tensor.bytes.size());
      }
      for (const auto& [key, value] : metadata) writer.set_metadata(key, value);
      writer.write(out_file);
      return 0;
    }
    const std::filesystem::path directory(npy_dir);
    auto write = [&](const std::string& name, const Tensor& tensor) {
      const auto path = directory / (name + ".npy");
      std::filesystem::create_directories(path.parent_path());
      sdmha::io::write_npy(path.string(), tensor.dtype, tensor.shape, tensor.bytes.data(),
                           tensor.bytes.size());
    };
    for (const auto& [name, tensor] : tensors) write(name, tensor);
    for (const auto& [key, value] : metadata) {
      write("__metadata__/" + key, Tensor{sdmha::io::DType::U8,
                                          {static_cast<std::int64_t>(value.size())},
                                          std::vector<std::uint8_t>(value.begin(), value.end())});
    }
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "sdmha_edit_safetensors: " << error.what() << '\n';
    return 2;
  }
}
