# Helper functions so that each folder's CMakeLists.txt is a few lines: one call per library,
# program or test, with warnings, sanitizers and include paths applied in one place.

set(MOESNAP_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Werror=return-type)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  list(APPEND MOESNAP_WARNINGS -Wthread-safety)
endif()

if(MOESNAP_FUZZ)
  # The fuzzers share the AddressSanitizer tree of deploy/sanitize.sh (one build of the libraries
  # for both); tests/fuzz adds libFuzzer's coverage to the units it fuzzes.
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang" OR NOT MOESNAP_SANITIZE MATCHES "address")
    message(FATAL_ERROR "MOESNAP_FUZZ=ON needs clang (libFuzzer) and AddressSanitizer: configure "
                        "with CC=clang CXX=clang++ -DMOESNAP_SANITIZE=address,undefined, as "
                        "deploy/fuzz.sh does")
  endif()
endif()

if(MOESNAP_SANITIZE)
  add_compile_options(-fsanitize=${MOESNAP_SANITIZE} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${MOESNAP_SANITIZE})
  if(MOESNAP_SANITIZE MATCHES "undefined")
    # Undefined behaviour stops the program (and fails its test) instead of printing and going on.
    add_compile_options(-fno-sanitize-recover=undefined)
  endif()
endif()

# Applies the project's compile settings to a target we own (not to generated code).
function(moesnap_target_defaults target)
  target_compile_options(${target} PRIVATE ${MOESNAP_WARNINGS})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR})
endfunction()

