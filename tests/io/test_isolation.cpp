// Tests of sdmha/io/detail/child_process.hpp (run_in_child: a function in a forked child under
// limits) and of sdmha/io/keras_isolated.hpp (the Keras loader run that way): a result comes back
// whole, a typed error keeps its type, and a crash, a hang or a runaway allocation in the child is
// an IoError naming the subject while this process goes on.
#include <gtest/gtest.h>

#include <csignal>
#include <string>
#include <vector>

#include "sdmha/io/detail/child_process.hpp"
#include "sdmha/io/isolation.hpp"

#ifdef SDMHA_HAS_KERAS_IO
#include "sdmha/io/keras_isolated.hpp"
#endif

namespace {

using sdmha::io::IsolationLimits;

IsolationLimits short_limits() {
  IsolationLimits limits;
  limits.seconds = 5.0;
  limits.memory_bytes = std::size_t(512) << 20;
  return limits;
}

template <typename Produce>
std::string isolated(Produce produce, const IsolationLimits& limits = short_limits()) {
  return sdmha::detail::run_in_child("test", "subject.bin", limits, produce);
}

// The message of the error `call` throws, which must be of type Expected.
template <typename Expected, typename Call>
std::string message_of(Call call) {
  try {
    call();
  } catch (const Expected& error) {
    return error.what();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "threw another type: " << error.what();
    return {};
  }
  ADD_FAILURE() << "threw nothing";
  return {};
}

TEST(RunInChild, ReturnsTheChildsBytesWhole) {
  std::string large(3 << 20, '\0');  // more than a pipe's buffer: read while the child writes
  for (std::size_t i = 0; i < large.size(); ++i) large[i] = char(i * 131 % 251);
  EXPECT_EQ(isolated([&] { return large; }), large);
  EXPECT_EQ(isolated([] { return std::string(); }), "");
}

TEST(RunInChild, ATypedErrorKeepsItsTypeAndMessage) {
  const auto format = message_of<sdmha::FormatError>(
      [] { isolated([]() -> std::string { throw sdmha::FormatError("bad header"); }); });
  EXPECT_EQ(format, "bad header");
  const auto shape = message_of<sdmha::ShapeError>(
      [] { isolated([]() -> std::string { throw sdmha::ShapeError("3 x 4"); }); });
  EXPECT_EQ(shape, "3 x 4");
}

// SIGABRT, as after the heap corruption seen in libhdf5 (and a signal that the sanitizers leave
// alone, where they would turn a SIGSEGV into a report and an exit status).
TEST(RunInChild, ACrashIsAnIoErrorNamingTheSubjectAndTheSignal) {
  const auto message = message_of<sdmha::IoError>([] {
    isolated([]() -> std::string {
      std::raise(SIGABRT);
      return "not reached";
    });
  });
  EXPECT_NE(message.find("subject.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("signal " + std::to_string(SIGABRT)), std::string::npos) << message;
}

TEST(RunInChild, AHangIsStoppedAtTheTimeLimit) {
  IsolationLimits limits = short_limits();
  limits.seconds = 0.5;
  const auto message = message_of<sdmha::IoError>([&] {
    isolated(
        []() -> std::string {
          for (;;) ::pause();
        },
        limits);
  });
  EXPECT_NE(message.find("longer than 0.5 s"), std::string::npos) << message;
  EXPECT_NE(message.find("subject.bin"), std::string::npos) << message;
}

TEST(RunInChild, AnAllocationBeyondTheMemoryLimitIsAnIoError) {
  if (!sdmha::detail::kLimitAddressSpace)
    GTEST_SKIP() << "a sanitizer build sets no address-space limit (its shadow memory needs "
                    "terabytes of it); the limit is tested by the plain builds";
  const auto message = message_of<sdmha::IoError>([] {
    isolated([]() -> std::string {
      std::vector<char> huge(std::size_t(2) << 30, 'x');  // 2 GiB against a 512 MiB limit
      return std::string(1, huge[12345]);
    });
  });
  EXPECT_NE(message.find("subject.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("out of memory"), std::string::npos) << message;
}

TEST(RunInChild, RefusesLimitsThatAreNotPositive) {
  IsolationLimits limits;
  limits.seconds = 0.0;
  EXPECT_THROW(isolated([] { return std::string(); }, limits), sdmha::ConfigError);
}

TEST(IsolationLimits, AReadersTimeGrowsWithItsFileUpToSeconds) {
  IsolationLimits limits;  // 5 s, plus 30 s per GiB, at most 60 s
  EXPECT_DOUBLE_EQ(sdmha::io::reader_seconds(limits, 0.0), 5.0);
  EXPECT_DOUBLE_EQ(sdmha::io::reader_seconds(limits, 32564.0), 5.0);  // + 0.0009 s, in tenths
  EXPECT_DOUBLE_EQ(sdmha::io::reader_seconds(limits, double(1 << 30)), 35.0);
  EXPECT_DOUBLE_EQ(sdmha::io::reader_seconds(limits, 4.0 * double(1 << 30)), 60.0);
  limits.small_file_seconds = 0.0;  // `seconds` alone
  EXPECT_DOUBLE_EQ(sdmha::io::reader_seconds(limits, 0.0), 60.0);
}

#ifdef SDMHA_HAS_KERAS_IO

std::string keras_file(const std::string& name) {
  return std::string(SDMHA_TEST_DATA_DIR) + "/keras/" + name;
}

TEST(KerasIsolated, LoadsTheSameLayerAsTheInProcessReader) {
  for (const char* name : {"functional_bias.keras", "functional_bias.weights.h5"}) {
    const auto path = keras_file(name);
    const auto direct = sdmha::io::load_keras_layer<double>(path, "");
    const auto isolated_layer = sdmha::io::load_keras_layer_isolated<double>(path, "");
    EXPECT_EQ(isolated_layer.name, direct.name) << name;
    EXPECT_EQ(isolated_layer.group, direct.group) << name;
    EXPECT_EQ(isolated_layer.keras_version, direct.keras_version) << name;
    EXPECT_EQ(isolated_layer.no_keras_version_reason, direct.no_keras_version_reason) << name;
    EXPECT_EQ(isolated_layer.config.num_heads, direct.config.num_heads) << name;
    EXPECT_EQ(isolated_layer.config.output_dim, direct.config.output_dim) << name;
    EXPECT_EQ(isolated_layer.config.use_bias, direct.config.use_bias) << name;
    EXPECT_EQ(isolated_layer.weights.query_kernel, direct.weights.query_kernel) << name;
    EXPECT_EQ(isolated_layer.weights.output_kernel, direct.weights.output_kernel) << name;
    EXPECT_EQ(isolated_layer.weights.value_bias, direct.weights.value_bias) << name;
    EXPECT_EQ(isolated_layer.dims.query_dim, direct.dims.query_dim) << name;
  }
}

TEST(KerasIsolated, TheReadersErrorsArriveWithTheirType) {
  EXPECT_THROW(sdmha::io::load_keras_layer_isolated<float>(keras_file("bad_shape.keras"), ""),
               sdmha::FormatError);
  EXPECT_THROW(sdmha::io::load_keras_layer_isolated<float>(keras_file("no_such_file.keras"), ""),
               sdmha::IoError);
  sdmha::io::KerasReadOptions strict;  // a .weights.h5 has no metadata.json
  strict.require_keras_version = true;
  EXPECT_THROW(sdmha::io::load_keras_layer_isolated<float>(keras_file("functional_bias.weights.h5"),
                                                           "", strict),
               sdmha::FormatError);
  sdmha::MhaConfig wrong;  // refused before any child is started
  EXPECT_THROW(
      sdmha::io::load_keras_layer_isolated<float>(keras_file("functional_bias.keras"), "", wrong),
      sdmha::ConfigError);
}

#endif  // SDMHA_HAS_KERAS_IO

}  // namespace
