# `cmake --install` rules and the CMake package, so that another project can do
#     find_package(reshard 0.1 REQUIRED)
#     target_link_libraries(app PRIVATE reshard::core)
# Components: "dev" (the public headers, the layers' archives, reshardConfig*.cmake), "runtime"
# (the reshard CLI), "python" (the extension reshard._C; only in wheel builds by
# scikit-build-core, which installs "runtime" and "python" alone: the CLI into the wheel's
# scripts, i.e. the environment's bin/).
#
# The core is static (PIC), one archive per layer (libreshard_base.a, _format, _io, _plan,
# _ops, _runtime; CMakeLists.txt), and reshard::core links them all: the CLI and the Python
# extension each carry their own copy, so neither needs an RPATH or a shared library next to
# it, and a consumer links self-contained archives through reshard::core. Their private
# dependencies travel with the exported targets as link-only entries, resolved in
# reshardConfig.cmake: zstd (reshard::zstd, found again the same way) and Threads
# (find_dependency); nlohmann_json is public (the inspect API returns nlohmann::json). xxhash
# is compiled in (XXH_INLINE_ALL) and needs nothing at link time.
#
# Headers: RESHARD_INSTALLED_HEADERS alone (CMakeLists.txt), what a C++ user of convert,
# verify, export, inspect, load and save needs; the other headers of include/reshard/ are for
# the layers themselves, and the internal ones (src/<layer>/*.h) never leave the tree.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(RESHARD_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/reshard" CACHE STRING
    "Where reshardConfig.cmake is installed, relative to the prefix")

if(SKBUILD)
  install(TARGETS reshard RUNTIME DESTINATION "${SKBUILD_SCRIPTS_DIR}" COMPONENT runtime)
else()
  install(TARGETS reshard RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT runtime)
endif()
if(SKBUILD AND TARGET reshard_python)
  install(TARGETS reshard_python LIBRARY DESTINATION reshard COMPONENT python)
endif()

set(_reshard_export_targets reshard_core)
foreach(_layer base format io plan ops runtime)
  set_target_properties(reshard_${_layer} PROPERTIES EXPORT_NAME ${_layer})
  list(APPEND _reshard_export_targets reshard_${_layer})
endforeach()
set_target_properties(reshard_core PROPERTIES EXPORT_NAME core)
if(TARGET reshard_cuda)
  set_target_properties(reshard_cuda PROPERTIES EXPORT_NAME cuda)
  list(APPEND _reshard_export_targets reshard_cuda)
endif()
install(TARGETS ${_reshard_export_targets} EXPORT reshardTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT dev
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
foreach(_header IN LISTS RESHARD_INSTALLED_HEADERS)
  get_filename_component(_dir "${_header}" DIRECTORY)
  if(EXISTS "${PROJECT_SOURCE_DIR}/include/${_header}")
    set(_from "${PROJECT_SOURCE_DIR}/include/${_header}")
  else()  # generated (build_config.h)
    set(_from "${RESHARD_GENERATED_INCLUDE_DIR}/${_header}")
  endif()
  install(FILES "${_from}" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${_dir}" COMPONENT dev)
endforeach()
install(EXPORT reshardTargets NAMESPACE reshard:: DESTINATION "${RESHARD_INSTALL_CMAKEDIR}"
        COMPONENT dev)

set(RESHARD_CONFIG_WITH_CUDA ${RESHARD_WITH_CUDA})
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/reshardConfig.cmake.in"
  "${CMAKE_CURRENT_BINARY_DIR}/reshardConfig.cmake"
  INSTALL_DESTINATION "${RESHARD_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/reshardConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/reshardConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/reshardConfigVersion.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/ReshardZstd.cmake"
        DESTINATION "${RESHARD_INSTALL_CMAKEDIR}" COMPONENT dev)
