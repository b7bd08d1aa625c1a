// Tests for sdmha/io/npy.hpp: reading numpy-written fixtures of every supported descr, format
// versions 1.0 to 3.0 and Fortran order; writing files byte-identical to numpy.save; every
// malformed header and size the parser must reject; and .npz archives, stored and deflated,
// intact and corrupted. The fixtures come from tools/testdata/make_npy_test_data.py.
#include <gtest/gtest.h>
#include <zip.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "sdmha/io/npy.hpp"

#include "io_test.hpp"

namespace sdmha_test {
namespace {

using sdmha::io::DType;
using sdmha::io::NpyArray;
using sdmha::io::NpzFile;
using sdmha::io::parse_npy;
using sdmha::io::read_npy;
using sdmha::io::write_npy;

const char* const crafted_name = "crafted.npy";

std::string fixture(const std::string& name) { return test_data("npy/" + name); }

// A .npy file with this header text (as is: no padding added) followed by `data_size` zero bytes.
std::vector<std::uint8_t> craft(const std::string& header, std::size_t data_size,
                                int major_version = 1) {
  std::vector<std::uint8_t> bytes = {
      0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<std::uint8_t>(major_version), 0};
  const int length_bytes = major_version == 1 ? 2 : 4;
  for (int i = 0; i < length_bytes; ++i) {
    bytes.push_back(static_cast<std::uint8_t>(header.size() >> (8 * i)));
  }
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + data_size, 0);
  return bytes;
}

NpyArray parse_crafted(const std::vector<std::uint8_t>& bytes) {
  return parse_npy(bytes.data(), bytes.size(), crafted_name);
}

// Parsing this header must fail with FormatError naming the file and saying `needle`.
void expect_rejected(const std::string& header, std::size_t data_size, const std::string& needle) {
  SCOPED_TRACE(header);
  expect_error<FormatError>([&] { parse_crafted(craft(header, data_size)); },
                            {crafted_name, needle});
}

const std::vector<double> f64_2x3_values = {-1.0, -0.5, 0.0, 0.5, 1.0, 1.5};

// ---------------------------------------------------------------------------------------------
// numpy-written fixtures

TEST(NpyRead, EveryDescrWrittenByNumpy) {
  const NpyArray f64 = read_npy(fixture("f64_2x3.npy"));
  EXPECT_EQ(f64.dtype, DType::F64);
  EXPECT_EQ(f64.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_FALSE(f64.fortran_order);
  EXPECT_EQ(f64.element_count(), 6);
  EXPECT_EQ(f64.source, fixture("f64_2x3.npy"));
  EXPECT_EQ(f64.as<double>(), f64_2x3_values);
  EXPECT_EQ(f64.as<float>(), (std::vector<float>{-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f}));

  const NpyArray f32 = read_npy(fixture("f32_4.npy"));
  EXPECT_EQ(f32.dtype, DType::F32);
  EXPECT_EQ(f32.as<float>(), (std::vector<float>{1.5f, -2.25f, 3.0e38f, 1e-45f}));

  const NpyArray f16 = read_npy(fixture("f16_5.npy"));
  EXPECT_EQ(f16.dtype, DType::F16);
  EXPECT_EQ(f16.as<float>(), (std::vector<float>{1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24),
                                                 std::numeric_limits<float>::infinity()}));

  const NpyArray i32 = read_npy(fixture("i32_3.npy"));
  EXPECT_EQ(i32.dtype, DType::I32);
  EXPECT_EQ(i32.as<std::int32_t>(),
            (std::vector<std::int32_t>{std::numeric_limits<std::int32_t>::min(), 0,
                                       std::numeric_limits<std::int32_t>::max()}));
  EXPECT_EQ(i32.as<std::int64_t>()[0], std::numeric_limits<std::int32_t>::min());

  const NpyArray i64 = read_npy(fixture("i64_2x2.npy"));
  EXPECT_EQ(i64.dtype, DType::I64);
  EXPECT_EQ(i64.as<std::int64_t>(),
            (std::vector<std::int64_t>{std::numeric_limits<std::int64_t>::min(), 1, 2,
                                       std::numeric_limits<std::int64_t>::max()}));

  const NpyArray u8 = read_npy(fixture("u8_4.npy"));
  EXPECT_EQ(u8.dtype, DType::U8);
  EXPECT_EQ(u8.as<std::uint8_t>(), (std::vector<std::uint8_t>{0, 1, 128, 255}));
  expect_error<FormatError>([&] { u8.as<bool>(); },
                            {"u8_4.npy", "byte 128 at element 2", "expected 0 or 1"});

  const NpyArray mask = read_npy(fixture("bool_2x2.npy"));
  EXPECT_EQ(mask.dtype, DType::BOOL);
  EXPECT_EQ(mask.as<bool>(), (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(mask.as<std::int64_t>(), (std::vector<std::int64_t>{1, 0, 0, 1}));
}

TEST(NpyRead, ScalarAndEmptyArrays) {
  const NpyArray scalar = read_npy(fixture("scalar_f64.npy"));
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.element_count(), 1);
  EXPECT_EQ(scalar.as<double>(), std::vector<double>{3.25});

  const NpyArray empty = read_npy(fixture("empty_0x3.npy"));
  EXPECT_EQ(empty.shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(empty.data.empty());
  EXPECT_TRUE(empty.as<float>().empty());
}

TEST(NpyRead, FormatVersionsTwoAndThree) {
  EXPECT_EQ(read_npy(fixture("v2_i64.npy")).as<std::int64_t>(),
            (std::vector<std::int64_t>{7, -8, 9}));
  EXPECT_EQ(read_npy(fixture("v3_f32.npy")).as<float>(), (std::vector<float>{0.25f, -0.5f}));
}

TEST(NpyRead, FortranOrderIsTransposedToCOrder) {
  // numpy.asfortranarray(arange(24).reshape(2, 3, 4)): the same logical array, stored first axis
  // fastest; read back in C order it is 0, 1, ..., 23 again.
  const NpyArray array = read_npy(fixture("fortran.npy"));
  EXPECT_TRUE(array.fortran_order);
  EXPECT_EQ(array.shape, (std::vector<std::int64_t>{2, 3, 4}));
  std::vector<double> expected(24);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<double>(i);
  EXPECT_EQ(array.as<double>(), expected);

  // A crafted 2 × 3 int32 array in Fortran order: columns (1, 4), (2, 5), (3, 6).
  std::vector<std::uint8_t> bytes =
      craft("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }\n", 0);
  for (std::int32_t value : {1, 4, 2, 5, 3, 6}) {
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  EXPECT_EQ(parse_crafted(bytes).as<std::int32_t>(), (std::vector<std::int32_t>{1, 2, 3, 4, 5, 6}));
}

TEST(NpyRead, UnsupportedDescrsAreRejected) {
  expect_error<FormatError>([] { read_npy(fixture("big_endian.npy")); },
                            {"big_endian.npy", "'>f8'", "big-endian, which is not supported"});
  expect_error<FormatError>([] { read_npy(fixture("complex.npy")); },
                            {"complex.npy", "descr '<c16' is not supported", "'<f8'"});
}

TEST(NpyRead, MissingFileIsAnIoError) {
  const std::string path = fixture("does_not_exist.npy");
  expect_error<IoError>([&] { read_npy(path); }, {"read_npy", "cannot open", path});
}

// ---------------------------------------------------------------------------------------------
// Writing

TEST(NpyWrite, BytesMatchNumpySave) {
  const ScratchDirectory directory;
  const std::string path = directory.file("out.npy");

  write_npy(path, {2, 3}, f64_2x3_values.data());
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("f64_2x3.npy")));

  const std::int64_t i64[] = {std::numeric_limits<std::int64_t>::min(), 1, 2,
                              std::numeric_limits<std::int64_t>::max()};
  write_npy(path, {2, 2}, i64);
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("i64_2x2.npy")));