# moesnap_library(NAME SOURCES a.cc b.cc PUBLIC_DEPS x PRIVATE_DEPS y)
function(moesnap_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  moesnap_target_defaults(${name})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
endfunction()

# moesnap_program(NAME SOURCES main.cc DEPS x y): an installed program in build/bin/.
function(moesnap_program name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  moesnap_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  install(TARGETS ${name} RUNTIME DESTINATION bin)
endfunction()

# moesnap_test(NAME SOURCES x_test.cc DEPS lib LABELS unit): a GoogleTest binary whose cases
# CTest discovers one by one, so `ctest -R` can run a single case. A test may carry several labels
# (LABELS unit unit-threads); the target tests-<label> builds every test binary of a label.
# RESOURCE_LOCK name: no two cases holding the same lock run at once (a system setting they move).
function(moesnap_test name)
  cmake_parse_arguments(ARG "" "RESOURCE_LOCK" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  moesnap_target_defaults(${name})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} moesnap_testing GTest::gmock GTest::gtest_main)
  if(MOESNAP_SANITIZE MATCHES "thread")
    # Debian's abseil is built without TSan: the test program tells TSan about its locks, binding
    # its own definitions of the Mutex and CondVar calls ahead of the library's (see the file).
    target_link_libraries(${name} PRIVATE moesnap_tsan_absl_mutex)
    target_link_options(${name} PRIVATE "LINKER:--export-dynamic-symbol=_ZN4absl*")
  endif()
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  foreach(label ${ARG_LABELS})
    set_property(GLOBAL APPEND PROPERTY MOESNAP_TESTS_OF_LABEL_${label} ${name})
  endforeach()
  list(GET ARG_LABELS 0 first_label)
  set(lock_property)
  if(ARG_RESOURCE_LOCK)
    set(lock_property RESOURCE_LOCK ${ARG_RESOURCE_LOCK})
  endif()
  # Ordinary pages unless a test asks for huge ones itself, whatever the caller's environment.
  gtest_discover_tests(${name}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    PROPERTIES LABELS ${first_label} ${lock_property} ENVIRONMENT MOESNAP_HUGE_PAGES=0
    DISCOVERY_TIMEOUT 60)
  list(LENGTH ARG_LABELS label_count)
  if(label_count GREATER 1)
    # GoogleTest's discovery script splits a list-valued property into words, so the cases get
    # all their labels from a file of ours that CTest reads after the discovered ones, from the
    # list of cases discovery leaves in <name>_TESTS.
    set(labels_file ${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake)
    file(WRITE ${labels_file}
      "if(DEFINED ${name}_TESTS)\n"
      "  set_tests_properties(\${${name}_TESTS} PROPERTIES LABELS \"${ARG_LABELS}\")\n"
      "endif()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${labels_file})
  endif()
endfunction()

# moesnap_label_targets(unit integration ...): a target tests-<label> for each label, building
# the test binaries of that label (and what they run, as their dependencies say), so that a tree
# of its own (deploy/sanitize.sh) builds only what the labels it runs need.
function(moesnap_label_targets)
  foreach(label ${ARGN})
    get_property(tests GLOBAL PROPERTY MOESNAP_TESTS_OF_LABEL_${label})
    add_custom_target(tests-${label})
    if(tests)
      add_dependencies(tests-${label} ${tests})
    endif()
  endforeach()
endfunction()

# moesnap_proto_library(NAME PROTOS a.proto b.proto): C++ messages (protoc) and services
# (grpc_cpp_plugin) generated from .proto files of the current folder, as one static library. Imports
# resolve from the project root; generated headers are included as "<folder>/<name>.pb.h".
function(moesnap_proto_library name)
  cmake_parse_arguments(ARG "" "" "PROTOS" ${ARGN})
  file(RELATIVE_PATH folder ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  set(generated_root ${CMAKE_CURRENT_BINARY_DIR}/generated)
  set(generated_sources)
  foreach(proto ${ARG_PROTOS})
    get_filename_component(stem ${proto} NAME_WE)
    set(prefix ${generated_root}/${folder}/${stem})
    set(outputs ${prefix}.pb.cc ${prefix}.pb.h ${prefix}.grpc.pb.cc ${prefix}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${outputs}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${generated_root}
      COMMAND protobuf::protoc
        --proto_path=${PROJECT_SOURCE_DIR}
        --cpp_out=${generated_root}
        --grpc_out=${generated_root}
        --plugin=protoc-gen-grpc=${MOESNAP_GRPC_CPP_PLUGIN}
        ${CMAKE_CURRENT_SOURCE_DIR}/${proto}
      DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/${proto} protobuf::protoc
      COMMENT "Generating C++ from ${folder}/${proto}")
    list(APPEND generated_sources ${outputs})
  endforeach()
  add_library(${name} STATIC ${generated_sources})
  # protoc writes the same file-level names into every .pb.cc: each compiles alone.
  set_target_properties(${name} PROPERTIES UNITY_BUILD OFF)
  # Generated code is not ours to lint: no project warnings here.
  target_include_directories(${name} PUBLIC ${generated_root})
  target_link_libraries(${name} PUBLIC protobuf::libprotobuf PkgConfig::GRPCPP)
endfunction()

# moesnap_external_proto_library(NAME IMPORT_ROOTS dir... MESSAGES a/b.proto... SERVICES a/b.proto...):
# C++ generated from .proto files that stay where a package installed them, named relative to one of
# IMPORT_ROOTS (the way they import each other). MESSAGES get protoc's messages only; SERVICES get
# messages and gRPC services. Generated headers are included by that relative name
# ("etcd/etcdserver/etcdserverpb/rpc.pb.h") and are system headers to our code, so our warnings
# do not fire on generated code.
function(moesnap_external_proto_library name)
  cmake_parse_arguments(ARG "" "" "IMPORT_ROOTS;MESSAGES;SERVICES" ${ARGN})
  set(generated_root ${CMAKE_CURRENT_BINARY_DIR}/generated)
  set(import_flags)
  foreach(root ${ARG_IMPORT_ROOTS} ${Protobuf_INCLUDE_DIRS})
    list(APPEND import_flags --proto_path=${root})
  endforeach()
  set(generated_sources)
  foreach(proto ${ARG_MESSAGES} ${ARG_SERVICES})
    set(source)
    foreach(root ${ARG_IMPORT_ROOTS})
      if(NOT source AND EXISTS ${root}/${proto})
        set(source ${root}/${proto})
      endif()
    endforeach()
    if(NOT source)
      message(FATAL_ERROR "${proto} is under none of ${ARG_IMPORT_ROOTS}")
    endif()
    string(REGEX REPLACE "\\.proto$" "" stem ${proto})
    set(outputs ${generated_root}/${stem}.pb.cc ${generated_root}/${stem}.pb.h)
    set(plugin_flags)
    if(proto IN_LIST ARG_SERVICES)
      list(APPEND outputs ${generated_root}/${stem}.grpc.pb.cc ${generated_root}/${stem}.grpc.pb.h)
      set(plugin_flags --grpc_out=${generated_root} --plugin=protoc-gen-grpc=${MOESNAP_GRPC_CPP_PLUGIN})
    endif()
    add_custom_command(
      OUTPUT ${outputs}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${generated_root}
      COMMAND protobuf::protoc ${import_flags} --cpp_out=${generated_root} ${plugin_flags} ${source}
      DEPENDS ${source} protobuf::protoc
      COMMENT "Generating C++ from ${proto}")
    list(APPEND generated_sources ${outputs})
  endforeach()
  add_library(${name} STATIC ${generated_sources})
  set_target_properties(${name} PROPERTIES UNITY_BUILD OFF)  # as in moesnap_proto_library
  target_include_directories(${name} SYSTEM PUBLIC ${generated_root})
  target_link_libraries(${name} PUBLIC protobuf::libprotobuf PkgConfig::GRPCPP)
endfunction()

include(GoogleTest)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# moesnap_shared_library(NAME OUTPUT_NAME x EXPORT_NAME y VERSION v SOVERSION n [SOURCES a.cc]
#                        [OBJECTS_OF static libraries] PUBLIC_DEPS x PRIVATE_DEPS y): an installed
# shared library, its API headers in client/include. Only its own symbols leave it: what it takes
# from static archives (the wire schema, common/, erasure/) stays inside, so that it never clashes
# with another copy in the same process. Its run path is its own folder, where the wheel puts
# what it needs.
function(moesnap_shared_library name)
  cmake_parse_arguments(ARG "" "OUTPUT_NAME;EXPORT_NAME;VERSION;SOVERSION"
                        "SOURCES;OBJECTS_OF;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(objects)
  foreach(library ${ARG_OBJECTS_OF})
    list(APPEND objects $<TARGET_OBJECTS:${library}>)
  endforeach()
  add_library(${name} SHARED ${ARG_SOURCES} ${objects})
  target_compile_options(${name} PRIVATE ${MOESNAP_WARNINGS})
  target_include_directories(${name}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/client/include>
           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_link_options(${name} PRIVATE LINKER:--exclude-libs,ALL)
  if(NOT MOESNAP_SANITIZE)
    # Sanitized, clang leaves the sanitizer runtime to the program that loads the library.
    target_link_options(${name} PRIVATE LINKER:--no-undefined)
  endif()
  set_target_properties(${name} PROPERTIES
    OUTPUT_NAME ${ARG_OUTPUT_NAME} EXPORT_NAME ${ARG_EXPORT_NAME}
    VERSION ${ARG_VERSION} SOVERSION ${ARG_SOVERSION}
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    INSTALL_RPATH "$ORIGIN")
endfunction()

# moesnap_install_package(TARGETS a b HEADERS include/moesnap/x.h): `cmake --install build
# --component client` puts the libraries, the headers, a CMake package (find_package(moesnap) gives
# moesnap::<export name>) and pkg-config files (moesnap for C++, moesnap-c for the C ABI) under the
# prefix. The pkg-config files find the prefix from where they lie, so a prefix given at install
# time works.
function(moesnap_install_package)
  cmake_parse_arguments(ARG "" "" "TARGETS;HEADERS" ${ARGN})
  set(package_dir ${CMAKE_INSTALL_LIBDIR}/cmake/moesnap)
  install(TARGETS ${ARG_TARGETS} EXPORT moesnapTargets COMPONENT client
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(FILES ${ARG_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moesnap COMPONENT client)
  install(EXPORT moesnapTargets NAMESPACE moesnap:: DESTINATION ${package_dir} COMPONENT client)
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/moesnapConfig.cmake.in
    ${CMAKE_CURRENT_BINARY_DIR}/moesnapConfig.cmake INSTALL_DESTINATION ${package_dir})
  write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/moesnapConfigVersion.cmake
    COMPATIBILITY SameMinorVersion)
  install(FILES ${CMAKE_CURRENT_BINARY_DIR}/moesnapConfig.cmake
                ${CMAKE_CURRENT_BINARY_DIR}/moesnapConfigVersion.cmake
          DESTINATION ${package_dir} COMPONENT client)
  # From <prefix>/<libdir>/pkgconfig back up to <prefix>.
  string(REGEX REPLACE "[^/]+" ".." prefix_from_pkgconfig "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  foreach(pc moesnap moesnap-c)
    configure_file(${PROJECT_SOURCE_DIR}/cmake/${pc}.pc.in ${CMAKE_CURRENT_BINARY_DIR}/${pc}.pc @ONLY)
    install(FILES ${CMAKE_CURRENT_BINARY_DIR}/${pc}.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
            COMPONENT client)
  endforeach()
endfunction()
