// Watcher: a Watch stream kept open on one endpoint at a time by a reader thread, which queues the
// events and re-creates the stream from the next undelivered revision after any failure, and a
// supervisor thread, which asks for a progress answer when the stream falls silent and cancels it
// when even that gets no answer (a stopped member keeps its TCP connection open).
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/etcd/endpoints.h"
#include "daemon/etcd/etcd_client.h"
#include "daemon/etcd/wire.h"

namespace moesnap::etcd {
namespace {
using WatchStream =
    grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>;
}  // namespace

class Watcher::Impl {
 public:
  // Events queued beyond this make the reader stop reading (gRPC flow control then holds etcd back)
  // until Next takes some: memory stays bounded whatever the consumer's pace.
  static constexpr size_t kMaxQueuedEvents = 4096;

  Impl(std::shared_ptr<internal::Endpoints> endpoints, std::string key, bool prefix,
       int64_t start_revision)
      : endpoints_(std::move(endpoints)),
        range_(internal::RangeOf(key, prefix)),
        what_(absl::StrCat("watch of ", prefix ? "prefix " : "", "'", absl::CHexEscape(key), "'")),
        next_to_request_(start_revision),
        next_to_deliver_(start_revision),
        reader_([this] { Read(); }),
        supervisor_([this] { Supervise(); }) {}

