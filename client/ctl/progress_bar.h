// Progress of a long moesnapctl command (rebuild, verify, export) on a terminal:
// while the command's own call runs, a watcher polls the daemon for the running operation of that
// kind and redraws one line on stderr in place:
//   verify [##########----------]  50%  1.0 GiB / 2.0 GiB  812.3 MiB/s  1.3 s
// Nothing at all is drawn when stderr is not a terminal, or under --json.
#ifndef MOESNAP_CLIENT_CTL_PROGRESS_BAR_H_
#define MOESNAP_CLIENT_CTL_PROGRESS_BAR_H_

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "proto/moesnap.pb.h"

namespace moesnap::ctl {

// One frame, `width` characters of bar; bytes shown as sizes, other units as counts.
std::string RenderProgress(const v1::OperationProgress& progress, int width = 30);

class ProgressWatcher {
 public:
  using Poll = std::function<std::optional<v1::OperationProgress>()>;

  // Polls every `period` and draws on `out` (a terminal); with `enabled` false it does nothing.
  ProgressWatcher(Poll poll, bool enabled, std::FILE* out = stderr,
                  std::chrono::milliseconds period = std::chrono::milliseconds(200));
  ~ProgressWatcher();  // stops polling and erases the line it drew

  // The daemon's running operation of `kind`, asked through its admin socket.
  static Poll FromDaemon(const std::string& socket_path, const std::string& kind);
  // Whether progress should be drawn: stderr is a terminal and the output is not JSON.
  static bool Wanted(bool json);

 private:
  void Loop();

  Poll poll_;
  std::FILE* out_;
  std::chrono::milliseconds period_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool drew_ = false;
  std::thread thread_;
};

}  // namespace moesnap::ctl

#endif  // MOESNAP_CLIENT_CTL_PROGRESS_BAR_H_
