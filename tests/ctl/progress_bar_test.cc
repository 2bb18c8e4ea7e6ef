// The progress bar: frames as rendered, and the watcher draws on its stream while polls find the
// operation, erases its line when done, and draws nothing when disabled.
#include "client/ctl/progress_bar.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"

namespace moesnap::ctl {
namespace {

v1::OperationProgress Verify(uint64_t done, uint64_t total, double seconds) {
  v1::OperationProgress progress;
  progress.set_kind("verify");
  progress.set_unit("bytes");
  progress.set_done(done);
  progress.set_total(total);
  progress.set_seconds(seconds);
  return progress;
}

TEST(ProgressBarTest, RendersBarPercentAmountsAndRate) {
  EXPECT_EQ(RenderProgress(Verify(uint64_t{1} << 30, uint64_t{2} << 30, 2.0), 10),
            "verify [#####-----]  50%  1.0 GiB / 2.0 GiB  512.0 MiB/s  2.0 s");
  v1::OperationProgress rebuild;
  rebuild.set_kind("rebuild");
  rebuild.set_unit("stripes");
  rebuild.set_done(3);
  rebuild.set_total(0);  // not known yet: the bar shows what is done
  EXPECT_EQ(RenderProgress(rebuild, 4), "rebuild [####] 100%  3 / 3 stripes");
}

// Reads what the watcher wrote to a temporary file.
std::string Drawn(bool enabled, int polls_before_found) {
  std::FILE* out = std::tmpfile();
  std::atomic<int> polls{0};
  {
    ProgressWatcher watcher(
        [&]() -> std::optional<v1::OperationProgress> {
          if (++polls <= polls_before_found) return std::nullopt;
          return Verify(static_cast<uint64_t>(polls.load()) << 20, uint64_t{10} << 20, 1.0);
        },
        enabled, out, std::chrono::milliseconds(1));
    while (enabled && polls < polls_before_found + 3) std::this_thread::yield();
  }
  std::fflush(out);
  std::rewind(out);
  std::string text;
  char buffer[4096];
  while (size_t read = std::fread(buffer, 1, sizeof(buffer), out)) text.append(buffer, read);
  std::fclose(out);
  return text;
}

TEST(ProgressBarTest, WatcherRedrawsInPlaceAndErasesItsLine) {
  const std::string text = Drawn(/*enabled=*/true, 2);
  EXPECT_TRUE(absl::StartsWith(text, "\rverify [")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\033[K\rverify [")) << text;  // redrawn over itself
  EXPECT_TRUE(absl::EndsWith(text, "\r\033[K")) << text;
}

TEST(ProgressBarTest, DisabledWatcherDrawsNothing) { EXPECT_EQ(Drawn(/*enabled=*/false, 0), ""); }

}  // namespace
}  // namespace moesnap::ctl