  const bool mask[] = {true, false, false, true};
  write_npy(path, {2, 2}, mask);
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("bool_2x2.npy")));

  const double scalar = 3.25;
  write_npy(path, {}, &scalar);
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("scalar_f64.npy")));

  write_npy(path, {0, 3}, static_cast<const float*>(nullptr));
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("empty_0x3.npy")));

  const std::uint16_t halves[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00};
  write_npy(path, DType::F16, {5}, halves, sizeof halves);
  EXPECT_EQ(read_bytes(path), read_bytes(fixture("f16_5.npy")));

  EXPECT_EQ(directory.entries(), std::vector<std::string>{"out.npy"});
}

TEST(NpyWrite, RoundTripEveryDtype) {
  const ScratchDirectory directory;
  const std::string path = directory.file("trip.npy");

  const std::vector<float> f32 = {0.5f, -1e-45f, 3e38f};
  write_npy(path, {3, 1}, f32.data());
  NpyArray array = read_npy(path);
  EXPECT_EQ(array.dtype, DType::F32);
  EXPECT_EQ(array.shape, (std::vector<std::int64_t>{3, 1}));
  EXPECT_EQ(array.as<float>(), f32);

  const std::vector<std::int32_t> i32 = {-5, 6, 7, 8};
  write_npy(path, {2, 1, 2}, i32.data());
  array = read_npy(path);
  EXPECT_EQ(array.dtype, DType::I32);
  EXPECT_EQ(array.as<std::int32_t>(), i32);

  const std::vector<std::uint8_t> u8 = {9, 0, 255};
  write_npy(path, {3}, u8.data());
  array = read_npy(path);
  EXPECT_EQ(array.dtype, DType::U8);
  EXPECT_EQ(array.as<std::uint8_t>(), u8);

  // A header past 64 KiB needs version 2.0, as numpy does it.
  std::vector<std::int64_t> long_shape(25000, 1);
  const double one = 1.0;
  write_npy(path, long_shape, &one);
  const std::vector<std::uint8_t> bytes = read_bytes(path);
  EXPECT_EQ(bytes[6], 2);
  array = read_npy(path);
  EXPECT_EQ(array.shape, long_shape);
  EXPECT_EQ(array.as<double>(), std::vector<double>{1.0});
}

