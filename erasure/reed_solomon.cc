// ReedSolomon: the codec over ISA-L, plus the decode-plan cache keyed by sources and wanted units.
#include "erasure/reed_solomon.h"

#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace moesnap::erasure {
namespace {

// ISA-L expands each GF(2^8) coefficient into 32 bytes of lookup tables.
constexpr size_t kTableBytesPerCoefficient = 32;

using PointerList = absl::InlinedVector<uint8_t*, 32>;

absl::Status CheckLength(size_t length) {
  if (length == 0 || length > ReedSolomon::kMaxUnitBytes) {
    return absl::InvalidArgumentError(absl::StrCat("unit length must be in [1, ",
                                                   ReedSolomon::kMaxUnitBytes, "], got ", length));
  }
  return absl::OkStatus();
}

template <typename Pointer>
absl::Status CheckBuffers(const char* what, absl::Span<Pointer const> buffers, size_t expected) {
  if (buffers.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", expected, " ", what, " buffers, got ", buffers.size()));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(what, " buffer ", i, " is null"));
    }
  }
  return absl::OkStatus();
}

bool Overlap(const uint8_t* a, const uint8_t* b, size_t length) {
  return a < b + length && b < a + length;
}

// Every output must be disjoint from every other buffer, input or output; inputs may share bytes.
absl::Status CheckOutputsDisjoint(absl::Span<const uint8_t* const> inputs,
                                  absl::Span<uint8_t* const> outputs, size_t length) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (Overlap(outputs[i], outputs[j], length)) {
        return absl::InvalidArgumentError(
            absl::StrCat("output buffers ", i, " and ", j, " overlap"));
      }
    }
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (Overlap(outputs[i], inputs[j], length)) {
        return absl::InvalidArgumentError(
            absl::StrCat("output buffer ", i, " overlaps input buffer ", j));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

// The expanded tables of the matrix that maps k source units to the wanted ones; cached by the
// pair (sources, wanted).
struct ReedSolomon::DecodePlan {
  std::vector<uint8_t> tables;
};

// A bounded LRU map from a decode's pattern (its sources and wanted units) to its plan. Plans are
// shared_ptr so that one evicted while another thread decodes with it stays alive until that decode
// ends.
class ReedSolomon::DecodeCache {
 public:
  explicit DecodeCache(size_t capacity) : capacity_(capacity) {}

  std::shared_ptr<const DecodePlan> Find(const std::string& key) {
    absl::MutexLock lock(&mutex_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    entries_.splice(entries_.begin(), entries_, it->second);
    return it->second->second;
  }

  void Insert(const std::string& key, std::shared_ptr<const DecodePlan> plan) {
    if (capacity_ == 0) return;
    absl::MutexLock lock(&mutex_);
    if (index_.contains(key)) return;  // another thread built the same plan first
    entries_.emplace_front(key, std::move(plan));
    index_[key] = entries_.begin();
    if (entries_.size() > capacity_) {
      index_.erase(entries_.back().first);
      entries_.pop_back();
    }
  }

  size_t size() const {
    absl::MutexLock lock(&mutex_);
    return entries_.size();
  }

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const DecodePlan>>;
  const size_t capacity_;
  mutable absl::Mutex mutex_;
  std::list<Entry> entries_ ABSL_GUARDED_BY(mutex_);  // most recently used first
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mutex_);
};

ReedSolomon::ReedSolomon(int data_units, int parity_units, size_t decode_cache_entries)
    : data_units_(data_units),
      parity_units_(parity_units),
      decode_cache_(std::make_unique<DecodeCache>(decode_cache_entries)) {}

ReedSolomon::~ReedSolomon() = default;

absl::StatusOr<std::unique_ptr<ReedSolomon>> ReedSolomon::Create(int data_units, int parity_units,
                                                                 size_t decode_cache_entries) {
  if (data_units < 1 || parity_units < 1 || data_units + parity_units > kMaxTotalUnits) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported Reed-Solomon shape (k=", data_units, ", m=", parity_units,
        "): need k >= 1, m >= 1 and k + m <= ", kMaxTotalUnits,
        " (a Cauchy matrix over GF(2^8) needs k + m distinct field elements)"));
  }
  std::unique_ptr<ReedSolomon> codec(
      new ReedSolomon(data_units, parity_units, decode_cache_entries));
  const int total = data_units + parity_units;
  codec->generator_matrix_.resize(static_cast<size_t>(total) * data_units);
  gf_gen_cauchy1_matrix(codec->generator_matrix_.data(), total, data_units);
  codec->encode_tables_.resize(kTableBytesPerCoefficient * data_units * parity_units);
  ec_init_tables(data_units, parity_units,
                 codec->generator_matrix_.data() + static_cast<size_t>(data_units) * data_units,
                 codec->encode_tables_.data());
  return codec;
}

