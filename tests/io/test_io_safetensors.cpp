// Tests for sdmha/io/safetensors.hpp: writer → reader round trips over every dtype, exact F16 and
// BF16 widening, the conversions a typed read allows and refuses, every malformed header the
// reader must reject, the atomic write, and the real golden file keras_basic_f64.safetensors;
// and io::load_inputs (layer_files.hpp) on a mask and a bias of every broadcast shape, their bad
// shapes and dtypes, and its row limit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "sdmha/io/layer_files.hpp"
#include "sdmha/io/safetensors.hpp"

#include "io_test.hpp"

namespace sdmha_test {
namespace {

using sdmha::io::DType;
using sdmha::io::SafetensorsFile;
using sdmha::io::SafetensorsWriter;

const char* const crafted_name = "crafted.safetensors";

void append_u64(std::vector<std::uint8_t>& bytes, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
}

// A safetensors file with this header text and a zero-filled data buffer.
std::vector<std::uint8_t> craft(const std::string& header, std::size_t buffer_size = 0) {
  std::vector<std::uint8_t> bytes;
  append_u64(bytes, header.size());
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + buffer_size, 0);
  return bytes;
}

SafetensorsFile parse_crafted(const std::vector<std::uint8_t>& bytes) {
  return SafetensorsFile::from_bytes(bytes, crafted_name);
}

// Parsing this header must fail with FormatError naming the file and saying `needle`.
void expect_rejected(const std::string& header, std::size_t buffer_size,
                     const std::string& needle) {
  SCOPED_TRACE(header);
  expect_error<FormatError>([&] { parse_crafted(craft(header, buffer_size)); },
                            {crafted_name, needle});
}

std::vector<std::uint8_t> half_bytes(const std::vector<std::uint16_t>& values) {
  std::vector<std::uint8_t> bytes;
  for (std::uint16_t value : values) {
    bytes.push_back(static_cast<std::uint8_t>(value & 0xff));
    bytes.push_back(static_cast<std::uint8_t>(value >> 8));
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Round trips

struct Fixture {
  std::vector<float> f32 = {1.5f, -2.25f, 0.0f, 3.0e38f, 1e-45f, -0.0f};
  std::vector<double> f64 = {0.1, -1e300, 5e-324, 2.0, -0.0, 1.0 / 3.0};
  std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::min(), -1, 0,
                                   std::numeric_limits<std::int64_t>::max()};
  std::vector<std::int32_t> i32 = {std::numeric_limits<std::int32_t>::min(), -7, 0, 9,
                                   std::numeric_limits<std::int32_t>::max(), 1};
  std::vector<std::uint8_t> u8 = {0, 1, 127, 255};
  bool flags[5] = {true, false, true, true, false};
  std::vector<std::uint16_t> f16 = {0x3c00, 0xc000, 0x7bff};   // 1, -2, 65504
  std::vector<std::uint16_t> bf16 = {0x3f80, 0xc000, 0x4049};  // 1, -2, 3.140625

  SafetensorsWriter writer() const {
    SafetensorsWriter writer;
    writer.add("f32", {2, 3}, f32.data());
    writer.add("f64", {3, 2}, f64.data());
    writer.add("i64", {4}, i64.data());
    writer.add("i32", {1, 2, 3}, i32.data());
    writer.add("u8", {2, 2}, u8.data());
    writer.add("flags", {5}, flags);
    const std::vector<std::uint8_t> f16_bytes = half_bytes(f16);
    const std::vector<std::uint8_t> bf16_bytes = half_bytes(bf16);
    writer.add("f16", DType::F16, {3}, f16_bytes.data(), f16_bytes.size());
    writer.add("bf16", DType::BF16, {3, 1}, bf16_bytes.data(), bf16_bytes.size());
    const double scalar = 2.5;
    writer.add("scalar", {}, &scalar);
    writer.add("empty", {0, 4}, static_cast<const float*>(nullptr));
    writer.set_metadata("layout", "keras");
    writer.set_metadata("num_heads", "2");
    return writer;
  }
};

template <typename T>
void expect_same_bits(const std::vector<T>& got, const std::vector<T>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got[i], &expected[i], sizeof(T)), 0) << "element " << i;
  }
}

