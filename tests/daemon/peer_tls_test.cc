// What a peer's certificate must say: the SAN URI moesnap://<job>/node/<id>, parsed strictly; a
// node's own files checked at load (signed by the CA, naming this node, with its key); a peer's
// certificate refused for each way it can be wrong, with the reason counted. The certificates are
// real, made by deploy/make-certs.sh.
#include "daemon/peer_tls.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "tests/testing/job_certificates.h"
#include "tests/testing/status_matchers.h"

namespace moesnap::daemon {
namespace {

using testing::JobCertificates;

std::string Read(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

TEST(PeerUriTest, NamesAJobAndANode) {
  const PeerIdentity identity{"train-42.v2", 17};
  EXPECT_EQ(PeerUri(identity), "moesnap://train-42.v2/node/17");
  EXPECT_EQ(PeerServerName(identity), "node-17.train-42.v2.moesnap");
  absl::StatusOr<PeerIdentity> parsed = ParsePeerUri("moesnap://train-42.v2/node/17");
  ASSERT_OK(parsed);
  EXPECT_EQ(*parsed, identity);
  ASSERT_OK(ParsePeerUri("moesnap://j/node/4294967295"));
}

TEST(PeerUriTest, RefusesAnythingElse) {
  for (const char* uri :
       {"", "moesnap://", "https://job/node/1", "moesnap://job/node/", "moesnap://job/node/01",
        "moesnap://job/node/-1", "moesnap://job/node/+1", "moesnap://job/node/1x",
        "moesnap://job/node/4294967296", "moesnap:///node/1", "moesnap://a b/node/1",
        "moesnap://a/b/node/1", "moesnap://job/nodes/1", "MOESNAP://job/node/1"}) {
    EXPECT_STATUS(ParsePeerUri(uri), absl::StatusCode::kInvalidArgument) << uri;
  }
}

class PeerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<JobCertificates>> job = JobCertificates::Make("tls-unit", 3);
    ASSERT_OK(job);
    job_ = *std::move(job);
  }
  TlsOptions Files(const JobCertificates& certificates, int node) const {
    return {certificates.ca_file(), certificates.cert_file(node), certificates.key_file(node)};
  }
  std::shared_ptr<const PeerTls> Node(int node) {
    absl::StatusOr<std::shared_ptr<const PeerTls>> tls =
        PeerTls::Load(Files(*job_, node), "tls-unit", node, 3);
    EXPECT_OK(tls);
    return tls.ok() ? *tls : nullptr;
  }
  std::unique_ptr<JobCertificates> job_;
};

TEST_F(PeerTlsTest, ANodeLoadsOnlyItsOwnCertificate) {
  std::shared_ptr<const PeerTls> tls = Node(1);
  ASSERT_NE(tls, nullptr);
  EXPECT_EQ(tls->self(), (PeerIdentity{"tls-unit", 1}));

  // Node 2's certificate given to node 1.
  absl::StatusOr<std::shared_ptr<const PeerTls>> swapped =
      PeerTls::Load(Files(*job_, 2), "tls-unit", 1, 3);
  EXPECT_STATUS(swapped, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(swapped.status().message(),
                                "names moesnap://tls-unit/node/2, this daemon is "
                                "moesnap://tls-unit/node/1"))
      << swapped.status();
  // Another job's name.
  EXPECT_TRUE(absl::StrContains(
      PeerTls::Load(Files(*job_, 1), "other", 1, 3).status().message(), "this daemon is "
                                                                        "moesnap://other/node/1"));
  // A key that is not the certificate's.
  TlsOptions wrong_key = Files(*job_, 1);
  wrong_key.key_file = job_->key_file(0);
  EXPECT_TRUE(absl::StrContains(PeerTls::Load(wrong_key, "tls-unit", 1, 3).status().message(),
                                "is not the key of tls.cert_file"));
  // A certificate of another CA.
  absl::StatusOr<std::unique_ptr<JobCertificates>> stranger = JobCertificates::Make("tls-unit", 3);
  ASSERT_OK(stranger);
  TlsOptions foreign = Files(**stranger, 1);
  foreign.ca_file = job_->ca_file();
  EXPECT_TRUE(absl::StrContains(PeerTls::Load(foreign, "tls-unit", 1, 3).status().message(),
                                "does not check against tls.ca_file"));
  // Missing files are named.
  TlsOptions missing = Files(*job_, 1);
  missing.ca_file = job_->directory() + "/none.pem";
  EXPECT_TRUE(absl::StrContains(PeerTls::Load(missing, "tls-unit", 1, 3).status().message(),
                                "cannot read tls.ca_file"));
}

TEST_F(PeerTlsTest, APeerIsCheckedForEveryWayItCanBeWrong) {
  std::shared_ptr<const PeerTls> tls = Node(0);
  ASSERT_NE(tls, nullptr);
  PeerRefusal refusal = PeerRefusal::kHandshake;

  absl::StatusOr<PeerIdentity> peer = tls->Check(Read(job_->cert_file(2)), "", &refusal);
  ASSERT_OK(peer);
  EXPECT_EQ(*peer, (PeerIdentity{"tls-unit", 2}));

  EXPECT_STATUS(tls->Check("", "", &refusal), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(refusal, PeerRefusal::kNoCertificate);

  EXPECT_STATUS(tls->Check("-----BEGIN CERTIFICATE-----\nnot base64\n", "", &refusal),
                absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(refusal, PeerRefusal::kUntrustedCertificate);

  absl::StatusOr<std::unique_ptr<JobCertificates>> stranger = JobCertificates::Make("tls-unit", 3);
  ASSERT_OK(stranger);
  absl::StatusOr<PeerIdentity> foreign = tls->Check(Read((*stranger)->cert_file(1)), "", &refusal);
  EXPECT_STATUS(foreign, absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(refusal, PeerRefusal::kUntrustedCertificate);
  EXPECT_TRUE(absl::StrContains(foreign.status().message(), "does not check against job "
                                                            "'tls-unit''s CA"))
      << foreign.status();

  absl::StatusOr<std::unique_ptr<JobCertificates>> other_job = job_->SameCa("other-job", 3);
  ASSERT_OK(other_job);
  absl::StatusOr<PeerIdentity> other = tls->Check(Read((*other_job)->cert_file(1)), "", &refusal);
  EXPECT_EQ(refusal, PeerRefusal::kOtherJob);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "names job 'other-job'"))
      << other.status();

  // Signed by the job's CA for a node the job does not have.
  absl::StatusOr<std::unique_ptr<JobCertificates>> more = job_->SameCa("tls-unit", 8);
  ASSERT_OK(more);
  absl::StatusOr<PeerIdentity> outside = tls->Check(Read((*more)->cert_file(7)), "", &refusal);
  EXPECT_EQ(refusal, PeerRefusal::kOtherNode);
  EXPECT_TRUE(absl::StrContains(outside.status().message(), "names node 7; job 'tls-unit' has "
                                                            "nodes 0..2"))
      << outside.status();
}

TEST_F(PeerTlsTest, AnExpiredCertificateIsRefused) {
  std::shared_ptr<const PeerTls> tls = Node(0);
  ASSERT_NE(tls, nullptr);
  // Signed by the job's CA and naming a node of the job, but expired at once (--days -1).
  absl::StatusOr<std::unique_ptr<JobCertificates>> expired =
      job_->SameCa("tls-unit", 3, {"--days", "-1"});
  ASSERT_OK(expired);
  PeerRefusal refusal = PeerRefusal::kHandshake;
  absl::StatusOr<PeerIdentity> old = tls->Check(Read((*expired)->cert_file(1)), "", &refusal);
  EXPECT_EQ(refusal, PeerRefusal::kUntrustedCertificate);
  EXPECT_TRUE(absl::StrContains(old.status().message(), "expired")) << old.status();
  // And a node whose own certificate expired does not start.
  EXPECT_TRUE(absl::StrContains(
      PeerTls::Load(Files(**expired, 1), "tls-unit", 1, 3).status().message(), "expired"));
}

TEST(PeerRefusalsTest, AreCountedWithTheLastOneKept) {
  const uint64_t before = PeerRefusals().total;
  RecordPeerRefusal(PeerPlane::kData, PeerRefusal::kOtherJob, "a test refusal");
  RecordPeerRefusal(PeerPlane::kControl, PeerRefusal::kNoCertificate, "another");
  const PeerRefusalSummary after = PeerRefusals();
  EXPECT_EQ(after.total, before + 2);
  EXPECT_EQ(after.last, "Peer service: refused a peer (no_certificate): another");
}

}  // namespace
}  // namespace moesnap::daemon
