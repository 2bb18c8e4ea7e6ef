// Where every byte of a group's snapshot lives once it is erasure-coded across the group's nodes.
//
// A group is n = k + m nodes, numbered by their position 0..n-1 in the group. Each node's data (its
// snapshot for a step, seen as one byte string) is cut into units of `unit_bytes`; the last unit may be
// short. Stripe s holds k data units, one from each of k different nodes, and m parity units on the
// other m nodes. The parity positions rotate with the stripe, (s * m + i) mod n for i in [0, m), so
// that every node holds parity for m/n of the stripes and data for the rest; a node's u-th data unit
// goes into the u-th stripe in which it is a data node. Nodes keep their own data whole (a local
// restore reads no stripe); only parity is stored elsewhere.
//
// Nodes with less data than others contribute fewer units: a stripe position past the end of a node's
// data, or past the end of a short last unit, is virtually zero. Those zeros are never sent or stored;
// encoders and decoders treat them as zero-filled input (which adds nothing to parity).
//
// Everything here is arithmetic: no I/O, no allocation beyond the returned vectors, thread-safe.
#ifndef MOESNAP_ERASURE_STRIPE_LAYOUT_H_
#define MOESNAP_ERASURE_STRIPE_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace moesnap::erasure {

struct StripeMembers {
  std::vector<int> data_positions;    // k positions; data unit i of the stripe comes from data_positions[i]
  std::vector<int> parity_positions;  // m positions; parity unit j is stored on parity_positions[j]
};

struct UnitLocation {
  uint64_t stripe = 0;
  int index = 0;  // index of the unit within the stripe's data units, in [0, k)
};

class StripeLayout {
 public:
  // INVALID_ARGUMENT unless 1 <= k, 1 <= m, k + m <= 256 and unit_bytes is a positive multiple of 64
  // (ISA-L runs its vector loops without a scalar tail then).
  static absl::StatusOr<StripeLayout> Create(int data_units, int parity_units, uint64_t unit_bytes);

  int data_units() const { return k_; }
  int parity_units() const { return m_; }
  int group_size() const { return k_ + m_; }
  uint64_t unit_bytes() const { return unit_bytes_; }

  StripeMembers Members(uint64_t stripe) const;
  bool IsParityPosition(uint64_t stripe, int position) const;

  // The stripe and index of data unit `unit` of the node at `position`.
  UnitLocation DataUnitLocation(int position, uint64_t unit) const;
  // The unit of the node at `position` that stripe `stripe` holds (position must be a data position).
  uint64_t DataUnitOf(int position, uint64_t stripe) const;

  // Units a node with `bytes` of data has (the last may be short).
  uint64_t UnitCount(uint64_t bytes) const { return (bytes + unit_bytes_ - 1) / unit_bytes_; }
  // Stripes needed so that every node's data is covered, given each position's data length.
  uint64_t StripeCount(const std::vector<uint64_t>& bytes_per_position) const;
  // Bytes of data unit `unit` of a node holding `bytes` (0 past its end; short for the last unit).
  uint64_t UnitLength(uint64_t bytes, uint64_t unit) const;
  // Bytes of parity stripe `stripe` needs: the longest of its data units (the rest is virtual zeros).
  uint64_t ParityLength(uint64_t stripe, const std::vector<uint64_t>& bytes_per_position) const;

 private:
  StripeLayout(int data_units, int parity_units, uint64_t unit_bytes);

  int k_;
  int m_;
  uint64_t unit_bytes_;
  // The layout repeats every period_ stripes; within one, each node is a data node data_per_period_
  // times, at the stripes listed in data_stripes_[position] (ascending, each < period_).
  uint64_t period_;
  uint64_t data_per_period_;
  std::vector<std::vector<uint64_t>> data_stripes_;
  std::vector<std::vector<int>> data_index_;  // index of the unit within stripe, per (position, slot)
};

}  // namespace moesnap::erasure

#endif  // MOESNAP_ERASURE_STRIPE_LAYOUT_H_