TEST(NpyWrite, DataStartsAtAMultipleOf64) {
  const ScratchDirectory directory;
  const std::string path = directory.file("aligned.npy");
  for (std::int64_t length : {std::int64_t{1}, std::int64_t{7}, std::int64_t{12345678901}}) {
    const std::vector<std::int64_t> shape = {0, length};
    write_npy(path, shape, static_cast<const double*>(nullptr));
    const std::vector<std::uint8_t> bytes = read_bytes(path);
    EXPECT_EQ(bytes.size() % 64, 0u) << "shape (0, " << length << ")";
    EXPECT_EQ(bytes.back(), '\n');
  }
}

TEST(NpyWrite, RejectsInconsistentArguments) {
  const ScratchDirectory directory;
  const std::string path = directory.file("bad.npy");
  const double values[4] = {1, 2, 3, 4};
  expect_error<ShapeError>(
      [&] {
        write_npy(path, DType::F64, {2, 2}, values, 24);
      },
      {"write_npy", path, "got 24 bytes", "shape [2, 2] of F64", "expected 32"});
  expect_error<ShapeError>(
      [&] {
        write_npy(path, {2, -1}, values);
      },
      {path, "dimension 1 = -1", "expected a dimension >= 0"});
  expect_error<ShapeError>([&] { write_npy(path, {1ll << 62, 4}, values); }, {path, "overflows"});
  expect_error<ShapeError>([&] { write_npy(path, DType::F64, {1}, nullptr, 8); },
                           {path, "data is null"});
  expect_error<FormatError>([&] { write_npy(path, DType::BF16, {2}, values, 4); },
                            {path, "BF16 has no .npy descr"});
  EXPECT_TRUE(directory.entries().empty());
}

TEST(NpyWrite, FailedWriteLeavesNothingBehind) {
  const ScratchDirectory directory;
  const double value = 1.0;
  expect_error<IoError>([&] { write_npy(directory.file("absent/x.npy"), {1}, &value); },
                        {"write_npy", "absent/x.npy"});
  const std::string occupied = directory.file("x.npy");
  fs::create_directory(occupied);
  expect_error<IoError>([&] { write_npy(occupied, {1}, &value); }, {"write_npy", occupied});
  EXPECT_EQ(directory.entries(), std::vector<std::string>{"x.npy"});
}

// ---------------------------------------------------------------------------------------------
// Malformed .npy files

