# Writes <build>/generated/include/reshard/base/build_config.h from
# include/reshard/base/build_config.h.in (version, CUDA, compiler, build type, torch)
# and sets RESHARD_GENERATED_INCLUDE_DIR.
include_guard(GLOBAL)
set(RESHARD_BUILD_WITH_CUDA 0)
if(RESHARD_WITH_CUDA)
  set(RESHARD_BUILD_WITH_CUDA 1)
endif()
set(RESHARD_BUILD_TYPE "${CMAKE_BUILD_TYPE}")
set(RESHARD_GENERATED_INCLUDE_DIR "${CMAKE_CURRENT_BINARY_DIR}/generated/include")
configure_file("${PROJECT_SOURCE_DIR}/include/reshard/base/build_config.h.in"
               "${RESHARD_GENERATED_INCLUDE_DIR}/reshard/base/build_config.h" @ONLY)
