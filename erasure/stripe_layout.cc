// StripeLayout: the rotation is periodic with period n / gcd(n, m); one period is tabulated at
// construction so that every lookup is a division and a table read.
#include "erasure/stripe_layout.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "erasure/reed_solomon.h"

namespace moesnap::erasure {

absl::StatusOr<StripeLayout> StripeLayout::Create(int data_units, int parity_units,
                                                  uint64_t unit_bytes) {
  if (data_units < 1 || parity_units < 1 ||
      data_units + parity_units > ReedSolomon::kMaxTotalUnits) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported stripe shape (k=", data_units,
                                                   ", m=", parity_units, "): need k >= 1, m >= 1, k + m <= ",
                                                   ReedSolomon::kMaxTotalUnits));
  }
  if (unit_bytes == 0 || unit_bytes % 64 != 0 || unit_bytes > ReedSolomon::kMaxUnitBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe unit must be a positive multiple of 64 bytes up to ", ReedSolomon::kMaxUnitBytes,
        ", got ", unit_bytes));
  }
  return StripeLayout(data_units, parity_units, unit_bytes);
}

StripeLayout::StripeLayout(int data_units, int parity_units, uint64_t unit_bytes)
    : k_(data_units), m_(parity_units), unit_bytes_(unit_bytes) {
  const int n = k_ + m_;
  period_ = static_cast<uint64_t>(n / std::gcd(n, m_));
  data_per_period_ = period_ * k_ / n;
  data_stripes_.resize(n);
  data_index_.resize(n);
  for (uint64_t stripe = 0; stripe < period_; ++stripe) {
    const StripeMembers members = Members(stripe);
    for (int index = 0; index < k_; ++index) {
      const int position = members.data_positions[index];
      data_stripes_[position].push_back(stripe);
      data_index_[position].push_back(index);
    }
  }
}

StripeMembers StripeLayout::Members(uint64_t stripe) const {
  const int n = k_ + m_;
  StripeMembers members;
  const int first = static_cast<int>((stripe % static_cast<uint64_t>(n)) * m_ % n);
  for (int i = 0; i < m_; ++i) members.parity_positions.push_back((first + i) % n);
  for (int position = 0; position < n; ++position) {
    if (!IsParityPosition(stripe, position)) members.data_positions.push_back(position);
  }
  return members;
}

bool StripeLayout::IsParityPosition(uint64_t stripe, int position) const {
  const int n = k_ + m_;
  const int first = static_cast<int>((stripe % static_cast<uint64_t>(n)) * m_ % n);
  return (position - first + n) % n < m_;
}

UnitLocation StripeLayout::DataUnitLocation(int position, uint64_t unit) const {
  const uint64_t cycle = unit / data_per_period_;
  const uint64_t slot = unit % data_per_period_;
  return {cycle * period_ + data_stripes_[position][slot], data_index_[position][slot]};
}

uint64_t StripeLayout::DataUnitOf(int position, uint64_t stripe) const {
  const uint64_t cycle = stripe / period_;
  const std::vector<uint64_t>& stripes = data_stripes_[position];
  const uint64_t slot = static_cast<uint64_t>(
      std::lower_bound(stripes.begin(), stripes.end(), stripe % period_) - stripes.begin());
  return cycle * data_per_period_ + slot;
}

uint64_t StripeLayout::StripeCount(const std::vector<uint64_t>& bytes_per_position) const {
  uint64_t stripes = 0;
  for (size_t position = 0; position < bytes_per_position.size(); ++position) {
    const uint64_t units = UnitCount(bytes_per_position[position]);
    if (units == 0) continue;
    stripes = std::max(stripes, DataUnitLocation(static_cast<int>(position), units - 1).stripe + 1);
  }
  return stripes;
}

uint64_t StripeLayout::UnitLength(uint64_t bytes, uint64_t unit) const {
  const uint64_t start = unit * unit_bytes_;
  return start >= bytes ? 0 : std::min(unit_bytes_, bytes - start);
}

uint64_t StripeLayout::ParityLength(uint64_t stripe,
                                    const std::vector<uint64_t>& bytes_per_position) const {
  uint64_t longest = 0;
  for (int position : Members(stripe).data_positions) {
    longest = std::max(longest, UnitLength(bytes_per_position[position], DataUnitOf(position, stripe)));
  }
  return longest;
}

}  // namespace moesnap::erasure