absl::Status ReedSolomon::Encode(absl::Span<const uint8_t* const> data,
                                 absl::Span<uint8_t* const> parity, size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (absl::Status s = CheckBuffers("data", data, data_units_); !s.ok()) return s;
  if (absl::Status s = CheckBuffers("parity", parity, parity_units_); !s.ok()) return s;
  if (absl::Status s = CheckOutputsDisjoint(data, parity, length); !s.ok()) return s;

  // ISA-L's signature takes mutable pointers; it only reads the sources.
  PointerList sources;
  for (const uint8_t* unit : data) sources.push_back(const_cast<uint8_t*>(unit));
  PointerList outputs(parity.begin(), parity.end());
  ec_encode_data(static_cast<int>(length), data_units_, parity_units_,
                 const_cast<uint8_t*>(encode_tables_.data()), sources.data(), outputs.data());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ReedSolomon::DecodePlan>> ReedSolomon::BuildDecodePlan(
    const std::vector<int>& sources, const std::vector<int>& wanted) const {
  const int k = data_units_;
  // Rows of the generator matrix that produced the sources, and their inverse: inverse * sources
  // gives back the k data units.
  std::vector<uint8_t> source_rows(static_cast<size_t>(k) * k);
  for (int row = 0; row < k; ++row) {
    std::memcpy(&source_rows[static_cast<size_t>(row) * k],
                &generator_matrix_[static_cast<size_t>(sources[row]) * k], k);
  }
  std::vector<uint8_t> inverse(static_cast<size_t>(k) * k);
  if (gf_invert_matrix(source_rows.data(), inverse.data(), k) != 0) {
    // Unreachable for a Cauchy matrix; kept as an error rather than a crash should the matrix change.
    return absl::InternalError(absl::StrCat("decode matrix of sources {",
                                            absl::StrJoin(sources, ","), "} is singular"));
  }

  std::vector<uint8_t> decode_rows(wanted.size() * k);
  for (size_t w = 0; w < wanted.size(); ++w) {
    const int unit = wanted[w];
    uint8_t* row = &decode_rows[w * k];
    if (unit < k) {
      std::memcpy(row, &inverse[static_cast<size_t>(unit) * k], k);
      continue;
    }
    // A parity unit: its generator row applied to the recovered data, folded into one row.
    const uint8_t* generator_row = &generator_matrix_[static_cast<size_t>(unit) * k];
    for (int column = 0; column < k; ++column) {
      uint8_t sum = 0;
      for (int t = 0; t < k; ++t) {
        sum ^= gf_mul(generator_row[t], inverse[static_cast<size_t>(t) * k + column]);
      }
      row[column] = sum;
    }
  }
  auto plan = std::make_shared<DecodePlan>();
  plan->tables.resize(kTableBytesPerCoefficient * k * wanted.size());
  ec_init_tables(k, static_cast<int>(wanted.size()), decode_rows.data(), plan->tables.data());
  return plan;
}

absl::Status ReedSolomon::Decode(absl::Span<uint8_t* const> units, absl::Span<const int> erased,
                                 size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (absl::Status s = CheckBuffers("unit", units, total_units()); !s.ok()) return s;
  if (erased.size() > static_cast<size_t>(parity_units_)) {
    return absl::InvalidArgumentError(
        absl::StrCat(erased.size(), " units erased {", absl::StrJoin(erased, ","), "}, but a (",
                     data_units_, ",", parity_units_, ") code recovers at most ", parity_units_));
  }
  std::vector<int> sorted_erased(erased.begin(), erased.end());
  std::sort(sorted_erased.begin(), sorted_erased.end());
  for (size_t i = 0; i < sorted_erased.size(); ++i) {
    if (sorted_erased[i] < 0 || sorted_erased[i] >= total_units()) {
      return absl::InvalidArgumentError(absl::StrCat("erased unit ", sorted_erased[i],
                                                     " is out of range [0, ", total_units(), ")"));
    }
    if (i > 0 && sorted_erased[i] == sorted_erased[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("erased unit ", sorted_erased[i], " is listed twice"));
    }
  }
  if (sorted_erased.empty()) return absl::OkStatus();
  // The first k survivors are read; no output may overlap any survivor, read or not.
  std::vector<int> survivors;
  for (int unit = 0, next_erased = 0; unit < total_units(); ++unit) {
    if (next_erased < static_cast<int>(sorted_erased.size()) && sorted_erased[next_erased] == unit) {
      ++next_erased;
    } else {
      survivors.push_back(unit);
    }
  }
  const std::vector<int> sources(survivors.begin(), survivors.begin() + data_units_);
  return DecodeChecked(units, sources, sorted_erased, survivors, length);
}

absl::Status ReedSolomon::DecodeFrom(absl::Span<uint8_t* const> units,
                                     absl::Span<const int> sources, absl::Span<const int> wanted,
                                     size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (units.size() != static_cast<size_t>(total_units())) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", total_units(), " unit buffers, got ", units.size()));
  }
  if (sources.size() != static_cast<size_t>(data_units_)) {
    return absl::InvalidArgumentError(absl::StrCat("a decode reads k = ", data_units_,
                                                   " source units, got ", sources.size()));
  }
  std::vector<bool> listed(total_units(), false);
  for (absl::Span<const int> list : {sources, wanted}) {
    for (int unit : list) {
      if (unit < 0 || unit >= total_units()) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit ", unit, " is out of range [0, ", total_units(), ")"));
      }
      if (listed[unit]) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit ", unit, " is listed twice in sources and wanted"));
      }
      if (units[unit] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("unit buffer ", unit, " is null"));
      }
      listed[unit] = true;
    }
  }
  if (wanted.empty()) return absl::OkStatus();
  std::vector<int> sorted_sources(sources.begin(), sources.end());
  std::sort(sorted_sources.begin(), sorted_sources.end());
  std::vector<int> sorted_wanted(wanted.begin(), wanted.end());
  std::sort(sorted_wanted.begin(), sorted_wanted.end());
  return DecodeChecked(units, sorted_sources, sorted_wanted, sorted_sources, length);
}