TEST(NpyMalformed, PrefixProblems) {
  expect_error<FormatError>(
      [] {
        parse_crafted({0x93, 'N', 'U'});
      },
      {crafted_name, "3 bytes long", "at least 10"});
  std::vector<std::uint8_t> bytes = craft("{}", 0);
  bytes[1] = 'X';
  expect_error<FormatError>([&] { parse_crafted(bytes); }, {crafted_name, "magic"});
  bytes = craft("{}", 0);
  bytes[6] = 4;
  expect_error<FormatError>([&] { parse_crafted(bytes); },
                            {crafted_name, "version 4.0 is not supported", "1.0, 2.0 or 3.0"});
  bytes[6] = 1;
  bytes[7] = 1;
  expect_error<FormatError>([&] { parse_crafted(bytes); }, {"version 1.1 is not supported"});
  // Version 2.0 needs a 4-byte length: 11 bytes cannot hold it.
  bytes = {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 0, 0, 0};
  expect_error<FormatError>([&] { parse_crafted(bytes); }, {"11 bytes long", "at least 12"});
}

TEST(NpyMalformed, HeaderLongerThanTheFile) {
  std::vector<std::uint8_t> bytes = craft("{'descr': '<f8'", 0);
  bytes[8] = 200;
  expect_error<FormatError>([&] { parse_crafted(bytes); },
                            {crafted_name, "header length is 200", "only 15 bytes follow"});
  bytes = craft("{}", 0, 3);
  bytes[11] = 0xff;
  expect_error<FormatError>([&] { parse_crafted(bytes); }, {"header length is 4278190082"});
}

TEST(NpyMalformed, HeaderIsNotTheExpectedDict) {
  expect_rejected("", 0, "found the end of the header; expected '{' opening the header dict");
  expect_rejected("[1]", 0, "found '['; expected '{'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (), ", 8,
                  "found the end of the header; expected a quoted key");
  expect_rejected("{descr: '<f8'}", 8, "found 'd'; expected a quoted key");
  expect_rejected("{'descr' '<f8'}", 8, "expected ':' after key 'descr'");
  expect_rejected("{'descr': '<f8' 'fortran_order': False, 'shape': (), }", 8,
                  "expected ',' or '}' after the value of 'descr'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (), } x", 8,
                  "found 'x' after the dict; expected only spaces and a newline");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (), }\x01", 8,
                  "byte 0x01 after the dict");
  expect_rejected("{'descr: '<f8'}", 8, "found '<'; expected ':' after key 'descr: '");
  expect_rejected("{'descr': '<f8", 8, "unterminated string");
  expect_rejected("{'descr': '<f\\x38', 'fortran_order': False, 'shape': (), }", 8,
                  "inside a string");
}

TEST(NpyMalformed, WrongKeys) {
  expect_rejected("{'descr': '<f8', 'shape': (1,), }", 8, "the dict lacks 'fortran_order'");
  expect_rejected("{'fortran_order': False, 'shape': (1,), }", 8, "the dict lacks 'descr'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, }", 8, "the dict lacks 'shape'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), 'extra': 1}", 8,
                  "unknown key 'extra'");
  expect_rejected("{'descr': '<f8', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}", 8,
                  "key 'descr' appears twice");
}

TEST(NpyMalformed, WrongValues) {
  expect_rejected("{'descr': '<f8', 'fortran_order': 0, 'shape': (1,), }", 8,
                  "True or False for 'fortran_order'");
  expect_rejected("{'descr': '<f8', 'fortran_order': false, 'shape': (1,), }", 8, "True or False");
  expect_rejected("{'descr': 8, 'fortran_order': False, 'shape': (1,), }", 8,
                  "found '8'; expected a quoted descr");
  expect_rejected("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", 4,
                  "a structured dtype");
  expect_rejected("{'descr': '<i2', 'fortran_order': False, 'shape': (1,), }", 2,
                  "descr '<i2' is not supported");
  expect_rejected("{'descr': '>i4', 'fortran_order': False, 'shape': (1,), }", 4, "big-endian");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': [1], }", 8,
                  "expected a tuple '(...)' for 'shape'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (1), }", 8,
                  "'shape' is a parenthesized integer, not a tuple");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (1 2), }", 8,
                  "expected ',' or ')' in 'shape'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (1.5,), }", 8, "found '.'");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (,), }", 8,
                  "expected a dimension");
}

