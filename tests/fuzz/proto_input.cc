// LLVMFuzzerInitialize of the fuzz targets fed protobuf-encoded requests (proto_input.h).
#include <google/protobuf/stubs/logging.h>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}