TEST(SafetensorsRoundTrip, EveryDtypeSurvivesWriterAndReader) {
  const Fixture fixture;
  const SafetensorsFile file = SafetensorsFile::from_bytes(fixture.writer().to_bytes(), "trip");

  EXPECT_EQ(file.source(), "trip");
  EXPECT_EQ(file.names(), (std::vector<std::string>{"bf16", "empty", "f16", "f32", "f64", "flags",
                                                    "i32", "i64", "scalar", "u8"}));
  EXPECT_EQ(file.metadata().size(), 2u);
  EXPECT_EQ(file.metadata_value("layout"), std::optional<std::string>("keras"));
  EXPECT_EQ(file.metadata_value("num_heads"), std::optional<std::string>("2"));
  EXPECT_EQ(file.metadata_value("absent"), std::nullopt);

  EXPECT_EQ(file.info("f32").dtype, DType::F32);
  EXPECT_EQ(file.info("f32").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(file.info("i32").shape, (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(file.info("flags").dtype, DType::BOOL);
  EXPECT_EQ(file.info("bf16").dtype, DType::BF16);
  EXPECT_EQ(file.info("scalar").element_count(), 1);
  EXPECT_EQ(file.info("empty").element_count(), 0);

  expect_same_bits(file.read<float>("f32"), fixture.f32);
  expect_same_bits(file.read<double>("f64"), fixture.f64);
  EXPECT_EQ(file.read<std::int64_t>("i64"), fixture.i64);
  EXPECT_EQ(file.read<std::int32_t>("i32"), fixture.i32);
  EXPECT_EQ(file.read<std::uint8_t>("u8"), fixture.u8);
  EXPECT_EQ(file.read<bool>("flags"), (std::vector<bool>{true, false, true, true, false}));
  EXPECT_EQ(file.read<float>("f16"), (std::vector<float>{1.0f, -2.0f, 65504.0f}));
  EXPECT_EQ(file.read<float>("bf16"), (std::vector<float>{1.0f, -2.0f, 3.140625f}));
  EXPECT_EQ(file.read<double>("scalar"), (std::vector<double>{2.5}));
  EXPECT_TRUE(file.read<float>("empty").empty());
}

TEST(SafetensorsRoundTrip, HeaderIsPaddedAndTensorsAreAlignedLargestFirst) {
  const std::vector<std::uint8_t> bytes = Fixture().writer().to_bytes();
  std::uint64_t header_length = 0;
  for (std::size_t i = 8; i-- > 0;) header_length = (header_length << 8) | bytes[i];
  EXPECT_EQ(header_length % 8, 0u);
  const std::string text(bytes.data() + 8, bytes.data() + 8 + header_length);
  const auto header = nlohmann::ordered_json::parse(text);
  EXPECT_EQ(header.begin().key(), "__metadata__");

  std::size_t previous_size = 8;
  std::size_t expected_begin = 0;
  for (auto it = std::next(header.begin()); it != header.end(); ++it) {
    const std::size_t size =
        sdmha::io::dtype_size(*sdmha::detail::dtype_from_name(it.value()["dtype"]));
    const auto begin = it.value()["data_offsets"][0].get<std::size_t>();
    EXPECT_LE(size, previous_size) << it.key() << " follows a smaller element type";
    EXPECT_EQ(begin % size, 0u) << it.key() << " is misaligned";
    EXPECT_EQ(begin, expected_begin) << it.key() << " leaves a gap";
    expected_begin = it.value()["data_offsets"][1].get<std::size_t>();
    previous_size = size;
  }
  EXPECT_EQ(bytes.size(), 8 + header_length + expected_begin);

  // Every tensor then starts aligned in memory too, so the zero-copy view is available.
  const SafetensorsFile file = SafetensorsFile::from_bytes(bytes);
  ASSERT_NE(file.data_if_aligned<double>("f64"), nullptr);
  EXPECT_EQ(file.data_if_aligned<double>("f64")[0], 0.1);
  ASSERT_NE(file.data_if_aligned<float>("f32"), nullptr);
  EXPECT_EQ(file.data_if_aligned<float>("f32")[1], -2.25f);
  ASSERT_NE(file.data_if_aligned<std::int64_t>("i64"), nullptr);
  EXPECT_EQ(file.data_if_aligned<std::int64_t>("i64")[3], std::numeric_limits<std::int64_t>::max());
  ASSERT_NE(file.data_if_aligned<std::int32_t>("i32"), nullptr);
  ASSERT_NE(file.data_if_aligned<std::uint8_t>("u8"), nullptr);
  EXPECT_EQ(file.data_if_aligned<std::uint8_t>("u8")[3], 255);
  // A different element type gets no view, even of the same size.
  EXPECT_EQ(file.data_if_aligned<float>("i32"), nullptr);
  EXPECT_EQ(file.data_if_aligned<double>("f32"), nullptr);
}

TEST(SafetensorsRoundTrip, MetadataIsOmittedWhenEmpty) {
  SafetensorsWriter writer;
  const float value = 1.0f;
  writer.add("x", {1}, &value);
  const std::vector<std::uint8_t> bytes = writer.to_bytes();
  const SafetensorsFile file = SafetensorsFile::from_bytes(bytes);
  EXPECT_TRUE(file.metadata().empty());
  const std::string text(bytes.begin() + 8, bytes.end() - 4);
  EXPECT_EQ(text.find("__metadata__"), std::string::npos);
}

TEST(SafetensorsRoundTrip, WriteThenOpen) {
  const ScratchDirectory directory;
  const std::string path = directory.file("model.safetensors");
  Fixture().writer().write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.source(), path);
  EXPECT_EQ(file.read<std::int64_t>("i64"), Fixture().i64);
  EXPECT_EQ(file.metadata_value("layout"), std::optional<std::string>("keras"));
  // Only the final file remains: the temporary was renamed onto it.
  EXPECT_EQ(directory.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsRoundTrip, WriteReplacesAnExistingFile) {
  const ScratchDirectory directory;
  const std::string path = directory.file("model.safetensors");
  std::ofstream(path) << "stale contents";
  SafetensorsWriter writer;
  const std::int32_t value = 42;
  writer.add("answer", {}, &value);
  writer.write(path);
  EXPECT_EQ(SafetensorsFile::open(path).read<std::int32_t>("answer"),
            std::vector<std::int32_t>{42});
  EXPECT_EQ(directory.entries(), std::vector<std::string>{"model.safetensors"});
}

// ---------------------------------------------------------------------------------------------
// Widening and narrowing

// A 16-bit pattern and the float it widens to.
struct Widening {
  std::uint16_t bits;
  float expected;
};

struct Widened {
  std::vector<float> as_float;
  std::vector<double> as_double;
};

// The patterns of `widenings`, then `specials`, written as one tensor of `dtype` (F16 or BF16)
// and read back as float and as double: each of `widenings` gives exactly its value in both.
Widened expect_exact_widenings(DType dtype, const std::vector<Widening>& widenings,
                               const std::vector<std::uint16_t>& specials) {
  std::vector<std::uint16_t> bits;
  for (const Widening& widening : widenings) bits.push_back(widening.bits);
  bits.insert(bits.end(), specials.begin(), specials.end());
  SafetensorsWriter writer;
  const std::vector<std::uint8_t> bytes = half_bytes(bits);
  writer.add("t", dtype, {static_cast<std::int64_t>(bits.size())}, bytes.data(), bytes.size());
  const SafetensorsFile file = SafetensorsFile::from_bytes(writer.to_bytes());
  Widened widened{file.read<float>("t"), file.read<double>("t")};
  for (std::size_t i = 0; i < widenings.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << std::hex << "bits 0x" << widenings[i].bits);
    EXPECT_EQ(widened.as_float[i], widenings[i].expected);
    EXPECT_EQ(widened.as_double[i], static_cast<double>(widenings[i].expected));
  }
  return widened;
}

TEST(SafetensorsConversion, HalfWidensExactly) {
  const float infinity = std::numeric_limits<float>::infinity();
  const std::vector<Widening> widenings = {
      {0x0000, 0.0f},
      {0x3c00, 1.0f},
      {0xc000, -2.0f},
      {0x3555, 0.333251953125f},
      {0x7bff, 65504.0f},                  // largest finite half
      {0x0400, std::ldexp(1.0f, -14)},     // smallest normal
      {0x0001, std::ldexp(1.0f, -24)},     // smallest subnormal
      {0x03ff, std::ldexp(1023.0f, -24)},  // largest subnormal
      {0x8001, -std::ldexp(1.0f, -24)},    // negative subnormal
      {0x7c00, infinity},
      {0xfc00, -infinity},
  };
  const std::vector<std::uint16_t> specials = {
      0x8000,  // -0
      0x7e00,  // quiet nan
      0x7c01,  // signalling nan: still a nan, not an infinity
      0xfe00,  // negative nan
  };
  const Widened got = expect_exact_widenings(DType::F16, widenings, specials);
  const std::size_t special = widenings.size();
  EXPECT_EQ(got.as_float[special], 0.0f);
  EXPECT_TRUE(std::signbit(got.as_float[special]));
  EXPECT_TRUE(std::signbit(got.as_double[special]));
  for (std::size_t i = 1; i < specials.size(); ++i) {
    EXPECT_TRUE(std::isnan(got.as_float[special + i])) << std::hex << "bits 0x" << specials[i];
    EXPECT_TRUE(std::isnan(got.as_double[special + i])) << std::hex << "bits 0x" << specials[i];
  }
  EXPECT_TRUE(std::signbit(got.as_float.back()));
}

TEST(SafetensorsConversion, BFloat16WidensExactly) {
  const float infinity = std::numeric_limits<float>::infinity();
  const std::vector<Widening> widenings = {
      {0x3f80, 1.0f},
      {0xc000, -2.0f},
      {0x4049, 3.140625f},
      {0x7f7f, std::ldexp(255.0f, 120)},  // largest finite bfloat16
      {0x0080, std::ldexp(1.0f, -126)},   // smallest normal
      {0x0001, std::ldexp(1.0f, -133)},   // smallest subnormal
      {0x7f80, infinity},
      {0xff80, -infinity},
  };
  const std::vector<std::uint16_t> specials = {
      0x8000,  // -0
      0x7fc0,  // nan
  };
  const Widened got = expect_exact_widenings(DType::BF16, widenings, specials);
  EXPECT_EQ(got.as_float[widenings.size()], 0.0f);
  EXPECT_TRUE(std::signbit(got.as_float[widenings.size()]));
  EXPECT_TRUE(std::isnan(got.as_float.back()));
  EXPECT_TRUE(std::isnan(got.as_double.back()));
}

TEST(SafetensorsConversion, DoubleNarrowsToFloatWithIeeeRounding) {
  const double float_max = std::numeric_limits<float>::max();
  const std::vector<double> values = {0.1,
                                      -1e300,
                                      1e300,
                                      float_max,
                                      float_max + 0x1p102,  // below half an ulp
                                      float_max + 0x1p103,  // the tie: rounds to inf
                                      1e-50,
                                      std::nan("")};
  SafetensorsWriter writer;
  writer.add("d", {static_cast<std::int64_t>(values.size())}, values.data());
  const std::vector<float> got = SafetensorsFile::from_bytes(writer.to_bytes()).read<float>("d");
  const float infinity = std::numeric_limits<float>::infinity();
  EXPECT_EQ(got[0], 0.1f);
  EXPECT_EQ(got[1], -infinity);
  EXPECT_EQ(got[2], infinity);
  EXPECT_EQ(got[3], std::numeric_limits<float>::max());
  EXPECT_EQ(got[4], std::numeric_limits<float>::max());
  EXPECT_EQ(got[5], infinity);
  EXPECT_EQ(got[6], 0.0f);
  EXPECT_TRUE(std::isnan(got[7]));
}

TEST(SafetensorsConversion, AllowedConversions) {
  const Fixture fixture;
  const SafetensorsFile file = SafetensorsFile::from_bytes(fixture.writer().to_bytes());
  EXPECT_EQ(file.read<double>("f32")[1], -2.25);
  EXPECT_EQ(file.read<float>("f64")[3], 2.0f);
  EXPECT_EQ(file.read<double>("f16")[2], 65504.0);
  EXPECT_EQ(file.read<double>("bf16")[2], 3.140625);
  EXPECT_EQ(file.read<std::int64_t>("i32"),
            std::vector<std::int64_t>(fixture.i32.begin(), fixture.i32.end()));
  EXPECT_EQ(file.read<std::int64_t>("u8"), (std::vector<std::int64_t>{0, 1, 127, 255}));
  EXPECT_EQ(file.read<std::int64_t>("flags"), (std::vector<std::int64_t>{1, 0, 1, 1, 0}));
  EXPECT_EQ(file.read<std::uint8_t>("flags"), (std::vector<std::uint8_t>{1, 0, 1, 1, 0}));

  SafetensorsWriter writer;
  const std::uint8_t zero_one[] = {0, 1, 1};
  writer.add("mask", {3}, zero_one);
  EXPECT_EQ(SafetensorsFile::from_bytes(writer.to_bytes()).read<bool>("mask"),
            (std::vector<bool>{false, true, true}));
}

TEST(SafetensorsConversion, RefusedConversionsNameTensorDtypeAndType) {
  const SafetensorsFile file = SafetensorsFile::from_bytes(Fixture().writer().to_bytes(), "trip");
  expect_error<FormatError>(
      [&] { file.read<std::int64_t>("f32"); },
      {"trip", "tensor 'f32'", "dtype F32", "as int64", "I32, I64, U8 or BOOL"});
  expect_error<FormatError>([&] { file.read<std::int32_t>("i64"); },
                            {"trip", "tensor 'i64'", "dtype I64", "as int32"});
  expect_error<FormatError>([&] { file.read<std::int32_t>("u8"); }, {"dtype U8", "as int32"});
  expect_error<FormatError>([&] { file.read<float>("i32"); },
                            {"tensor 'i32'", "dtype I32", "as float", "F16, BF16, F32 or F64"});
  expect_error<FormatError>([&] { file.read<double>("flags"); }, {"dtype BOOL", "as double"});
  expect_error<FormatError>([&] { file.read<std::uint8_t>("i32"); }, {"dtype I32", "as uint8"});
  expect_error<FormatError>([&] { file.read<bool>("f64"); }, {"dtype F64", "as bool"});
  expect_error<FormatError>([&] { file.read<std::int64_t>("f16"); }, {"dtype F16", "as int64"});
}

TEST(SafetensorsConversion, BoolBytesMustBeZeroOrOne) {
  SafetensorsWriter writer;
  const std::uint8_t bytes[] = {1, 2, 0};
  writer.add("bad_bool", DType::BOOL, {3}, bytes, sizeof bytes);
  writer.add("u8", {3}, bytes);
  const SafetensorsFile file = SafetensorsFile::from_bytes(writer.to_bytes(), "bools");
  for (const auto& read : {+[](const SafetensorsFile& f) { f.read<bool>("bad_bool"); },
                           +[](const SafetensorsFile& f) { f.read<std::uint8_t>("bad_bool"); },
                           +[](const SafetensorsFile& f) { f.read<std::int64_t>("bad_bool"); },
                           +[](const SafetensorsFile& f) { f.read<bool>("u8"); }}) {
    expect_error<FormatError>([&] { read(file); },
                              {"bools", "byte 2 at element 1", "expected 0 or 1"});
  }
  // As plain bytes a U8 tensor may hold anything.
  EXPECT_EQ(file.read<std::uint8_t>("u8"), (std::vector<std::uint8_t>{1, 2, 0}));
}

TEST(SafetensorsConversion, UnalignedDataIsReadByCopy) {
  // Pad the header so that the data buffer starts at an odd offset from the allocation.
  std::string header = R"({"d":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                       R"("q":{"dtype":"I64","shape":[1],"data_offsets":[16,24]},)"
                       R"("f":{"dtype":"F32","shape":[1],"data_offsets":[24,28]}})";
  while (header.size() % 8 != 1) header += ' ';
  std::vector<std::uint8_t> bytes = craft(header);
  const double d[2] = {1.25, -3.5};
  const std::int64_t q = -42;
  const float f = 0.75f;
  const auto* d_bytes = reinterpret_cast<const std::uint8_t*>(d);
  const auto* q_bytes = reinterpret_cast<const std::uint8_t*>(&q);
  const auto* f_bytes = reinterpret_cast<const std::uint8_t*>(&f);
  bytes.insert(bytes.end(), d_bytes, d_bytes + sizeof d);
  bytes.insert(bytes.end(), q_bytes, q_bytes + sizeof q);
  bytes.insert(bytes.end(), f_bytes, f_bytes + sizeof f);

  const SafetensorsFile file = parse_crafted(bytes);
  EXPECT_EQ(file.data_if_aligned<double>("d"), nullptr);
  EXPECT_EQ(file.data_if_aligned<std::int64_t>("q"), nullptr);
  EXPECT_EQ(file.data_if_aligned<float>("f"), nullptr);
  EXPECT_EQ(file.read<double>("d"), (std::vector<double>{1.25, -3.5}));
  EXPECT_EQ(file.read<std::int64_t>("q"), std::vector<std::int64_t>{-42});
  EXPECT_EQ(file.read<float>("f"), std::vector<float>{0.75f});
}

// ---------------------------------------------------------------------------------------------
// Lookups and shape expectations

TEST(SafetensorsLookup, MissingTensorIsNamed) {
  const SafetensorsFile file = SafetensorsFile::from_bytes(Fixture().writer().to_bytes(), "trip");
  EXPECT_TRUE(file.contains("f32"));
  EXPECT_FALSE(file.contains("nope"));
  EXPECT_FALSE(file.contains("__metadata__"));
  expect_error<FormatError>([&] { file.info("nope"); },
                            {"SafetensorsFile::info", "trip", "no tensor named 'nope'", "'f32'"});
  expect_error<FormatError>([&] { file.read<float>("nope"); }, {"SafetensorsFile::read", "'nope'"});
  expect_error<FormatError>([&] { file.data_if_aligned<float>("nope"); }, {"'nope'"});
}

TEST(SafetensorsLookup, ExpectShapeAndRank) {
  const SafetensorsFile file = SafetensorsFile::from_bytes(Fixture().writer().to_bytes(), "trip");
  EXPECT_NO_THROW(file.expect_shape("f32", {2, 3}));
  EXPECT_NO_THROW(file.expect_shape("scalar", {}));
  EXPECT_NO_THROW(file.expect_rank("i32", 3));
  expect_error<ShapeError>(
      [&] {
        file.expect_shape("f32", {3, 2});
      },
      {"trip", "tensor 'f32'", "shape [2, 3]", "expected [3, 2]"});
  expect_error<ShapeError>([&] { file.expect_rank("f32", 3); },
                           {"trip", "tensor 'f32'", "rank 2", "expected rank 3"});
  expect_error<FormatError>([&] { file.expect_rank("nope", 1); }, {"'nope'"});
}

// ---------------------------------------------------------------------------------------------
// Malformed files

TEST(SafetensorsMalformed, ShorterThanTheLengthField) {
  expect_error<FormatError>(
      [] {
        parse_crafted({1, 0, 0});
      },
      {crafted_name, "3 bytes long", "at least 8"});
  expect_error<FormatError>([] { parse_crafted({}); }, {crafted_name, "0 bytes long"});
}

TEST(SafetensorsMalformed, HeaderLongerThanTheFile) {
  std::vector<std::uint8_t> bytes;
  append_u64(bytes, 100);
  bytes.resize(20, '{');
  expect_error<FormatError>([&] { parse_crafted(bytes); },
                            {crafted_name, "header length is 100", "only 12 bytes follow"});
}

TEST(SafetensorsMalformed, AbsurdHeaderLength) {
  for (std::uint64_t length : {std::uint64_t{100'000'001}, ~std::uint64_t{0}}) {
    std::vector<std::uint8_t> bytes;
    append_u64(bytes, length);
    bytes.push_back('{');
    expect_error<FormatError>([&] { parse_crafted(bytes); },
                              {crafted_name, std::to_string(length), "at most 100000000"});
  }
}

TEST(SafetensorsMalformed, HeaderIsNotAJsonObject) {
  expect_rejected("{not json", 0, "not valid JSON");
  expect_rejected("", 0, "not valid JSON");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} trailing)", 4,
                  "not valid JSON");
  expect_rejected("[1, 2]", 0, "header is a JSON array; expected a JSON object");
  expect_rejected("\"text\"", 0, "header is a JSON string");
}

