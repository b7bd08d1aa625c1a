// tests/support/io_test.hpp — what the file format tests (tests/io/) share: the data folder, the
// error types they expect, a check that a call throws one whose message holds every needle, a
// scratch directory per test, and files read and written whole as bytes.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include <sdmha/errors.hpp>

#ifndef SDMHA_TEST_DATA_DIR
#error "SDMHA_TEST_DATA_DIR must be defined as the absolute path of tests/data"
#endif

namespace sdmha_test {

namespace fs = std::filesystem;
using sdmha::FormatError;
using sdmha::IoError;
using sdmha::ShapeError;

// A file of tests/data, by its path below that folder.
inline std::string test_data(const std::string& relative) {
  return std::string(SDMHA_TEST_DATA_DIR) + "/" + relative;
}

// Runs `body`, which must throw ErrorType (any other exception fails the test by escaping) with a
// message that contains every needle.
template <typename ErrorType, typename Body>
void expect_error(Body&& body, std::initializer_list<std::string> needles) {
  try {
    body();
  } catch (const ErrorType& error) {
    const std::string message = error.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message: " << message << "\nlacks:   " << needle;
    }
    return;
  }
  ADD_FAILURE() << "no exception thrown; expected one mentioning " << *needles.begin();
}

// A fresh directory under the test temp dir, named after the running test, removed with
// everything in it.
class ScratchDirectory {
 public:
  ScratchDirectory() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(::testing::TempDir()) /
            ("sdmha_" + std::string(test->test_suite_name()) + "_" + test->name() + "_" +
             std::to_string(std::random_device{}()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDirectory() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }

  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  return std::vector<std::uint8_t>(std::istreambuf_iterator<char>(stream),
                                   std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream stream(path, std::ios::binary);
  stream.write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
}

}  // namespace sdmha_test
