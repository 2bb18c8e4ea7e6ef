// The word people read for a step's state ("committed"), shared by the daemon's messages and
// moesnapctl's tables; and whether a state is final.
#ifndef MOESNAP_PROTO_STEP_STATE_NAME_H_
#define MOESNAP_PROTO_STEP_STATE_NAME_H_

#include <string>

#include "proto/moesnap.pb.h"

namespace moesnap {

inline std::string StepStateName(v1::StepState state) {
  switch (state) {
    case v1::STEP_STATE_CAPTURING: return "capturing";
    case v1::STEP_STATE_CAPTURED: return "captured";
    case v1::STEP_STATE_ENCODED: return "encoded";
    case v1::STEP_STATE_COMMITTED: return "committed";
    case v1::STEP_STATE_ABORTED: return "aborted";
    default: return "unknown";
  }
}

// A step committed or aborted changes no more.
inline bool IsFinished(v1::StepState state) {
  return state == v1::STEP_STATE_COMMITTED || state == v1::STEP_STATE_ABORTED;
}

}  // namespace moesnap

#endif  // MOESNAP_PROTO_STEP_STATE_NAME_H_
