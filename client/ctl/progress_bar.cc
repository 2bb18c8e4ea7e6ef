// RenderProgress and the polling thread; the daemon is asked through Admin.Status.
#include "client/ctl/progress_bar.h"

#include <unistd.h>

#include <algorithm>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_size.h"
#include "proto/moesnap.grpc.pb.h"

namespace moesnap::ctl {

std::string RenderProgress(const v1::OperationProgress& progress, int width) {
  const uint64_t total = std::max(progress.total(), progress.done());
  const double fraction = total == 0 ? 0 : static_cast<double>(progress.done()) / total;
  const int filled = static_cast<int>(fraction * width);
  const bool bytes = progress.unit() == "bytes";
  auto amount = [bytes](uint64_t value) { return bytes ? FormatByteSize(value) : absl::StrCat(value); };
  std::string line = absl::StrFormat("%s [%s%s] %3d%%  %s / %s%s", progress.kind(),
                                     std::string(filled, '#'), std::string(width - filled, '-'),
                                     static_cast<int>(fraction * 100), amount(progress.done()),
                                     amount(total), bytes ? "" : " " + progress.unit());
  if (progress.seconds() > 0) {
    const double rate = progress.done() / progress.seconds();
    absl::StrAppend(&line, "  ", bytes ? FormatByteSize(static_cast<uint64_t>(rate))
                                       : absl::StrFormat("%.1f", rate),
                    "/s  ", absl::StrFormat("%.1f s", progress.seconds()));
  }
  return line;
}

ProgressWatcher::ProgressWatcher(Poll poll, bool enabled, std::FILE* out,
                                 std::chrono::milliseconds period)
    : poll_(std::move(poll)), out_(out), period_(period) {
  if (enabled) thread_ = std::thread([this] { Loop(); });
}

ProgressWatcher::~ProgressWatcher() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
  if (drew_) {
    std::fputs("\r\033[K", out_);  // erase the bar: the command's result follows on a clean line
    std::fflush(out_);
  }
}

void ProgressWatcher::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, period_, [this] { return stopping_; })) {
    lock.unlock();
    const std::optional<v1::OperationProgress> progress = poll_();
    lock.lock();
    if (!progress || stopping_) continue;
    std::fprintf(out_, "\r%s\033[K", RenderProgress(*progress).c_str());
    std::fflush(out_);
    drew_ = true;
  }
}

ProgressWatcher::Poll ProgressWatcher::FromDaemon(const std::string& socket_path,
                                                  const std::string& kind) {
  auto stub = std::shared_ptr<v1::Admin::Stub>(v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials())));
  return [stub, kind]() -> std::optional<v1::OperationProgress> {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::StatusResponse status;
    if (!stub->Status(&context, v1::StatusRequest(), &status).ok()) return std::nullopt;
    for (const v1::OperationProgress& operation : status.operations()) {
      if (operation.kind() == kind) return operation;
    }
    return std::nullopt;
  };
}

bool ProgressWatcher::Wanted(bool json) { return !json && isatty(STDERR_FILENO) == 1; }

}  // namespace moesnap::ctl
