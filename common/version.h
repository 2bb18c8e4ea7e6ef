// The release every program reports with --version. CMake's project() version is its one source
// (a compile definition of moesnap_common, seen by everything that links it).
#ifndef MOESNAP_COMMON_VERSION_H_
#define MOESNAP_COMMON_VERSION_H_

#include <string>

namespace moesnap {

inline constexpr char kVersion[] = MOESNAP_VERSION;

// "moesnapd 0.1.0": the line `PROGRAM --version` prints.
inline std::string VersionLine(const std::string& program) { return program + " " + kVersion; }

}  // namespace moesnap

#endif  // MOESNAP_COMMON_VERSION_H_