absl::Status ReedSolomon::DecodeChecked(absl::Span<uint8_t* const> units,
                                        const std::vector<int>& sources,
                                        const std::vector<int>& wanted,
                                        const std::vector<int>& kept, size_t length) const {
  std::vector<const uint8_t*> inputs;
  for (int unit : kept) inputs.push_back(units[unit]);
  PointerList source_units;
  for (int unit : sources) source_units.push_back(units[unit]);
  PointerList outputs;
  for (int unit : wanted) outputs.push_back(units[unit]);
  if (absl::Status s = CheckOutputsDisjoint(inputs, outputs, length); !s.ok()) return s;

  // k sources, then the wanted units; indices < 256 fit a char, and k is the codec's.
  std::string key(sources.begin(), sources.end());
  key.append(wanted.begin(), wanted.end());
  std::shared_ptr<const DecodePlan> plan = decode_cache_->Find(key);
  if (plan == nullptr) {
    absl::StatusOr<std::shared_ptr<const DecodePlan>> built = BuildDecodePlan(sources, wanted);
    if (!built.ok()) return built.status();
    plan = *std::move(built);
    decode_cache_->Insert(key, plan);
  }
  ec_encode_data(static_cast<int>(length), data_units_, static_cast<int>(outputs.size()),
                 const_cast<uint8_t*>(plan->tables.data()), source_units.data(), outputs.data());
  return absl::OkStatus();
}

absl::Status ReedSolomon::UpdateParity(int data_index, const uint8_t* delta,
                                       absl::Span<uint8_t* const> parity, size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (data_index < 0 || data_index >= data_units_) {
    return absl::InvalidArgumentError(absl::StrCat("data unit index ", data_index,
                                                   " is out of range [0, ", data_units_, ")"));
  }
  if (delta == nullptr) return absl::InvalidArgumentError("delta buffer is null");
  if (absl::Status s = CheckBuffers("parity", parity, parity_units_); !s.ok()) return s;
  const uint8_t* const inputs[] = {delta};
  if (absl::Status s = CheckOutputsDisjoint(inputs, parity, length); !s.ok()) return s;

  PointerList outputs(parity.begin(), parity.end());
  ec_encode_data_update(static_cast<int>(length), data_units_, parity_units_, data_index,
                        const_cast<uint8_t*>(encode_tables_.data()), const_cast<uint8_t*>(delta),
                        outputs.data());
  return absl::OkStatus();
}