  ~Impl() {
    {
      absl::MutexLock lock(&mutex_);
      stopping_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    reader_.join();
    supervisor_.join();
  }

  absl::StatusOr<WatchEvent> Next(absl::Duration timeout) {
    absl::MutexLock lock(&mutex_);
    const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
      return !events_.empty() || !terminal_.ok();
    };
    mutex_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (events_.empty()) {
      if (!terminal_.ok()) return terminal_;
      return absl::DeadlineExceededError(absl::StrCat("etcd ", what_, ": no event from revision ",
                                                      next_to_deliver_, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    WatchEvent event = std::move(events_.front());
    events_.pop_front();
    // A transaction's events share one revision: it is delivered once the last of them is.
    const int64_t revision = event.kv.mod_revision;
    if (events_.empty() || events_.front().kv.mod_revision != revision) {
      next_to_deliver_ = revision + 1;
    }
    return event;
  }

  int64_t next_revision() const {
    absl::MutexLock lock(&mutex_);
    return next_to_deliver_;
  }

  int64_t resumes() const {
    absl::MutexLock lock(&mutex_);
    return resumes_;
  }

 private:
  // The reader thread: one stream after another, each from the next revision not yet received.
  void Read() {
    size_t index = endpoints_->preferred();
    size_t failed_in_a_row = 0;
    while (true) {
      {
        absl::MutexLock lock(&mutex_);
        if (stopping_ || !terminal_.ok()) return;
      }
      const internal::Endpoint& endpoint = endpoints_->at(index);
      const absl::Time dial_deadline = absl::Now() + endpoints_->options().dial_timeout;
      const bool received = endpoints_->Connect(index, dial_deadline) && Stream(endpoint);
      {
        absl::MutexLock lock(&mutex_);
        if (stopping_ || !terminal_.ok()) return;
        ++resumes_;
      }
      endpoints_->MoveAwayFrom(index);
      index = (index + 1) % endpoints_->size();
      failed_in_a_row = received ? 0 : failed_in_a_row + 1;
      if (failed_in_a_row >= endpoints_->size()) {
        // No endpoint gave a working stream: pause before the next round (a leader election takes
        // about one election timeout), waking at once if the watcher is destroyed.
        failed_in_a_row = 0;
        absl::MutexLock lock(&mutex_);
        mutex_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(100));
      }
    }
  }

  // One stream on `endpoint` until it fails, is cancelled, or the revisions were compacted. True if
  // it delivered anything (it worked for a while).
  bool Stream(const internal::Endpoint& endpoint) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->AddMetadata("hasleader", "true");
    std::unique_ptr<WatchStream> stream = endpoint.watch->Watch(context.get());
    etcdserverpb::WatchRequest create;
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) {
        context->TryCancel();
        stream->Finish().IgnoreError();
        return false;
      }
      context_ = context.get();
      last_heard_ = absl::Now();
      progress_asked_ = false;
      *create.mutable_create_request()->mutable_key() = range_.key();
      *create.mutable_create_request()->mutable_range_end() = range_.range_end();
      create.mutable_create_request()->set_start_revision(next_to_request_);
    }
    bool received = false;
    bool alive;
    {
      absl::MutexLock lock(&write_mutex_);
      alive = stream->Write(create);
      if (alive) {
        absl::MutexLock state_lock(&mutex_);
        stream_ = stream.get();
      }
    }
    etcdserverpb::WatchResponse response;
    while (alive && stream->Read(&response)) {
      if (response.compact_revision() > 0) {
        absl::MutexLock lock(&mutex_);
        terminal_ = absl::OutOfRangeError(absl::StrCat(
            "etcd ", what_, " needs revision ", next_to_request_, " but ", endpoint.address,
            " compacted the history up to revision ", response.compact_revision(),
            ": read the state again and watch from that read's revision + 1"));
        break;
      }
      if (response.canceled()) break;  // e.g. the member lost its leader: go elsewhere
      absl::MutexLock lock(&mutex_);
      last_heard_ = absl::Now();
      progress_asked_ = false;
      if (response.events_size() == 0) continue;  // created, or a progress answer
      received = true;
      for (const mvccpb::Event& event : response.events()) {
        events_.push_back(internal::FromWire(event));
      }
      // A response holds whole revisions (fragmenting is not asked for).
      next_to_request_ = response.events(response.events_size() - 1).kv().mod_revision() + 1;
      const auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
        return events_.size() < kMaxQueuedEvents || stopping_;
      };
      reader_waiting_ = true;
      mutex_.Await(absl::Condition(&room));
      reader_waiting_ = false;
      last_heard_ = absl::Now();
    }
    {
      absl::MutexLock lock(&write_mutex_);
      absl::MutexLock state_lock(&mutex_);
      stream_ = nullptr;
      context_ = nullptr;
    }
    context->TryCancel();
    stream->Finish().IgnoreError();
    return received;
  }

  // The supervisor thread: a stream silent for attempt_timeout is asked for progress; silent for
  // another attempt_timeout, it is cancelled, and the reader moves to the next endpoint.
  void Supervise() {
    const absl::Duration period = endpoints_->options().attempt_timeout;
    while (true) {
      bool ask = false;
      {
        absl::MutexLock lock(&mutex_);
        mutex_.AwaitWithTimeout(absl::Condition(&stopping_), period / 2);
        if (stopping_) return;
        if (stream_ == nullptr || reader_waiting_ || absl::Now() - last_heard_ < period) continue;
        if (progress_asked_) {
          context_->TryCancel();
          continue;
        }
        progress_asked_ = true;
        ask = true;
      }
      if (ask) {
        etcdserverpb::WatchRequest progress;
        progress.mutable_progress_request();
        absl::MutexLock lock(&write_mutex_);
        WatchStream* stream;
        {
          absl::MutexLock state_lock(&mutex_);
          stream = stream_;
          last_heard_ = absl::Now();
        }
        if (stream != nullptr) stream->Write(progress);
      }
    }
  }

  const std::shared_ptr<internal::Endpoints> endpoints_;
  const etcdserverpb::RangeRequest range_;  // the key and range end watched
  const std::string what_;

  // Serializes writes to the stream (the reader's create, the supervisor's progress requests);
  // taken before mutex_ when both are held.
  absl::Mutex write_mutex_ ABSL_ACQUIRED_BEFORE(mutex_);
  mutable absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::deque<WatchEvent> events_ ABSL_GUARDED_BY(mutex_);
  absl::Status terminal_ ABSL_GUARDED_BY(mutex_);    // set once: compacted
  int64_t next_to_request_ ABSL_GUARDED_BY(mutex_);  // the next stream starts here
  int64_t next_to_deliver_ ABSL_GUARDED_BY(mutex_);
  int64_t resumes_ ABSL_GUARDED_BY(mutex_) = 0;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mutex_) = nullptr;  // of the open stream
  WatchStream* stream_ ABSL_GUARDED_BY(mutex_) = nullptr;
  absl::Time last_heard_ ABSL_GUARDED_BY(mutex_);
  bool progress_asked_ ABSL_GUARDED_BY(mutex_) = false;
  bool reader_waiting_ ABSL_GUARDED_BY(mutex_) = false;  // for room in the queue
  std::thread reader_;  // last two: start once the fields above exist
  std::thread supervisor_;
};

std::unique_ptr<Watcher> Watcher::Start(std::shared_ptr<internal::Endpoints> endpoints,
                                        std::string key, bool prefix, int64_t start_revision) {
  return std::unique_ptr<Watcher>(new Watcher(
      std::make_unique<Impl>(std::move(endpoints), std::move(key), prefix, start_revision)));
}

Watcher::Watcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Watcher::~Watcher() = default;
absl::StatusOr<WatchEvent> Watcher::Next(absl::Duration timeout) { return impl_->Next(timeout); }
int64_t Watcher::next_revision() const { return impl_->next_revision(); }
int64_t Watcher::resumes() const { return impl_->resumes(); }

}  // namespace moesnap::etcd
