// JobCertificates: deploy/make-certs.sh in a temporary folder.
#include "tests/testing/job_certificates.h"

#include <stdlib.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/testing/child_process.h"

namespace moesnap::testing {
namespace {

absl::Status RunScript(const std::vector<std::string>& argv) {
  ChildProcess process(argv, {}, ChildProcess::Stderr::kCapture);
  std::string output;
  while (std::optional<std::string> line = process.ReadLine(std::chrono::seconds(60))) {
    absl::StrAppend(&output, *line, "\n");
  }
  const std::optional<int> code = process.Wait(std::chrono::seconds(60));
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("'", absl::StrJoin(argv, " "), "' exited with ",
                                          code.has_value() ? std::to_string(*code) : "no exit",
                                          ": ", output));
}

absl::StatusOr<std::string> MakeCertificates(const std::string& directory, const std::string& job,
                                             int nodes, const std::vector<std::string>& options) {
  std::vector<std::string> argv = {std::string(MOESNAP_SOURCE_DIR) + "/deploy/make-certs.sh",
                                   "--etcd-ip", "127.0.0.1"};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.insert(argv.end(), {directory, job, std::to_string(nodes)});
  if (absl::Status status = RunScript(argv); !status.ok()) return status;
  return directory;
}

std::string NewDirectory() {
  char directory[] = "/tmp/moesnap-certs-XXXXXX";
  return mkdtemp(directory);
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobCertificates>> JobCertificates::Make(
    const std::string& job, int nodes, const std::vector<std::string>& options) {
  std::unique_ptr<JobCertificates> made(new JobCertificates(NewDirectory()));
  if (absl::StatusOr<std::string> done = MakeCertificates(made->directory_, job, nodes, options);
      !done.ok()) {
    return done.status();
  }
  return made;
}

absl::StatusOr<std::unique_ptr<JobCertificates>> JobCertificates::SameCa(
    const std::string& job, int nodes, const std::vector<std::string>& options) const {
  std::unique_ptr<JobCertificates> made(new JobCertificates(NewDirectory()));
  std::error_code error;
  for (const char* file : {"/ca.pem", "/ca.key"}) {
    std::filesystem::copy_file(directory_ + file, made->directory_ + file, error);
    if (error) return absl::InternalError(absl::StrCat("copying ", file, ": ", error.message()));
  }
  if (absl::StatusOr<std::string> done = MakeCertificates(made->directory_, job, nodes, options);
      !done.ok()) {
    return done.status();
  }
  return made;
}

JobCertificates::~JobCertificates() {
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

std::string JobCertificates::cert_file(int node) const {
  return absl::StrCat(directory_, "/node-", node, ".pem");
}

std::string JobCertificates::key_file(int node) const {
  return absl::StrCat(directory_, "/node-", node, ".key");
}

std::string JobCertificates::TlsSection() const {
  return absl::StrCat("[tls]\nca_file = \"", ca_file(), "\"\ncert_file = \"", directory_,
                      "/node-{node}.pem\"\nkey_file = \"", directory_, "/node-{node}.key\"\n");
}

void JobCertificates::ServeEtcd(EtcdCluster::Options* options) const {
  options->server_cert_file = directory_ + "/etcd.pem";
  options->server_key_file = directory_ + "/etcd.key";
  options->client_ca_file = ca_file();
  options->client_tls = {.ca_file = ca_file(), .cert_file = cert_file(0), .key_file = key_file(0)};
}

}  // namespace moesnap::testing