TEST(SafetensorsMalformed, EntryIsNotAnObject) {
  expect_rejected(R"({"a": 5})", 0, "tensor 'a' is a JSON number; expected an object");
  expect_rejected(R"({"a": [1]})", 0, "tensor 'a' is a JSON array");
}

TEST(SafetensorsMalformed, MissingOrMistypedFields) {
  expect_rejected(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4,
                  "tensor 'a' has no \"dtype\" field");
  expect_rejected(R"({"a":{"dtype":3,"shape":[1],"data_offsets":[0,4]}})", 4,
                  "tensor 'a' dtype is a JSON number; expected a string");
  expect_rejected(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4,
                  "tensor 'a' has no \"shape\" field");
  expect_rejected(R"({"a":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})", 4,
                  "tensor 'a' shape is a JSON number; expected an array of integers");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4,
                  "tensor 'a' shape[0] is 1.5; expected a non-negative integer");
  expect_rejected(R"({"a":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})", 4,
                  "shape[0] is \"1\"");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1]}})", 4,
                  "tensor 'a' has no \"data_offsets\" field");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8,
                  "data_offsets is [0,4,8]; expected an array [begin, end]");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":{"begin":0}}})", 4,
                  "expected an array [begin, end]");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,"4"]}})", 4,
                  "data_offsets[1] is \"4\"");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,4]}})", 4,
                  "data_offsets[0] = -4 is negative");
}

