// EtcdKeys: formatting and parsing of the job's keys.
#include "daemon/cluster/etcd_keys.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace moesnap::daemon::cluster {
namespace {

// Steps may be negative: shifting by 2^63 keeps their order as unsigned 20-digit numbers.
constexpr uint64_t kStepBias = uint64_t{1} << 63;

}  // namespace

std::string EtcdKeys::Member(uint32_t node_id) const {
  return absl::StrFormat("%s%u", Members(), node_id);
}

std::string EtcdKeys::Durable(uint32_t node_id) const {
  return absl::StrFormat("%s%u", Durables(), node_id);
}

std::string EtcdKeys::Step(int64_t step) const {
  return absl::StrFormat("%s%020u", Steps(), static_cast<uint64_t>(step) ^ kStepBias);
}

std::optional<uint32_t> EtcdKeys::MemberOf(const std::string& key) const {
  uint32_t id = 0;
  if (!absl::StartsWith(key, Members()) || !absl::SimpleAtoi(key.substr(Members().size()), &id)) {
    return std::nullopt;
  }
  return id;
}

std::optional<uint32_t> EtcdKeys::DurableOf(const std::string& key) const {
  uint32_t id = 0;
  // Only the form Durable() writes: digits, no sign, no leading zero, so one node has one key.
  const std::string digits = absl::StartsWith(key, Durables()) ? key.substr(Durables().size()) : "";
  if (digits.empty() || digits.size() > 10 || (digits.size() > 1 && digits[0] == '0') ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(digits, &id)) {
    return std::nullopt;
  }
  return id;
}

std::optional<int64_t> EtcdKeys::StepOf(const std::string& key) const {
  uint64_t biased = 0;
  if (!absl::StartsWith(key, Steps()) || key.size() != Steps().size() + 20 ||
      !absl::SimpleAtoi(key.substr(Steps().size()), &biased)) {
    return std::nullopt;
  }
  return static_cast<int64_t>(biased ^ kStepBias);
}

std::optional<uint32_t> EtcdKeys::NodeOfCandidate(const std::string& name) {
  uint32_t id = 0;
  if (!absl::SimpleAtoi(name, &id)) return std::nullopt;
  return id;
}

}  // namespace moesnap::daemon::cluster
