// moesnap-erasure-demo: cuts a block of training-state-like bytes into (k, m) stripes, loses m units
// of every stripe at random, decodes them, and checks every byte by CRC-32C and by comparison.
// It shows what the erasure layer guarantees, on one machine, without daemons.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>

#include "erasure/crc32c.h"
#include "erasure/reed_solomon.h"

namespace {

struct DemoOptions {
  int data_units = 4;
  int parity_units = 2;
  size_t state_mib = 256;
  size_t unit_kib = 4096;
  uint64_t seed = 0;  // 0: a fresh seed each run
};

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int RunDemo(const DemoOptions& options) {
  using moesnap::erasure::Crc32c;
  using moesnap::erasure::ReedSolomon;
  absl::StatusOr<std::unique_ptr<ReedSolomon>> codec =
      ReedSolomon::Create(options.data_units, options.parity_units);
  if (!codec.ok()) {
    std::fprintf(stderr, "moesnap-erasure-demo: %s\n", codec.status().ToString().c_str());
    return 2;
  }
  const int k = options.data_units, m = options.parity_units, n = k + m;
  const size_t unit_bytes = options.unit_kib * 1024;
  const size_t stripe_data_bytes = unit_bytes * k;
  const size_t stripes = (options.state_mib * 1024 * 1024 + stripe_data_bytes - 1) / stripe_data_bytes;
  const uint64_t seed = options.seed != 0 ? options.seed : std::random_device{}();
  std::mt19937_64 random(seed);

  std::printf("state %zu MiB as %zu stripes of (%d data + %d parity) x %zu KiB units, seed %llu\n",
              options.state_mib, stripes, k, m, options.unit_kib,
              static_cast<unsigned long long>(seed));
  std::vector<std::vector<uint8_t>> units(stripes * n, std::vector<uint8_t>(unit_bytes));
  std::vector<uint32_t> crcs(units.size());
  for (size_t s = 0; s < stripes; ++s) {
    for (int i = 0; i < k; ++i) {
      auto* words = reinterpret_cast<uint64_t*>(units[s * n + i].data());
      for (size_t w = 0; w < unit_bytes / 8; ++w) words[w] = random();
    }
  }

  auto start = std::chrono::steady_clock::now();
  for (size_t s = 0; s < stripes; ++s) {
    std::vector<const uint8_t*> data;
    std::vector<uint8_t*> parity;
    for (int i = 0; i < n; ++i) (i < k ? (void)data.push_back(units[s * n + i].data())
                                       : (void)parity.push_back(units[s * n + i].data()));
    if (absl::Status status = (*codec)->Encode(data, parity, unit_bytes); !status.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", status.ToString().c_str());
      return 1;
    }
    for (int i = 0; i < n; ++i) crcs[s * n + i] = Crc32c(units[s * n + i].data(), unit_bytes);
  }
  const double encode_seconds = SecondsSince(start);

  // Lose m units of every stripe (a different set per stripe), then keep a copy to compare against.
  std::vector<std::vector<int>> lost(stripes);
  std::vector<std::vector<uint8_t>> originals;
  for (size_t s = 0; s < stripes; ++s) {
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), random);
    lost[s].assign(order.begin(), order.begin() + m);
    for (int unit : lost[s]) {
      originals.push_back(units[s * n + unit]);
      std::memset(units[s * n + unit].data(), 0, unit_bytes);
    }
  }

  start = std::chrono::steady_clock::now();
  for (size_t s = 0; s < stripes; ++s) {
    std::vector<uint8_t*> stripe_units;
    for (int i = 0; i < n; ++i) stripe_units.push_back(units[s * n + i].data());
    if (absl::Status status = (*codec)->Decode(stripe_units, lost[s], unit_bytes); !status.ok()) {
      std::fprintf(stderr, "decode of stripe %zu failed: %s\n", s, status.ToString().c_str());
      return 1;
    }
  }
  const double decode_seconds = SecondsSince(start);

  size_t crc_mismatches = 0, byte_mismatches = 0, checked = 0;
  for (size_t s = 0; s < stripes; ++s) {
    for (int unit : lost[s]) {
      const std::vector<uint8_t>& rebuilt = units[s * n + unit];
      if (Crc32c(rebuilt.data(), unit_bytes) != crcs[s * n + unit]) ++crc_mismatches;
      if (rebuilt != originals[checked]) ++byte_mismatches;
      ++checked;
    }
  }

  const double data_gb = static_cast<double>(stripes * stripe_data_bytes) / 1e9;
  std::printf("encode: %.2f GB/s of data    decode of %d lost units per stripe: %.2f GB/s\n",
              data_gb / encode_seconds, m, data_gb / decode_seconds);
  std::printf("memory for the protection of any %d losses: %.2fx the data (replication: %dx)\n", m,
              static_cast<double>(n) / k, m + 1);
  std::printf("units lost and rebuilt: %zu; CRC-32C mismatches: %zu; byte mismatches: %zu\n",
              checked, crc_mismatches, byte_mismatches);
  const bool ok = crc_mismatches == 0 && byte_mismatches == 0;
  std::printf("%s\n", ok ? "RESULT: every lost unit rebuilt bit-identical"
                         : "RESULT: FAILED, rebuilt bytes differ");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  DemoOptions options;
  CLI::App app{"Erasure-code a block of state, lose m units per stripe, rebuild and verify"};
  app.add_option("-k,--data-units", options.data_units, "Data units per stripe (k)");
  app.add_option("-m,--parity-units", options.parity_units, "Parity units per stripe (m)");
  app.add_option("--state-mib", options.state_mib, "Bytes of state to protect, in MiB")
      ->check(CLI::Range(1, 16384));
  app.add_option("--unit-kib", options.unit_kib, "Stripe unit size in KiB")
      ->check(CLI::Range(1, 65536));
  app.add_option("--seed", options.seed, "Random seed (0: a fresh one, printed)");
  CLI11_PARSE(app, argc, argv);
  return RunDemo(options);
}