TEST(SafetensorsMalformed, UnknownDtype) {
  expect_rejected(R"({"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4,
                  "tensor 'w' has dtype \"F8_E4M3\", which is not supported");
  expect_rejected(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4,
                  "\"f32\", which is not supported; expected one of F16, BF16");
}

TEST(SafetensorsMalformed, NegativeOrHugeDimension) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", 0,
                  "tensor 'a' shape[1] = -1 is negative; expected >= 0");
  expect_rejected(R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", 0,
                  "shape[0] = 18446744073709551615 is too large");
}

TEST(SafetensorsMalformed, ShapeProductOverflow) {
  expect_rejected(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0,
                  "tensor 'a' shape [4294967296, 4294967296] overflows the element count");
  // The element count fits, the byte count does not.
  expect_rejected(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0,
                  "overflows the element count");
}

TEST(SafetensorsMalformed, OffsetsOutOfOrderOrOutOfBounds) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8,
                  "tensor 'a' data_offsets [8, 4] begin after end");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4,
                  "tensor 'a' data_offsets [0, 8] end past the data buffer of 4 bytes");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})", 4,
                  "data_offsets[1] = 18446744073709551615 is too large");
}

TEST(SafetensorsMalformed, ByteCountDisagreesWithShape) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 8,
                  "tensor 'a' data_offsets [0, 4] span 4 bytes; expected 8 (2 elements of F32");
  expect_rejected(R"({"a":{"dtype":"BF16","shape":[],"data_offsets":[0,4]}})", 4,
                  "span 4 bytes; expected 2");
}

