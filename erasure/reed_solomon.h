// Reed-Solomon erasure coding over GF(2^8) with a Cauchy generator matrix, on Intel ISA-L.
// This header is the contract every caller (stripe layout, rebuild, sparse parity deltas) relies on;
// nothing else in moesnap calls ISA-L's erasure functions directly.
#ifndef MOESNAP_ERASURE_REED_SOLOMON_H_
#define MOESNAP_ERASURE_REED_SOLOMON_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moesnap::erasure {

// A systematic (k, m) code: k data units are kept as they are and m parity units are computed from
// them, so that any k of the k + m units recover all of them.
//
// Units and lengths
//   - A stripe is k + m units of the same length. Units are numbered 0..k-1 (data) then k..k+m-1
//     (parity); every `units` span below follows that numbering.
//   - The length is any value in [1, kMaxUnitBytes]. There is no padding rule: callers with shorter
//     shards pad them virtually (treat the missing tail as zeros) and need not store the zeros.
//   - No alignment is required. 64-byte aligned buffers whose length is a multiple of 64 run fastest
//     (ISA-L's AVX2/AVX-512 loops take a scalar tail otherwise).
//
// Aliasing
//   - Output buffers (parity on Encode, erased units on Decode, wanted units on DecodeFrom, parity
//     on UpdateParity) must not overlap each other or any input (on Decode, any unit not erased).
//     Overlap is detected and rejected with INVALID_ARGUMENT.
//
// Accepted shapes
//   - 1 <= k, 1 <= m, k + m <= kMaxTotalUnits (256). The bound is the field: the Cauchy matrix
//     1 / (x_i + y_j) needs k + m distinct elements of GF(2^8). Every other shape is rejected, never
//     clamped. Any k x k submatrix of [I; Cauchy] is invertible, so every pattern of at most m
//     erasures is decodable (this is why a Vandermonde matrix is not used: ISA-L's is not MDS for
//     every (k, m)).
//
// Threads
//   - All methods are const and safe to call from many threads at once on one codec. Encode tables are
//     built once in Create; decode tables are built on first use of a pattern (the units read and
//     the units wanted) and kept in a bounded LRU cache shared by all threads (a mutex guards only
//     the cache lookup, never the coding).
//
// Errors (absl::Status; the codec's state never changes on error, and no output byte is written)
//   - INVALID_ARGUMENT: bad shape, wrong number of buffers, a null buffer, a length out of range,
//     overlapping buffers, an erased index out of range or repeated, more than m erasures; on
//     DecodeFrom, sources that are not k, or a unit out of range or listed twice.
class ReedSolomon {
 public:
  static constexpr int kMaxTotalUnits = 256;
  // ISA-L takes lengths as int.
  static constexpr size_t kMaxUnitBytes = 0x7fffffff;
  static constexpr size_t kDefaultDecodeCacheEntries = 256;

  // Builds the generator matrix and the encode tables for (data_units, parity_units).
  static absl::StatusOr<std::unique_ptr<ReedSolomon>> Create(
      int data_units, int parity_units, size_t decode_cache_entries = kDefaultDecodeCacheEntries);

  ~ReedSolomon();
  ReedSolomon(const ReedSolomon&) = delete;
  ReedSolomon& operator=(const ReedSolomon&) = delete;

  int data_units() const { return data_units_; }
  int parity_units() const { return parity_units_; }
  int total_units() const { return data_units_ + parity_units_; }

  // Computes the m parity units from the k data units.
  absl::Status Encode(absl::Span<const uint8_t* const> data, absl::Span<uint8_t* const> parity,
                      size_t length) const;

  // Recomputes the units listed in `erased` (at most m distinct indices in [0, k + m)) from the others.
  // `units` holds k + m buffers; those of erased units are outputs, the others inputs. Buffers of
  // erased units are written in full; surviving units are only read.
  absl::Status Decode(absl::Span<uint8_t* const> units, absl::Span<const int> erased,
                      size_t length) const;

  // Recomputes only the units listed in `wanted` from the k units listed in `sources` (distinct
  // indices in [0, k + m), none in both lists): a repair that needs one lost unit of two computes
  // one. `units` holds k + m buffers, of which only those listed are touched (the others may be
  // null): wanted ones are written in full, sources only read. Decode is this with the first k
  // units not erased as sources and every erased unit wanted.
  absl::Status DecodeFrom(absl::Span<uint8_t* const> units, absl::Span<const int> sources,
                          absl::Span<const int> wanted, size_t length) const;

  // Brings parity up to date after data unit `data_index` changed by `delta` (old XOR new bytes),
  // touching no other data unit: parity_j ^= coefficient(j, data_index) * delta. Applying the deltas
  // of any sequence of updates gives the same parity as a full Encode of the final data.
  absl::Status UpdateParity(int data_index, const uint8_t* delta, absl::Span<uint8_t* const> parity,
                            size_t length) const;

  // The same from the unit's old and new bytes; computes the delta in cache-sized pieces.
  absl::Status UpdateParity(int data_index, const uint8_t* old_data, const uint8_t* new_data,
                            absl::Span<uint8_t* const> parity, size_t length) const;

  // The same for parity unit `parity_index` alone, for a node that holds only that unit:
  // parity ^= coefficient(parity_index, data_index) * delta. A full unit's data counts as its delta
  // from zero, so a holder can build its parity unit from the k data units as they arrive.
  absl::Status UpdateParityUnit(int data_index, int parity_index, const uint8_t* delta,
                                uint8_t* parity, size_t length) const;

  // The same out of place, for a holder whose new unit starts from the committed one:
  // parity = base ^ coefficient(parity_index, data_index) * delta, in one pass where a copy of
  // `base` and an update would take two. A null `base` is a unit at zero (parity = coefficient *
  // delta). `parity` must not overlap `base` or `delta`.
  absl::Status UpdatedParityUnit(int data_index, int parity_index, const uint8_t* base,
                                 const uint8_t* delta, uint8_t* parity, size_t length) const;

  // The (k + m) x k generator matrix, row-major: identity on top, Cauchy rows below.
  const std::vector<uint8_t>& generator_matrix() const { return generator_matrix_; }

  // How many decode-table sets are cached now (for tests and metrics).
  size_t cached_decode_patterns() const;

 private:
  class DecodeCache;
  struct DecodePlan;

  ReedSolomon(int data_units, int parity_units, size_t decode_cache_entries);
  // INVALID_ARGUMENT unless data_index names a data unit and parity_index a parity unit.
  absl::Status CheckUnitIndices(int data_index, int parity_index) const;
  absl::StatusOr<std::shared_ptr<const DecodePlan>> BuildDecodePlan(
      const std::vector<int>& sources, const std::vector<int>& wanted) const;
  // DecodeFrom once its arguments are checked (`sources` and `wanted` sorted, their buffers not
  // null), but for overlaps: no wanted buffer may overlap another or one of `kept`'s.
  absl::Status DecodeChecked(absl::Span<uint8_t* const> units, const std::vector<int>& sources,
                             const std::vector<int>& wanted, const std::vector<int>& kept,
                             size_t length) const;

  const int data_units_;
  const int parity_units_;
  std::vector<uint8_t> generator_matrix_;
  std::vector<uint8_t> encode_tables_;  // ec_init_tables of the m parity rows (also used by updates)
  std::unique_ptr<DecodeCache> decode_cache_;
};

}  // namespace moesnap::erasure

#endif  // MOESNAP_ERASURE_REED_SOLOMON_H_
