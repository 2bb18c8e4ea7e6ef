// StepChanges: changed units, and the stripes encoded afresh.
#include "daemon/step_changes.h"

#include <utility>

namespace moesnap::daemon {

StepChanges ChangesOf(const erasure::StripeLayout& layout, std::vector<std::vector<bool>> units,
                      const std::vector<uint64_t>& image_bytes, const std::set<int>& absent) {
  StepChanges changes;
  changes.units = std::move(units);
  const uint64_t stripes = layout.StripeCount(image_bytes);
  changes.fresh_stripes.assign(stripes, false);
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    const erasure::StripeMembers members = layout.Members(stripe);
    bool fresh = true;
    for (int position : members.parity_positions) fresh = fresh && !absent.contains(position);
    for (int position : members.data_positions) {
      const uint64_t unit = layout.DataUnitOf(position, stripe);
      fresh = fresh && (layout.UnitLength(image_bytes[position], unit) == 0 ||
                        changes.Changed(position, unit));
    }
    changes.fresh_stripes[stripe] = fresh;
  }
  return changes;
}

}  // namespace moesnap::daemon