TEST(SafetensorsMalformed, OverlappingTensors) {
  expect_rejected(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                  R"("b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})",
                  16, "tensors 'a' data_offsets [0, 16] and 'b' data_offsets [8, 16] overlap");
  expect_rejected(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                  R"("y":{"dtype":"U8","shape":[2],"data_offsets":[6,8]},)"
                  R"("z":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                  8, "overlap");
}

TEST(SafetensorsMalformed, HolesAndUncoveredBytesAreRejected) {
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
                  16, "bytes [4, 12) between tensors 'a' and 'b' belong to no tensor");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8,
                  "bytes [0, 4) of the data belong to no tensor");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8,
                  "the data buffer holds 8 bytes but the tensors cover [0, 4)");
}

TEST(SafetensorsMalformed, EmptyTensorsOccupyNoBytes) {
  const SafetensorsFile file =
      parse_crafted(craft(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                          R"("e":{"dtype":"F64","shape":[0,5],"data_offsets":[0,0]},)"
                          R"("f":{"dtype":"F64","shape":[3,0],"data_offsets":[6,6]}})",
                          8));
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b", "e", "f"}));
  EXPECT_TRUE(file.read<double>("f").empty());
}

TEST(SafetensorsMalformed, MetadataMustMapStringsToStrings) {
  expect_rejected(R"({"__metadata__":[1]})", 0,
                  "__metadata__ is a JSON array; expected an object of strings");
  expect_rejected(R"({"__metadata__":{"num_heads":2}})", 0,
                  "__metadata__ value of 'num_heads' is a JSON number; expected a string");
  expect_rejected(R"({"__metadata__":{"ok":"yes","nested":{"a":"b"}}})", 0,
                  "__metadata__ value of 'nested' is a JSON object");
}

