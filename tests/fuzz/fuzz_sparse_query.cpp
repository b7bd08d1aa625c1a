// tests/fuzz/fuzz_sparse_query.cpp — sparse query ingestion under unconstrained shapes and indices.
//
// The bytes choose a constructor (from_coo or view_csr, with an int or an int16 storage index),
// a dense shape (B, T, Eq) of any int64 values and the entries. The constructor must either
// reject the input with an sdmha::Error or build a query whose structure holds: B·T rows, every
// column inside [0, Eq), columns sorted and distinct within a row (from_coo), and every stored
// value the sum, in input order, of the entries at its coordinate.
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <sdmha/sparse_query.hpp>

#include "fuzz_support.hpp"

namespace {

using sdmha::Index;
using sdmha_fuzz::consume_coordinate;
using sdmha_fuzz::consume_exact_value;
using sdmha_fuzz::consume_integer;

// At most this many entries per input: enough for duplicates and several rows, small enough to
// keep an iteration fast.
constexpr int kMaxEntries = 64;
// to_dense is compared entry by entry only below this many dense elements.
constexpr Index kMaxDenseElements = 4096;
// With an int storage index a valid shape may have up to 2³¹ − 2 rows, and every constructor
// legitimately needs B·T + 1 row offsets (plus, in from_coo, the counting sort's B·T + 1
// counters). from_coo runs under this row limit (SparseQueryLimits), which it must enforce before
// allocating. With int16 every valid shape is below it.
constexpr Index kMaxRowsToAllocate = Index(1) << 20;

// Whether the library should accept the dense shape for StorageIndex (mirrors the documented
// rules: dimensions >= 0; B, T and Eq each, and B·T, inside the storage index).
template <typename StorageIndex>
bool shape_is_valid(std::int64_t batch, std::int64_t steps, std::int64_t features) {
  constexpr std::int64_t limit = std::numeric_limits<StorageIndex>::max();
  if (batch < 0 || steps < 0 || features < 0) return false;
  if (batch > limit || steps > limit || features > limit) return false;
  return steps == 0 || batch <= (limit - 1) / steps;
}

// The sum, in input order, of the values at each (row, column): what every stored value must be.
template <typename Scalar>
using CoordinateSums = std::map<std::pair<Index, Index>, Scalar>;

template <typename Scalar>
bool same_value(Scalar a, Scalar b) {
  return a == b || (a != a && b != b);  // NaN sums agree with NaN sums
}

// The invariants of any accepted query, and to_dense against the expected sums.
template <typename Scalar, typename StorageIndex>
void check_structure(const sdmha::SparseQuery<Scalar, StorageIndex>& query, std::int64_t batch,
                     std::int64_t steps, std::int64_t features, const CoordinateSums<Scalar>& sums,
                     bool sorted_distinct_columns) {
  SDMHA_FUZZ_CHECK(query.batch() == batch && query.steps() == steps);
  SDMHA_FUZZ_CHECK(query.rows() == batch * steps);
  SDMHA_FUZZ_CHECK(query.features() == features);
  const auto& csr = query.csr();
  CoordinateSums<Scalar> stored;
  for (Index row = 0; row < csr.rows; ++row) {
    SDMHA_FUZZ_CHECK(csr.row_begin(row) <= csr.row_end(row));
    for (Index k = csr.row_begin(row); k < csr.row_end(row); ++k) {
      const Index column = csr.column_indices[k];
      SDMHA_FUZZ_CHECK(column >= 0 && column < features);
      if (sorted_distinct_columns && k > csr.row_begin(row))
        SDMHA_FUZZ_CHECK(csr.column_indices[k - 1] < column);
      auto [it, inserted] = stored.emplace(std::make_pair(row, column), csr.values[k]);
      if (!inserted) it->second += csr.values[k];
    }
  }
  SDMHA_FUZZ_CHECK(stored.size() == sums.size());
  for (const auto& [coordinate, sum] : sums) {
    const auto found = stored.find(coordinate);
    SDMHA_FUZZ_CHECK(found != stored.end() && same_value(found->second, sum));
  }
  for (Index b = 0; b < batch && b < 8; ++b) SDMHA_FUZZ_CHECK(query.batch_rows(b).rows == steps);
  if (features <= kMaxDenseElements && query.rows() <= kMaxDenseElements &&
      query.rows() * features <= kMaxDenseElements) {
    const auto dense = query.to_dense();
    SDMHA_FUZZ_CHECK(dense.rows() == query.rows() && dense.cols() == features);
    for (Index row = 0; row < dense.rows(); ++row)
      for (Index column = 0; column < dense.cols(); ++column) {
        const auto found = sums.find({row, column});
        const Scalar expected = found == sums.end() ? Scalar(0) : found->second;
        SDMHA_FUZZ_CHECK(same_value(dense(row, column), expected));
      }
  }
}

template <typename Scalar, typename StorageIndex>
void fuzz_from_coo(FuzzedDataProvider& provider, std::int64_t batch, std::int64_t steps,
                   std::int64_t features) {
  using Query = sdmha::SparseQuery<Scalar, StorageIndex>;
  const int entries = provider.ConsumeIntegralInRange<int>(0, kMaxEntries);
  // Occasionally indices with the wrong column count or values of the wrong length.
  const int columns = provider.ConsumeIntegralInRange<int>(0, 15) == 0
                          ? provider.ConsumeIntegralInRange<int>(0, 4)
                          : 3;
  const int value_count = provider.ConsumeIntegralInRange<int>(0, 15) == 0
                              ? provider.ConsumeIntegralInRange<int>(0, kMaxEntries)
                              : entries;
  typename Query::CooIndices indices(entries, columns);
  const std::int64_t bounds[3] = {batch, steps, features};
  bool in_range = true;
  for (int entry = 0; entry < entries; ++entry)
    for (int axis = 0; axis < columns; ++axis) {
      indices(entry, axis) = consume_coordinate(provider, axis < 3 ? bounds[axis] : 1);
      if (axis < 3 && (indices(entry, axis) < 0 || indices(entry, axis) >= bounds[axis]))
        in_range = false;
    }
  sdmha::Vector<Scalar> values(value_count);
  for (int entry = 0; entry < value_count; ++entry) {
    // Mostly exact values; sometimes a non-finite one, whose sums must propagate the same way.
    const int kind = provider.ConsumeIntegralInRange<int>(0, 31);
    values[entry] = kind == 0   ? std::numeric_limits<Scalar>::quiet_NaN()
                    : kind == 1 ? std::numeric_limits<Scalar>::infinity()
                    : kind == 2 ? -std::numeric_limits<Scalar>::infinity()
                                : Scalar(consume_exact_value(provider));
  }

  const bool well_formed = columns == 3 && value_count == entries;
  const bool valid = shape_is_valid<StorageIndex>(batch, steps, features) && well_formed &&
                     entries <= std::numeric_limits<StorageIndex>::max();
  // A valid shape past the row limit is refused, whatever its entries.
  const bool within_limit =
      shape_is_valid<StorageIndex>(batch, steps, features) && batch * steps <= kMaxRowsToAllocate;

  Query query;
  const sdmha::SparseQueryLimits limits{kMaxRowsToAllocate};
  const bool accepted = sdmha_fuzz::accepts(
      [&] { query = Query::from_coo(batch, steps, features, indices, values, limits); });
  SDMHA_FUZZ_CHECK(accepted == (valid && in_range && within_limit));
  if (!accepted) return;

  CoordinateSums<Scalar> sums;
  for (int entry = 0; entry < entries; ++entry) {
    const Index row = indices(entry, 0) * steps + indices(entry, 1);
    auto [it, inserted] =
        sums.emplace(std::make_pair(row, Index(indices(entry, 2))), values[entry]);
    if (!inserted) it->second += values[entry];
  }
  check_structure(query, batch, steps, features, sums, /*sorted_distinct_columns=*/true);
  // coo_to_stored: every entry points at the stored value of its own coordinate.
  const auto& stored = query.coo_to_stored();
  SDMHA_FUZZ_CHECK(Index(stored.size()) == entries);
  const auto& csr = query.csr();
  for (int entry = 0; entry < entries; ++entry) {
    const Index position = stored[std::size_t(entry)];
    SDMHA_FUZZ_CHECK(position >= 0 && position < csr.nonzeros());
    SDMHA_FUZZ_CHECK(csr.column_indices[position] == indices(entry, 2));
    const Index row = indices(entry, 0) * steps + indices(entry, 1);
    SDMHA_FUZZ_CHECK(csr.row_begin(row) <= position && position < csr.row_end(row));
  }
}

template <typename Scalar, typename StorageIndex>
void fuzz_view_csr(FuzzedDataProvider& provider, std::int64_t batch, std::int64_t steps,
                   std::int64_t features) {
  using Query = sdmha::SparseQuery<Scalar, StorageIndex>;
  const bool valid_shape = shape_is_valid<StorageIndex>(batch, steps, features);
  // The arrays are the caller's, so their lengths are honest; their contents are not. Most of the
  // time row_offsets has the B·T + 1 entries the shape asks for.
  Index offsets_size = provider.ConsumeIntegralInRange<Index>(0, kMaxEntries);
  if (valid_shape && batch * steps < kMaxEntries && provider.ConsumeIntegralInRange<int>(0, 7) != 0)
    offsets_size = batch * steps + 1;
  const Index nonzero_count = provider.ConsumeIntegralInRange<Index>(0, kMaxEntries);
  std::vector<StorageIndex> offsets(static_cast<std::size_t>(offsets_size));
  // Offsets: nondecreasing steps from 0 most of the time, anything sometimes.
  const bool arbitrary_offsets = provider.ConsumeIntegralInRange<int>(0, 7) == 0;
  Index running = 0;
  for (Index i = 0; i < offsets_size; ++i) {
    if (arbitrary_offsets) {
      offsets[std::size_t(i)] = static_cast<StorageIndex>(consume_integer(provider));
    } else {
      offsets[std::size_t(i)] = static_cast<StorageIndex>(running);
      running =
          std::min<Index>(nonzero_count, running + provider.ConsumeIntegralInRange<Index>(0, 4));
    }
  }
  if (!arbitrary_offsets && offsets_size > 1 && provider.ConsumeBool())
    offsets.back() = static_cast<StorageIndex>(nonzero_count);
  std::vector<StorageIndex> columns(static_cast<std::size_t>(nonzero_count));
  std::vector<Scalar> values(static_cast<std::size_t>(nonzero_count));
  for (Index k = 0; k < nonzero_count; ++k) {
    columns[std::size_t(k)] = static_cast<StorageIndex>(consume_coordinate(provider, features));
    values[std::size_t(k)] = Scalar(consume_exact_value(provider));
  }
  const StorageIndex* offsets_pointer =
      offsets.empty() && provider.ConsumeBool() ? nullptr : offsets.data();
  const StorageIndex* columns_pointer = columns.empty() ? nullptr : columns.data();
  const Scalar* values_pointer = values.empty() ? nullptr : values.data();

  // What the documented checks accept: a valid shape, B·T + 1 offsets from 0 to nonzero_count that
  // never decrease, columns inside [0, Eq), and arrays present where entries are.
  bool should_accept = valid_shape && offsets_pointer != nullptr &&
                       offsets_size == batch * steps + 1 && offsets[0] == 0 &&
                       Index(offsets.back()) == nonzero_count;
  for (Index i = 0; should_accept && i + 1 < offsets_size; ++i)
    should_accept = offsets[std::size_t(i)] <= offsets[std::size_t(i + 1)];
  for (Index k = 0; should_accept && k < nonzero_count; ++k)
    should_accept = columns[std::size_t(k)] >= 0 && columns[std::size_t(k)] < features;

  Query query;
  const bool accepted = sdmha_fuzz::accepts([&] {
    query = Query::view_csr(batch, steps, features, offsets_pointer, offsets_size, columns_pointer,
                            values_pointer, nonzero_count);
  });
  SDMHA_FUZZ_CHECK(accepted == should_accept);
  if (!accepted) return;

  // Accepted: the shape was valid, the offsets cover exactly the arrays, rows never run backwards.
  SDMHA_FUZZ_CHECK(valid_shape);
  SDMHA_FUZZ_CHECK(offsets_size == batch * steps + 1);
  SDMHA_FUZZ_CHECK(offsets[0] == 0 && Index(offsets.back()) == nonzero_count);
  SDMHA_FUZZ_CHECK(query.nonzeros() == nonzero_count);
  CoordinateSums<Scalar> sums;
  for (Index row = 0; row < batch * steps; ++row) {
    SDMHA_FUZZ_CHECK(offsets[std::size_t(row)] <= offsets[std::size_t(row + 1)]);
    for (Index k = offsets[std::size_t(row)]; k < offsets[std::size_t(row + 1)]; ++k) {
      auto [it, inserted] =
          sums.emplace(std::make_pair(row, Index(columns[std::size_t(k)])), values[std::size_t(k)]);
      if (!inserted) it->second += values[std::size_t(k)];
    }
  }
  // Caller CSR may hold unsorted or repeated columns: only ranges and sums are checked.
  check_structure(query, batch, steps, features, sums, /*sorted_distinct_columns=*/false);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using Constructor = void (*)(FuzzedDataProvider&, std::int64_t, std::int64_t, std::int64_t);
  static constexpr Constructor kConstructors[] = {
      fuzz_from_coo<double, int>,         fuzz_from_coo<float, std::int16_t>,
      fuzz_from_coo<float, std::int64_t>, fuzz_view_csr<double, int>,
      fuzz_view_csr<float, std::int16_t>, fuzz_view_csr<double, std::int64_t>};
  FuzzedDataProvider provider(data, size);
  const Constructor constructor = kConstructors[provider.ConsumeIntegralInRange<int>(0, 5)];
  const std::int64_t batch = consume_integer(provider);
  const std::int64_t steps = consume_integer(provider);
  const std::int64_t features = consume_integer(provider);
  constructor(provider, batch, steps, features);
  return 0;
}