TEST(NpyMalformed, NegativeOrOverflowingShape) {
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (-1,), }", 0,
                  "a negative dimension; expected dimensions >= 0");
  expect_rejected("{'descr': '|u1', 'fortran_order': False, 'shape': (99999999999999999999,), }", 0,
                  "a dimension that overflows int64");
  expect_rejected("{'descr': '|u1', 'fortran_order': False, 'shape': (4294967296, 4294967296), }",
                  0, "shape [4294967296, 4294967296] overflows the element count");
  expect_rejected("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904,), }", 0,
                  "overflows the element count");
}

TEST(NpyMalformed, DataSizeMustMatchTheShape) {
  const std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }\n";
  expect_rejected(header, 16, "data is 16 bytes (truncated); expected 24 (3 elements of F64");
  expect_rejected(header, 32, "data is 32 bytes (trailing bytes); expected 24");
  EXPECT_EQ(parse_crafted(craft(header, 24)).as<double>(), (std::vector<double>{0, 0, 0}));
  // Python 2 long suffixes and double quotes still parse, as numpy accepts them.
  EXPECT_EQ(parse_crafted(craft("{\"descr\": \"<i8\", \"fortran_order\": False, "
                                "\"shape\": (2L,)}",
                                16))
                .shape,
            std::vector<std::int64_t>{2});
}

TEST(NpyMalformed, EditedArrayIsCheckedBeforeConversion) {
  NpyArray array = read_npy(fixture("f64_2x3.npy"));
  array.data.pop_back();
  expect_error<FormatError>([&] { array.as<double>(); },
                            {"NpyArray::as", "f64_2x3.npy", "holds 47 bytes"});
  array = read_npy(fixture("f64_2x3.npy"));
  array.shape = {-2, -3};
  expect_error<FormatError>([&] { array.as<double>(); }, {"shape [-2, -3]"});
  array = read_npy(fixture("f64_2x3.npy"));
  expect_error<FormatError>([&] { array.as<std::int64_t>(); },
                            {"f64_2x3.npy", "dtype F64", "as int64"});
}

// ---------------------------------------------------------------------------------------------
// .npz archives

// Offsets of one member in a zip archive, found through the central directory.
struct ZipMember {
  std::size_t central = 0;  // its central directory header
  std::size_t local = 0;    // its local file header
  std::size_t data = 0;     // its (compressed) bytes
  std::size_t compressed_size = 0;
};

std::uint32_t load_u32(const std::vector<std::uint8_t>& bytes, std::size_t at) {
  std::uint32_t value = 0;
  for (std::size_t i = 4; i-- > 0;) value = value << 8 | bytes[at + i];
  return value;
}

std::uint16_t load_u16(const std::vector<std::uint8_t>& bytes, std::size_t at) {
  return static_cast<std::uint16_t>(bytes[at] | bytes[at + 1] << 8);
}

void store_u32(std::vector<std::uint8_t>& bytes, std::size_t at, std::uint32_t value) {
  for (std::size_t i = 0; i < 4; ++i) bytes[at + i] = static_cast<std::uint8_t>(value >> (8 * i));
}

ZipMember locate(const std::vector<std::uint8_t>& zip, const std::string& name) {
  for (std::size_t at = 0; at + 46 < zip.size(); ++at) {
    if (load_u32(zip, at) != 0x02014b50) continue;
    const std::size_t name_length = load_u16(zip, at + 28);
    if (std::string(zip.begin() + static_cast<std::ptrdiff_t>(at + 46),
                    zip.begin() + static_cast<std::ptrdiff_t>(at + 46 + name_length)) != name) {
      continue;
    }
    ZipMember member;
    member.central = at;
    member.local = load_u32(zip, at + 42);
    member.compressed_size = load_u32(zip, at + 20);
    member.data =
        member.local + 30 + load_u16(zip, member.local + 26) + load_u16(zip, member.local + 28);
    return member;
  }
  ADD_FAILURE() << "no member " << name;
  return {};
}