TEST(SafetensorsMalformed, OpenNamesTheFile) {
  const ScratchDirectory directory;
  const std::string path = directory.file("short.safetensors");
  std::ofstream(path, std::ios::binary) << "abc";
  expect_error<FormatError>([&] { SafetensorsFile::open(path); },
                            {"SafetensorsFile::open", path, "3 bytes long"});
}

// ---------------------------------------------------------------------------------------------
// I/O failures and writer validation

TEST(SafetensorsIo, OpenFailuresAreIoErrors) {
  const ScratchDirectory directory;
  const std::string missing = directory.file("missing.safetensors");
  expect_error<IoError>([&] { SafetensorsFile::open(missing); }, {"cannot open", missing});
  const std::string folder = directory.file("folder.safetensors");
  fs::create_directory(folder);
  expect_error<IoError>([&] { SafetensorsFile::open(folder); }, {folder, "not a regular file"});
}

TEST(SafetensorsIo, FailedWriteLeavesNothingBehind) {
  const ScratchDirectory directory;
  const SafetensorsWriter writer = Fixture().writer();

  const std::string no_directory = directory.file("absent/model.safetensors");
  expect_error<IoError>([&] { writer.write(no_directory); },
                        {"SafetensorsWriter::write", "absent/model.safetensors"});

  // The rename onto a directory fails after the temporary is written; it must be removed.
  const std::string occupied = directory.file("model.safetensors");
  fs::create_directory(occupied);
  expect_error<IoError>([&] { writer.write(occupied); },
                        {"SafetensorsWriter::write", "cannot write '" + occupied, "rename"});
  EXPECT_EQ(directory.entries(), std::vector<std::string>{"model.safetensors"});
  EXPECT_TRUE(fs::is_directory(occupied));
}

TEST(SafetensorsIo, WriterRejectsInconsistentTensors) {
  SafetensorsWriter writer;
  const double values[4] = {1, 2, 3, 4};
  expect_error<ShapeError>(
      [&] {
        writer.add("x", DType::F64, {2, 2}, values, 24);
      },
      {"SafetensorsWriter::add", "tensor 'x'", "got 24 bytes", "shape [2, 2] of F64",
       "expected 32"});
  expect_error<ShapeError>([&] { writer.add("x", DType::F16, {3}, values, 8); },
                           {"got 8 bytes", "expected 6"});
  expect_error<ShapeError>(
      [&] {
        writer.add("x", {2, -2}, values);
      },
      {"tensor 'x'", "dimension 1 = -2", "expected a dimension >= 0"});
  expect_error<ShapeError>(
      [&] {
        writer.add("x", {1ll << 62, 4}, values);
      },
      {"tensor 'x'", "overflows"});
  expect_error<ShapeError>([&] { writer.add("x", DType::F32, {2}, nullptr, 8); },
                           {"tensor 'x'", "data is null"});

  writer.add("x", {4}, values);
  expect_error<FormatError>([&] { writer.add("x", {4}, values); }, {"tensor 'x'", "already added"});
  expect_error<FormatError>([&] { writer.add("__metadata__", {4}, values); },
                            {"'__metadata__'", "reserved"});
  // The failed calls left the writer as it was.
  EXPECT_EQ(SafetensorsFile::from_bytes(writer.to_bytes()).names(), std::vector<std::string>{"x"});
}

