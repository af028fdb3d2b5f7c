# CTest driver (tests/CMakeLists.txt: install_consumer): installs the reshard build tree
# BUILD_DIR into a fresh prefix under WORK_DIR (components dev + runtime, as `cmake --install`
# does), configures and builds tests/consumer against that prefix alone, and runs it.
#   cmake -DBUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... -DGENERATOR=... -P run_test.cmake
foreach(v BUILD_DIR CONSUMER_DIR WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_test.cmake: -D${v}=... is required")
  endif()
endforeach()
set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "$ ${ARGN}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (exit ${rc}): ${ARGN}")
  endif()
endfunction()

foreach(component dev runtime)
  run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --component ${component})
endforeach()
foreach(f include/reshard/base/version.h include/reshard/base/build_config.h bin/reshard)
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "not installed: ${prefix}/${f}")
  endif()
endforeach()
# Internal headers stay in the source tree: only the public API is installed.
foreach(f include/reshard/format/torch_pickle.h include/reshard/format/zip_reader.h
          include/reshard/io/checkpoint.h include/reshard/plan/rank_plan.h)
  if(EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "installed, but not public: ${prefix}/${f}")
  endif()
endforeach()
file(GLOB_RECURSE configs "${prefix}/*/reshardConfig.cmake")
if(NOT configs)
  message(FATAL_ERROR "reshardConfig.cmake not installed under ${prefix}")
endif()
foreach(layer base format io plan ops runtime)
  file(GLOB_RECURSE libs "${prefix}/*/libreshard_${layer}.a")
  if(NOT libs)
    message(FATAL_ERROR "libreshard_${layer}.a not installed under ${prefix}")
  endif()
endforeach()
run("${prefix}/bin/reshard" --version)

set(gen)
if(GENERATOR)
  set(gen -G "${GENERATOR}")
endif()
# CMAKE_FIND_USE_PACKAGE_REGISTRY etc. off: only the prefix may provide reshard.
run("${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/build" ${gen}
    "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
    -DCMAKE_BUILD_TYPE=Release)
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/reshard_consumer" "${WORK_DIR}/run")