void check_npz_contents(const NpzFile& npz) {
  EXPECT_EQ(npz.names(), (std::vector<std::string>{"ids", "mask", "weights"}));
  EXPECT_TRUE(npz.contains("weights"));
  EXPECT_FALSE(npz.contains("weights.npy"));
  const NpyArray weights = npz.read("weights");
  EXPECT_EQ(weights.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(weights.as<double>(), f64_2x3_values);
  EXPECT_EQ(npz.read("ids").as<std::int64_t>(), (std::vector<std::int64_t>{3, -1, 4}));
  EXPECT_EQ(npz.read("mask").as<bool>(), (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(npz.read("weights").source, npz.source() + "[weights.npy]");
}

TEST(NpzRead, StoredArchiveFromSavez) { check_npz_contents(NpzFile::open(fixture("arrays.npz"))); }

TEST(NpzRead, DeflatedArchiveFromSavezCompressed) {
  check_npz_contents(NpzFile::open(fixture("arrays_compressed.npz")));
}

TEST(NpzRead, MovedFileStillReads) {
  NpzFile first = NpzFile::open(fixture("arrays.npz"));
  NpzFile second = std::move(first);
  EXPECT_EQ(second.read("ids").as<std::int64_t>(), (std::vector<std::int64_t>{3, -1, 4}));
}

TEST(NpzRead, MissingMemberIsNamed) {
  const NpzFile npz = NpzFile::open(fixture("arrays.npz"));
  expect_error<FormatError>([&] { npz.read("bias"); },
                            {"NpzFile::read", "arrays.npz", "no array named 'bias'", "'bias.npy'",
                             "'ids', 'mask', 'weights'"});
}

TEST(NpzRead, OpenFailures) {
  const ScratchDirectory directory;
  const std::string missing = directory.file("missing.npz");
  expect_error<IoError>([&] { NpzFile::open(missing); }, {"NpzFile::open", "cannot open", missing});
  expect_error<FormatError>([] { NpzFile::open(fixture("f64_2x3.npy")); },
                            {"NpzFile::open", "f64_2x3.npy", "as a zip archive", "Not a zip"});
  const std::string empty = directory.file("empty.npz");
  write_bytes(empty, {});
  expect_error<FormatError>([&] { NpzFile::open(empty); }, {empty, "is empty"});

  std::vector<std::uint8_t> bytes = read_bytes(fixture("arrays.npz"));
  bytes.resize(bytes.size() / 2);
  const std::string truncated = directory.file("truncated.npz");
  write_bytes(truncated, bytes);
  expect_error<FormatError>([&] { NpzFile::open(truncated); }, {truncated});
}

TEST(NpzRead, CrcMismatchIsDetected) {
  const ScratchDirectory directory;
  std::vector<std::uint8_t> bytes = read_bytes(fixture("arrays.npz"));
  const ZipMember weights = locate(bytes, "weights.npy");
  // The last byte of the member is element data, so the .npy itself still parses.
  bytes[weights.data + weights.compressed_size - 1] ^= 0x40;
  const std::string path = directory.file("crc.npz");
  write_bytes(path, bytes);
  const NpzFile npz = NpzFile::open(path);
  expect_error<FormatError>([&] { npz.read("weights"); },
                            {"NpzFile::read", path, "member 'weights.npy'", "CRC"});
  EXPECT_EQ(npz.read("ids").as<std::int64_t>(), (std::vector<std::int64_t>{3, -1, 4}));
}

TEST(NpzRead, CorruptDeflateStreamIsDetected) {
  const ScratchDirectory directory;
  std::vector<std::uint8_t> bytes = read_bytes(fixture("arrays_compressed.npz"));
  const ZipMember weights = locate(bytes, "weights.npy");
  for (std::size_t i = 2; i < weights.compressed_size; i += 3) bytes[weights.data + i] ^= 0xa5;
  const std::string path = directory.file("deflate.npz");
  write_bytes(path, bytes);
  const NpzFile npz = NpzFile::open(path);
  expect_error<FormatError>([&] { npz.read("weights"); }, {path, "member 'weights.npy'"});
  EXPECT_EQ(npz.read("mask").as<bool>(), (std::vector<bool>{true, false, false, true}));
}

// Rewrites a member's uncompressed size in both its local and central headers (and in the zip64
// extra field that numpy writes into local headers), so that the archive stays self-consistent.
void set_uncompressed_size(std::vector<std::uint8_t>& zip, const ZipMember& member,
                           std::uint32_t size) {
  store_u32(zip, member.central + 24, size);
  store_u32(zip, member.local + 22, size);
  const std::size_t extra = member.local + 30 + load_u16(zip, member.local + 26);
  if (load_u16(zip, member.local + 28) >= 20 && load_u16(zip, extra) == 0x0001) {
    store_u32(zip, extra + 4, size);
    store_u32(zip, extra + 8, 0);
  }
}

// The archive is opened without ZIP_CHECKCONS (which refuses valid zips with data descriptors);
// a member whose directory entry disagrees with its data is refused when it is read.
TEST(NpzRead, InconsistentDirectoryIsRejected) {
  const ScratchDirectory directory;
  std::vector<std::uint8_t> bytes = read_bytes(fixture("arrays.npz"));
  store_u32(bytes, locate(bytes, "weights.npy").central + 24, 0x7fffffff);
  const std::string path = directory.file("inconsistent.npz");
  write_bytes(path, bytes);
  expect_error<FormatError>([&] { NpzFile::open(path).read("weights"); }, {path, "weights"});
}

TEST(NpzRead, ImplausibleSizesAreRejectedBeforeAllocating) {
  const ScratchDirectory directory;
  const auto patched = [&](const char* source, std::uint32_t size) {
    std::vector<std::uint8_t> bytes = read_bytes(fixture(source));
    set_uncompressed_size(bytes, locate(bytes, "weights.npy"), size);
    const std::string path = directory.file(std::to_string(size) + "_" + source);
    write_bytes(path, bytes);
    return path;
  };
  std::string path = patched("arrays.npz", 0x7fffffff);
  expect_error<FormatError>(
      [&] { NpzFile::open(path).read("weights"); },
      {path, "stored member 'weights.npy' claims 2147483647 bytes", "occupies 176"});
  path = patched("arrays_compressed.npz", 0xfffffff0);
  expect_error<FormatError>(
      [&] { NpzFile::open(path).read("weights"); },
      {path, "deflated member 'weights.npy' claims 4294967280 bytes", "at most 1032 times"});
}

TEST(NpzRead, MemberShorterOrLongerThanDeclared) {
  const ScratchDirectory directory;
  std::vector<std::uint8_t> bytes = read_bytes(fixture("arrays_compressed.npz"));
  const ZipMember weights = locate(bytes, "weights.npy");
  set_uncompressed_size(bytes, weights, 200);
  const std::string longer_claim = directory.file("short.npz");
  write_bytes(longer_claim, bytes);
  expect_error<FormatError>(
      [&] { NpzFile::open(longer_claim).read("weights"); },
      {longer_claim, "member 'weights.npy' ends after 176 bytes", "expected 200 (truncated)"});
  set_uncompressed_size(bytes, weights, 150);
  const std::string shorter_claim = directory.file("long.npz");
  write_bytes(shorter_claim, bytes);
  expect_error<FormatError>([&] { NpzFile::open(shorter_claim).read("weights"); },
                            {shorter_claim, "longer than its declared 150 bytes"});
}

// Builds a zip with libzip itself, to hold members numpy would never write.
void write_zip(const std::string& path,
               const std::vector<std::pair<std::string, std::vector<std::uint8_t>>>& members) {
  int error = 0;
  zip_t* archive = zip_open(path.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &error);
  ASSERT_NE(archive, nullptr);
  for (const auto& [name, bytes] : members) {
    zip_source_t* source = zip_source_buffer(archive, bytes.data(), bytes.size(), 0);
    ASSERT_NE(source, nullptr);
    ASSERT_GE(zip_file_add(archive, name.c_str(), source, ZIP_FL_ENC_UTF_8), 0);
  }
  ASSERT_EQ(zip_close(archive), 0);
}

TEST(NpzRead, MalformedMemberAndOtherMembers) {
  const ScratchDirectory directory;
  const std::string path = directory.file("custom.npz");
  std::vector<std::uint8_t> whole = read_bytes(fixture("f64_2x3.npy"));
  std::vector<std::uint8_t> cut(whole.begin(), whole.end() - 8);
  write_zip(path, {{"whole.npy", whole}, {"cut.npy", cut}, {"readme.txt", {'h', 'i'}}});
  const NpzFile npz = NpzFile::open(path);
  EXPECT_EQ(npz.names(), (std::vector<std::string>{"cut", "whole"}));
  EXPECT_EQ(npz.read("whole").as<double>(), f64_2x3_values);
  expect_error<FormatError>([&] { npz.read("cut"); },
                            {"parse_npy", path + "[cut.npy]", "data is 40 bytes (truncated)"});
  expect_error<FormatError>([&] { npz.read("readme"); }, {"no array named 'readme'"});
}

}  // namespace
}  // namespace sdmha_test