TEST(SafetensorsIo, NonUtf8NamesAreRefusedWhenSerializing) {
  SafetensorsWriter writer;
  const float value = 1.0f;
  writer.add("bad\xff", {1}, &value);
  expect_error<FormatError>([&] { writer.to_bytes(); }, {"UTF-8"});
}

// ---------------------------------------------------------------------------------------------
// The real golden file

TEST(SafetensorsGolden, KerasBasicF64) {
  const std::string path = test_data("goldens/keras_basic_f64.safetensors");
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names().size(), 15u);
  EXPECT_EQ(file.metadata_value("num_heads"), std::optional<std::string>("2"));
  EXPECT_EQ(file.metadata_value("key_dim"), std::optional<std::string>("4"));
  EXPECT_EQ(file.metadata_value("layout"), std::optional<std::string>("keras"));
  EXPECT_EQ(file.metadata_value("use_causal_mask"), std::optional<std::string>("false"));
  EXPECT_FALSE(file.contains("attention_mask"));

  EXPECT_EQ(file.info("query/kernel").dtype, DType::F64);
  EXPECT_NO_THROW(file.expect_shape("query/kernel", {16, 2, 4}));
  EXPECT_NO_THROW(file.expect_shape("expected/attention_scores", {2, 2, 5, 7}));
  EXPECT_NO_THROW(file.expect_rank("query/indices", 2));

  const std::vector<double> kernel = file.read<double>("query/kernel");
  ASSERT_EQ(kernel.size(), 128u);
  EXPECT_EQ(kernel[0], 0.6269212574920491);
  EXPECT_EQ(kernel[1], 0.03530205453621841);
  EXPECT_EQ(kernel[127], -0.29621865807375025);
  const double* view = file.data_if_aligned<double>("query/kernel");
  ASSERT_NE(view, nullptr);
  EXPECT_TRUE(std::equal(kernel.begin(), kernel.end(), view));

  const std::vector<std::int64_t> dense_shape = file.read<std::int64_t>("query/dense_shape");
  EXPECT_EQ(dense_shape, (std::vector<std::int64_t>{2, 5, 16}));
  const std::vector<std::int64_t> indices = file.read<std::int64_t>("query/indices");
  ASSERT_EQ(indices.size(), 150u);
  EXPECT_EQ(std::vector<std::int64_t>(indices.begin(), indices.begin() + 3),
            (std::vector<std::int64_t>{0, 0, 5}));
  for (std::size_t i = 0; i < indices.size(); ++i) {
    EXPECT_GE(indices[i], 0);
    EXPECT_LT(indices[i], dense_shape[i % 3]);
  }

  // The attention probabilities of each query row sum to one.
  const std::vector<float> scores = file.read<float>("expected/attention_scores");
  ASSERT_EQ(scores.size(), 2u * 2 * 5 * 7);
  for (std::size_t row = 0; row < scores.size() / 7; ++row) {
    float sum = 0.0f;
    for (std::size_t s = 0; s < 7; ++s) sum += scores[row * 7 + s];
    EXPECT_NEAR(sum, 1.0f, 1e-5f) << "row " << row;
  }
}

// ---------------------------------------------------------------------------------------------
// load_inputs: attention_mask and attention_bias of every broadcast shape, the row limit

// Inputs of B = 2, T = 3, Eq = 4, S = 5, Ev = 6, with the tensors `extra` adds.
template <typename Extra>
SafetensorsFile inputs_file(Extra&& extra, std::int64_t steps = 3) {
  SafetensorsWriter writer;
  const std::int64_t dense_shape[3] = {2, steps, 4};
  const std::int64_t indices[6] = {0, 0, 1, 1, 2, 3};
  const double values[2] = {0.5, -1.5};
  const std::vector<double> value(2 * 5 * 6, 0.25);
  writer.add<std::int64_t>("query/dense_shape", {3}, dense_shape);
  writer.add<std::int64_t>("query/indices", {2, 3}, indices);
  writer.add<double>("query/values", {2}, values);
  writer.add<double>("value", {2, 5, 6}, value.data());
  extra(writer);
  return SafetensorsFile::from_bytes(writer.to_bytes(), "inputs.safetensors");
}

std::int64_t element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t count = 1;
  for (const std::int64_t dimension : shape) count *= dimension;
  return count;
}

void add_mask(SafetensorsWriter& writer, const std::vector<std::int64_t>& shape) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(element_count(shape)));
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::uint8_t(i % 3 != 0);
  writer.add("attention_mask", DType::BOOL, shape, bytes.data(), bytes.size());
}

template <typename T>
void add_bias(SafetensorsWriter& writer, const std::vector<std::int64_t>& shape) {
  std::vector<T> data(static_cast<std::size_t>(element_count(shape)));
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = T(i) / T(8);
  writer.add<T>("attention_bias", shape, data.data());
}

