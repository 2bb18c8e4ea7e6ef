// What the fuzz targets fed protobuf-encoded requests share: the input parsed as a message. Their
// LLVMFuzzerInitialize (proto_input.cc) silences the parser, which logs every malformed UTF-8
// string it refuses: a refusal is not a finding.
#ifndef MOESNAP_TESTS_FUZZ_PROTO_INPUT_H_
#define MOESNAP_TESTS_FUZZ_PROTO_INPUT_H_

#include <cstddef>
#include <cstdint>

namespace moesnap::fuzz {

template <typename Message>
bool Parse(const uint8_t* data, size_t size, Message* message) {
  return message->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace moesnap::fuzz

#endif  // MOESNAP_TESTS_FUZZ_PROTO_INPUT_H_
