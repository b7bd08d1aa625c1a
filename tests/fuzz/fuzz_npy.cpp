// tests/fuzz/fuzz_npy.cpp — the .npy parser and the .npz reader on arbitrary bytes.
//
// The bytes are parsed as a .npy file (parse_npy, then as<T>() for every element type), and the
// same bytes, written to a temporary file, are opened as an .npz archive (NpzFile: names, then
// read of every member) and as a TensorSource (which reads "__metadata__/..." members). Each
// step either succeeds with consistent sizes or throws an sdmha::Error.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <sdmha/io/layer_files.hpp>
#include <sdmha/io/npy.hpp>

#include "fuzz_support.hpp"

namespace {

using sdmha::io::NpyArray;

template <typename T>
void read_as(const NpyArray& array) {
  std::vector<T> values;
  if (!sdmha_fuzz::accepts([&] { values = array.template as<T>(); })) return;
  SDMHA_FUZZ_CHECK(std::int64_t(values.size()) == array.element_count());
}

void read_every_type(const NpyArray& array) {
  // An accepted array holds exactly its shape's elements.
  SDMHA_FUZZ_CHECK(std::uint64_t(array.element_count()) * sdmha::io::dtype_size(array.dtype) ==
                   array.data.size());
  read_as<float>(array);
  read_as<double>(array);
  read_as<std::int64_t>(array);
  read_as<std::int32_t>(array);
  read_as<std::uint8_t>(array);
  read_as<bool>(array);
}

// One temporary file per process (libFuzzer runs inputs one after another), removed at exit.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* directory = std::getenv("TMPDIR");
    std::string result = std::string(directory != nullptr ? directory : "/tmp") +
                         "/sdmha_fuzz_npy_" + std::to_string(::getpid()) + ".npz";
    std::atexit([] { std::remove(scratch_path().c_str()); });
    return result;
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  NpyArray array;
  if (sdmha_fuzz::accepts([&] { array = sdmha::io::parse_npy(data, size, "<fuzz>"); }))
    read_every_type(array);

  const std::string& path = scratch_path();
  {
    std::FILE* file = std::fopen(path.c_str(), "wb");
    SDMHA_FUZZ_CHECK(file != nullptr);
    SDMHA_FUZZ_CHECK(size == 0 || std::fwrite(data, 1, size, file) == size);
    SDMHA_FUZZ_CHECK(std::fclose(file) == 0);
  }
  std::optional<sdmha::io::NpzFile> archive;
  if (sdmha_fuzz::accepts([&] { archive = sdmha::io::NpzFile::open(path); })) {
    for (const std::string& name : archive->names()) {
      SDMHA_FUZZ_CHECK(archive->contains(name));
      NpyArray member;
      if (sdmha_fuzz::accepts([&] { member = archive->read(name); })) read_every_type(member);
    }
    sdmha_fuzz::accepts([&] { archive->read("no such member"); });
  }
  std::optional<sdmha::io::TensorSource> source;
  if (sdmha_fuzz::accepts([&] { source = sdmha::io::TensorSource::open(path); })) {
    for (const std::string& name : source->names()) {
      sdmha_fuzz::accepts([&] {
        const auto shape = source->shape(name);
        const auto values = source->read<double>(name);
        SDMHA_FUZZ_CHECK(std::int64_t(values.size()) ==
                         sdmha::detail::checked_element_count(shape).value_or(-1));
      });
    }
  }
  return 0;
}