TEST(LoadInputs, MaskAndBiasOfEveryShapeKeepTheirRankAndBindAsViews) {
  struct Shape {
    std::vector<std::int64_t> stored;
    std::int64_t batch, heads;  // (B', H') of the view
  };
  const Shape shapes[] = {{{3, 5}, 1, 1},       {{2, 3, 5}, 2, 1},    {{1, 3, 5}, 1, 1},
                          {{2, 1, 3, 5}, 2, 1}, {{2, 7, 3, 5}, 2, 7}, {{1, 7, 3, 5}, 1, 7},
                          {{1, 1, 3, 5}, 1, 1}};
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(::testing::PrintToString(shape.stored));
    const sdmha::io::TensorSource source(inputs_file([&](SafetensorsWriter& writer) {
      add_mask(writer, shape.stored);
      add_bias<float>(writer, shape.stored);  // F32, read as double
    }));
    const auto inputs = sdmha::io::load_inputs<double>(source);
    sdmha::AttentionOptions<double> options;
    options.attention_mask = inputs.attention_mask;
    options.attention_bias = inputs.attention_bias;
    EXPECT_EQ(inputs.attention_mask.rank, int(shape.stored.size()));
    EXPECT_EQ(options.attention_mask.rank(), int(shape.stored.size()));
    EXPECT_EQ(options.attention_mask.batch(), shape.batch);
    EXPECT_EQ(options.attention_mask.heads(), shape.heads);
    EXPECT_EQ(options.attention_mask.steps(), 3);
    EXPECT_EQ(options.attention_mask.key_steps(), 5);
    EXPECT_EQ(options.attention_bias.batch(), shape.batch);
    EXPECT_EQ(options.attention_bias.heads(), shape.heads);
    // The views point into the loaded tensors, element i of the stored order at flat index i.
    EXPECT_EQ(options.attention_mask.data(), inputs.attention_mask.data());
    EXPECT_EQ(options.attention_bias.data(), inputs.attention_bias.data());
    const std::int64_t last = element_count(shape.stored) - 1;
    EXPECT_EQ(options.attention_mask.data()[last], last % 3 != 0);
    EXPECT_EQ(options.attention_bias.data()[last], double(float(last) / 8.0f));
    EXPECT_EQ(*options.attention_bias.at(shape.batch - 1, shape.heads - 1, 2, 4), last / 8.0);
  }
  // Both absent: empty views.
  const auto none = sdmha::io::load_inputs<float>(
      sdmha::io::TensorSource(inputs_file([](SafetensorsWriter&) {})));
  sdmha::AttentionOptions<float> options;
  options.attention_mask = none.attention_mask;
  options.attention_bias = none.attention_bias;
  EXPECT_TRUE(none.attention_mask.empty());
  EXPECT_TRUE(options.attention_mask.empty());
  EXPECT_TRUE(options.attention_bias.empty());
}

TEST(LoadInputs, RejectsMasksAndBiasesOfTheWrongShapeOrDtype) {
  auto load = [](auto&& extra) {
    return sdmha::io::load_inputs<double>(sdmha::io::TensorSource(inputs_file(extra)));
  };
  expect_error<ShapeError>(
      [&] { load([](SafetensorsWriter& w) {
              add_mask(w, {2, 3, 4});
            }); },
      {"inputs.safetensors", "tensor 'attention_mask' has shape [2, 3, 4]; expected [2, 3, 5]"});
  expect_error<ShapeError>([&] { load([](SafetensorsWriter& w) {
                                   add_mask(w, {3, 3, 5});
                                 }); },
                           {"tensor 'attention_mask' has shape [3, 3, 5]", "B = 2 or 1"});
  expect_error<ShapeError>([&] { load([](SafetensorsWriter& w) { add_mask(w, {5}); }); },
                           {"tensor 'attention_mask' has shape [5]"});
  expect_error<ShapeError>(
      [&] { load([](SafetensorsWriter& w) {
              add_mask(w, {1, 2, 1, 3, 5});
            }); },
      {"tensor 'attention_mask' has shape [1, 2, 1, 3, 5]"});
  expect_error<ShapeError>(
      [&] { load([](SafetensorsWriter& w) {
              add_bias<double>(w, {2, 0, 3, 5});
            }); },
      {"tensor 'attention_bias' has shape [2, 0, 3, 5]"});
  expect_error<ShapeError>([&] { load([](SafetensorsWriter& w) {
                                   add_bias<double>(w, {4, 5});
                                 }); },
                           {"tensor 'attention_bias' has shape [4, 5]; expected [2, 3, 5]"});
  expect_error<FormatError>(
      [&] { load([](SafetensorsWriter& w) {
              add_bias<std::int64_t>(w, {3, 5});
            }); },
      {"inputs.safetensors", "tensor 'attention_bias' has dtype I64; expected F32 or F64"});
  expect_error<FormatError>(
      [&] {
        load([](SafetensorsWriter& w) {
          const std::vector<double> data(15, 1.0);
          w.add<double>("attention_mask", {3, 5}, data.data());
        });
      },
      {"tensor 'attention_mask'", "F64"});
}

TEST(LoadInputs, RejectsADenseShapePastTheRowLimitBeforeAllocating) {
  // Three numbers ask for (2, 10^9, 4): the default limit refuses them.
  const sdmha::io::TensorSource huge(inputs_file([](SafetensorsWriter&) {}, 1000000000));
  expect_error<ShapeError>([&] { sdmha::io::load_inputs<double>(huge); },
                           {"inputs.safetensors", "'query/dense_shape'",
                            "dense shape (2, 1000000000, 4) has batch * steps = 2000000000 rows",
                            "max_rows = 134217728"});
  // A caller's own limit.
  const sdmha::io::TensorSource small(inputs_file([](SafetensorsWriter&) {}));
  expect_error<ShapeError>([&] { sdmha::io::load_inputs<double>(small, {5}); },
                           {"batch * steps = 6 rows; expected at most max_rows = 5"});
  EXPECT_EQ(sdmha::io::load_inputs<double>(small, {6}).query.rows(), 6);
}

}  // namespace
}  // namespace sdmha_test
