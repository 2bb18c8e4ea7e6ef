// Election: candidate keys ordered by create revision; each candidate waits for the deletion of the
// one just before it, so a leader's loss wakes only its successor.
#include "daemon/etcd/election.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moesnap::etcd {

Election::Election(Client& client, std::string prefix)
    : client_(client), prefix_(std::move(prefix)) {}

absl::StatusOr<Leadership> Election::Campaign(const std::string& name, const std::string& value,
                                              int64_t lease, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const std::string key = absl::StrCat(prefix_, "/", name);
  absl::StatusOr<KeyValue> mine = Enter(key, value, lease, deadline);
  if (!mine.ok()) return mine.status();
  while (true) {
    // The candidate just before this one: the newest key created before it.
    absl::StatusOr<RangeResult> before = client_.GetPrefix(
        absl::StrCat(prefix_, "/"), RangeOptions{.order = RangeOptions::Order::kCreateDescending,
                                                 .limit = 1,
                                                 .max_create_revision = mine->create_revision - 1});
    if (!before.ok()) return before.status();
    if (before->kvs.empty()) {
      // None before it; check it is still there (its lease may have gone while this waited).
      absl::StatusOr<std::optional<KeyValue>> now = client_.Get(key);
      if (!now.ok()) return now.status();
      if (!now->has_value() || (*now)->create_revision != mine->create_revision) {
        return absl::AbortedError(
            absl::StrCat("etcd election '", absl::CHexEscape(prefix_), "': candidate key '",
                         absl::CHexEscape(key), "' (create revision ", mine->create_revision,
                         ") vanished while it waited; its lease ", lease, " was lost"));
      }
      return Leadership{.key = key, .token = mine->create_revision, .lease = lease};
    }
    if (absl::Status waited = WaitDeleted(before->kvs[0].key, before->revision + 1, deadline);
        !waited.ok()) {
      if (absl::IsDeadlineExceeded(waited)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "etcd election '", absl::CHexEscape(prefix_), "': '", absl::CHexEscape(name),
            "' not elected within ", absl::FormatDuration(timeout), "; waiting on '",
            absl::CHexEscape(before->kvs[0].key), "' (create revision ",
            before->kvs[0].create_revision, ")"));
      }
      return waited;
    }
  }
}

absl::StatusOr<KeyValue> Election::Enter(const std::string& key, const std::string& value,
                                         int64_t lease, absl::Time deadline) {
  while (true) {
    // Read first and write only when the key is absent: a candidate re-entering while its key
    // stands (every Campaign after one that timed out) must cost etcd no raft entry, and a write
    // Txn costs one even when its compare fails.
    absl::StatusOr<std::optional<KeyValue>> found = client_.Get(key);
    if (!found.ok()) return found.status();
    absl::StatusOr<KeyValue> stored = found->has_value()
                                          ? absl::StatusOr<KeyValue>(**found)
                                          : client_.WriteOnce(key, value, std::nullopt, lease);
    if (!stored.ok()) return stored.status();
    if (stored->lease == lease) return stored;  // created now, or by an earlier Campaign
    // Held by another lease: an earlier life of this candidate, which may still be running.
    if (absl::Status waited = WaitDeleted(key, stored->mod_revision + 1, deadline); !waited.ok()) {
      if (absl::IsDeadlineExceeded(waited)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "etcd election: candidate key '", absl::CHexEscape(key), "' is held by lease ",
            stored->lease, " (not this candidate's ", lease, ") and was not released in time"));
      }
      return waited;
    }
  }
}

absl::Status Election::WaitDeleted(const std::string& key, int64_t from_revision,
                                   absl::Time deadline) {
  absl::StatusOr<std::unique_ptr<Watcher>> watcher = client_.WatchKey(key, from_revision);
  if (!watcher.ok()) return watcher.status();
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("'", absl::CHexEscape(key), "' not deleted"));
    }
    absl::StatusOr<WatchEvent> event = (*watcher)->Next(left);
    if (absl::IsOutOfRange(event.status())) {
      // History compacted: whether the key still exists says enough.
      absl::StatusOr<std::optional<KeyValue>> now = client_.Get(key);
      if (!now.ok()) return now.status();
      if (!now->has_value()) return absl::OkStatus();
      return WaitDeleted(key, (*now)->mod_revision + 1, deadline);
    }
    if (!event.ok()) return event.status();
    if (event->type == WatchEvent::Type::kDelete) return absl::OkStatus();
  }
}

absl::StatusOr<std::optional<Leader>> Election::CurrentLeader() {
  const std::string candidates = absl::StrCat(prefix_, "/");
  absl::StatusOr<RangeResult> oldest = client_.GetPrefix(
      candidates, RangeOptions{.order = RangeOptions::Order::kCreateAscending, .limit = 1});
  if (!oldest.ok()) return oldest.status();
  if (oldest->kvs.empty()) return std::nullopt;
  return Leader{.name = oldest->kvs[0].key.substr(candidates.size()), .kv = oldest->kvs[0]};
}

absl::Status Election::Resign(const Leadership& leadership) {
  absl::StatusOr<TxnResult> result =
      client_.Txn(TxnRequest{.compares = {Compare::CreateRevision(
                                 leadership.key, Compare::Relation::kEqual, leadership.token)},
                             .on_success = {Operation::Delete(leadership.key)},
                             .safe_to_retry = true});
  return result.status();
}

}  // namespace moesnap::etcd