absl::Status ReedSolomon::UpdateParity(int data_index, const uint8_t* old_data,
                                       const uint8_t* new_data, absl::Span<uint8_t* const> parity,
                                       size_t length) const {
  if (old_data == nullptr || new_data == nullptr) {
    return absl::InvalidArgumentError("old or new data buffer is null");
  }
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (absl::Status s = CheckBuffers("parity", parity, parity_units_); !s.ok()) return s;
  const uint8_t* const inputs[] = {old_data, new_data};
  if (absl::Status s = CheckOutputsDisjoint(inputs, parity, length); !s.ok()) return s;

  // The delta is built a piece at a time in a buffer that stays in L1/L2, so the update reads each
  // input byte once and never allocates.
  constexpr size_t kPieceBytes = 32 * 1024;
  alignas(64) uint8_t delta[kPieceBytes];
  PointerList outputs(parity.size());
  for (size_t offset = 0; offset < length; offset += kPieceBytes) {
    const size_t piece = std::min(kPieceBytes, length - offset);
    for (size_t i = 0; i < piece; ++i) delta[i] = old_data[offset + i] ^ new_data[offset + i];
    for (size_t j = 0; j < parity.size(); ++j) outputs[j] = parity[j] + offset;
    if (absl::Status s = UpdateParity(data_index, delta, outputs, piece); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ReedSolomon::CheckUnitIndices(int data_index, int parity_index) const {
  if (data_index < 0 || data_index >= data_units_) {
    return absl::InvalidArgumentError(absl::StrCat("data unit index ", data_index,
                                                   " is out of range [0, ", data_units_, ")"));
  }
  if (parity_index < 0 || parity_index >= parity_units_) {
    return absl::InvalidArgumentError(absl::StrCat("parity unit index ", parity_index,
                                                   " is out of range [0, ", parity_units_, ")"));
  }
  return absl::OkStatus();
}

absl::Status ReedSolomon::UpdateParityUnit(int data_index, int parity_index, const uint8_t* delta,
                                           uint8_t* parity, size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (absl::Status s = CheckUnitIndices(data_index, parity_index); !s.ok()) return s;
  if (delta == nullptr || parity == nullptr) return absl::InvalidArgumentError("a buffer is null");
  const uint8_t* const inputs[] = {delta};
  uint8_t* const outputs[] = {parity};
  if (absl::Status s = CheckOutputsDisjoint(inputs, outputs, length); !s.ok()) return s;
  // ec_init_tables lays the tables out row by row, 32 bytes per (row, data unit): row j starts at
  // j * k * 32, and a one-row update reads only that row.
  uint8_t* row_tables =
      const_cast<uint8_t*>(encode_tables_.data()) + size_t{32} * data_units_ * parity_index;
  uint8_t* row_outputs[] = {parity};
  ec_encode_data_update(static_cast<int>(length), data_units_, 1, data_index, row_tables,
                        const_cast<uint8_t*>(delta), row_outputs);
  return absl::OkStatus();
}

absl::Status ReedSolomon::UpdatedParityUnit(int data_index, int parity_index, const uint8_t* base,
                                            const uint8_t* delta, uint8_t* parity,
                                            size_t length) const {
  if (absl::Status s = CheckLength(length); !s.ok()) return s;
  if (absl::Status s = CheckUnitIndices(data_index, parity_index); !s.ok()) return s;
  if (delta == nullptr || parity == nullptr) return absl::InvalidArgumentError("a buffer is null");
  // A dot product of the sources (base, delta) with the coefficients (1, c), or of delta alone
  // with c where there is no base; ec_init_tables expands each coefficient into 32 bytes of tables.
  const uint8_t* sources[] = {base, delta};
  uint8_t coefficients[] = {
      1, generator_matrix_[static_cast<size_t>(data_units_ + parity_index) * data_units_ +
                           data_index]};
  const int first = base == nullptr ? 1 : 0;
  const int count = 2 - first;
  uint8_t* const outputs[] = {parity};
  if (absl::Status s =
          CheckOutputsDisjoint(absl::MakeConstSpan(sources + first, count), outputs, length);
      !s.ok()) {
    return s;
  }
  uint8_t tables[2 * 32];
  ec_init_tables(count, 1, coefficients + first, tables);
  uint8_t* to[] = {parity};
  ec_encode_data(static_cast<int>(length), count, 1, tables,
                 const_cast<uint8_t**>(sources + first), to);
  return absl::OkStatus();
}

size_t ReedSolomon::cached_decode_patterns() const { return decode_cache_->size(); }

}  // namespace moesnap::erasure
