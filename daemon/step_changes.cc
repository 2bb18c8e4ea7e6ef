// StepChanges: changed units, and the stripes encoded afresh.
#include "daemon/step_changes.h"

#include <utility>

namespace moesnap::daemon {

StepChanges ChangesOf(const erasure::StripeLayout& layout, std::vector<std::vector<bool>> units,
                      const std::vector<uint64_t>& image_bytes, const std::set<int>& absent,
                      std::set<int> sent_early) {
  StepChanges changes;
  changes.units = std::move(units);
  changes.sent_early = std::move(sent_early);
  const uint64_t stripes = layout.StripeCount(image_bytes);
  changes.fresh_stripes.assign(stripes, false);
  for (uint64_t stripe = 0; stripe < stripes; ++stripe) {
    const erasure::StripeMembers members = layout.Members(stripe);
    bool fresh = true;
    for (int position : members.parity_positions) fresh = fresh && !absent.contains(position);
    for (int position : members.data_positions) {
      const uint64_t unit = layout.DataUnitOf(position, stripe);
      const bool changed = changes.Changed(position, unit);
      fresh = fresh && (layout.UnitLength(image_bytes[position], unit) == 0 || changed) &&
              !(changed && changes.sent_early.contains(position));
    }
    changes.fresh_stripes[stripe] = fresh;
  }
  return changes;
}

}  // namespace moesnap::daemon
