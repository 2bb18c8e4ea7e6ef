// What moesnapctl prints about the durable tier: the drain's state on one line (status), the steps
// on disk (durable ls) and the tier the next restore would use (restore-tier). Pure functions of
// the daemon's responses.
#ifndef MOESNAP_CLIENT_CTL_DURABLE_FORMAT_H_
#define MOESNAP_CLIENT_CTL_DURABLE_FORMAT_H_

#include <cstdint>
#include <string>

#include "proto/moesnap.pb.h"

namespace moesnap::ctl {

// "off", or the newest durable step, a drain in progress, and the last failure with why.
std::string DescribeDurable(const v1::DurableStatus& durable);
// Ages are counted to `now_unix_ms`.
std::string FormatDurableList(const v1::ListDurableResponse& list, int64_t now_unix_ms);
std::string FormatRestoreTier(uint32_t rank, const v1::RestoreTierResponse& tier);
std::string TierWord(v1::Tier tier);

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_DURABLE_FORMAT_H_
