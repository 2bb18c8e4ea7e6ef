// Certificates of a test job, made by deploy/make-certs.sh (the script operators use): the job's CA,
// a certificate and key per node, and one for etcd on 127.0.0.1, in a fresh temporary folder
// removed with the object. TlsSection() is the daemons' [tls] (one section for every node, through
// "{node}" in its paths); ServeEtcd() makes an EtcdCluster serve mutual TLS with the same CA.
#ifndef MOESNAP_TESTS_TESTING_JOB_CERTIFICATES_H_
#define MOESNAP_TESTS_TESTING_JOB_CERTIFICATES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/testing/etcd_process.h"

namespace moesnap::testing {

class JobCertificates {
 public:
  // Runs make-certs.sh DIR JOB NODES with `options` before its arguments (e.g. {"--days", "-1"}).
  static absl::StatusOr<std::unique_ptr<JobCertificates>> Make(
      const std::string& job, int nodes, const std::vector<std::string>& options = {});
  // More certificates signed by this CA (make-certs.sh run on a copy of the CA): of another job, of
  // more nodes, or with other `options` (an expired one: {"--days", "-1"}).
  absl::StatusOr<std::unique_ptr<JobCertificates>> SameCa(
      const std::string& job, int nodes, const std::vector<std::string>& options = {}) const;
  ~JobCertificates();
  JobCertificates(const JobCertificates&) = delete;
  JobCertificates& operator=(const JobCertificates&) = delete;

  const std::string& directory() const { return directory_; }
  std::string ca_file() const { return directory_ + "/ca.pem"; }
  std::string cert_file(int node) const;
  std::string key_file(int node) const;
  // [tls] for every node of the job.
  std::string TlsSection() const;
  // etcd serving this CA's etcd.pem on 127.0.0.1, requiring client certificates of the CA; the
  // test's own etcd client presents node 0's.
  void ServeEtcd(EtcdCluster::Options* options) const;

 private:
  explicit JobCertificates(std::string directory) : directory_(std::move(directory)) {}
  std::string directory_;
};

}  // namespace moesnap::testing

#endif  // MOESNAP_TESTS_TESTING_JOB_CERTIFICATES_H_
