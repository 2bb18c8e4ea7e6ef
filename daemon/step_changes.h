// What a step changed in a group against the committed step, and so how each stripe's parity
// follows it. Every node of the group decides this alike from the same two records (the committed
// step's group images and the step's), so that what the members send is what the holders expect.
#ifndef MOESNAP_DAEMON_STEP_CHANGES_H_
#define MOESNAP_DAEMON_STEP_CHANGES_H_

#include <cstdint>
#include <set>
#include <vector>

#include "erasure/stripe_layout.h"

namespace moesnap::daemon {

struct StepChanges {
  // [position][unit]: the data unit holds a region captured again since the committed step.
  std::vector<std::vector<bool>> units;
  // [stripe]: every data unit of the stripe changed (a unit past its image's end holds nothing),
  // and every parity holder of it takes part in the step. Its parity is encoded afresh from the
  // new units, not updated with deltas: the holders start from zero and the members send their
  // units, so no member reads its old unit and no holder copies its old parity.
  std::vector<bool> fresh_stripes;

  bool Changed(int position, uint64_t unit) const {
    return unit < units[position].size() && units[position][unit];
  }
  bool Fresh(uint64_t stripe) const {
    return stripe < fresh_stripes.size() && fresh_stripes[stripe];
  }
};

// The changes of a step whose data units `units` ([position][unit], ChangedUnits of each position)
// changed, of a group whose images hold `image_bytes` by position. No stripe is fresh of which a
// position in `absent` holds parity: an absent node that receives the step's parity (a node that
// rebuilds) accumulates deltas only.
StepChanges ChangesOf(const erasure::StripeLayout& layout, std::vector<std::vector<bool>> units,
                      const std::vector<uint64_t>& image_bytes, const std::set<int>& absent);

}  // namespace moesnap::daemon

#endif  // MOESNAP_DAEMON_STEP_CHANGES_H_
