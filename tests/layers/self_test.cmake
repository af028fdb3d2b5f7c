# CTest layer_includes_self_test: proves that reshard_layer_check fails, naming file:line, on
# includes against the direction of the layers, and passes the allowed ones. Writes a small
# tree under WORK_DIR and runs the checker CHECK on it.
#   cmake -DCHECK=<reshard_layer_check> -DWORK_DIR=<dir> -P self_test.cmake
foreach(v CHECK WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "self_test.cmake: -D${v}=... is required")
  endif()
endforeach()
set(root "${WORK_DIR}/tree")
file(REMOVE_RECURSE "${root}")
function(put path)
  string(JOIN "\n" text ${ARGN})
  file(WRITE "${root}/${path}" "${text}\n")
endfunction()

# Allowed: a layer includes itself and those to its left; ops uses io and plan; cuda the copier
# interface; the binding anything; internal headers from sources.
put(include/reshard/base/a.h "#pragma once")
put(include/reshard/format/b.h "#pragma once" "#include \"reshard/base/a.h\"")
put(include/reshard/io/c.h "#pragma once" "#include \"reshard/format/b.h\"")
put(include/reshard/plan/d.h "#pragma once" "#include \"reshard/format/b.h\"")
put(include/reshard/runtime/device_copier.h "#pragma once")
put(src/format/internal.h "#pragma once")
put(src/ops/e.cc "#include \"reshard/io/c.h\"" "#include \"reshard/plan/d.h\""
                 "#include \"format/internal.h\"" "#include <vector>")
put(src/cuda/f.cc "#include \"reshard/runtime/device_copier.h\"" "#include \"reshard/base/a.h\"")
put(src/python/g.cc "#include \"reshard/cuda/h.h\"" "#include \"reshard/runtime/device_copier.h\"")
execute_process(COMMAND "${CHECK}" "${root}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "allowed includes refused (exit ${rc}):\n${out}")
endif()

# Refused, each at its line.
put(src/format/bad.cc "// a parser" "#include \"reshard/io/c.h\"")
put(include/reshard/plan/bad.h "#pragma once" "// a plan" "#include \"reshard/io/c.h\"")
put(include/reshard/base/bad.h "#pragma once" "#include \"format/internal.h\"")
put(src/cuda/bad.cc "#include \"reshard/io/c.h\"")
put(tools/reshard/bad.cc "#include \"reshard/cuda/h.h\"")
put(include/reshard/flat.h "#pragma once")
put(src/core/old.cc "#include \"reshard/flat.h\"")
execute_process(COMMAND "${CHECK}" "${root}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
message(STATUS "reshard_layer_check on the bad tree (exit ${rc}):\n${out}")
if(rc EQUAL 0)
  message(FATAL_ERROR "includes against the direction were accepted")
endif()
foreach(expected
    "src/format/bad.cc:2: format includes reshard/io/c.h: format may not include io"
    "include/reshard/plan/bad.h:3: plan includes reshard/io/c.h: plan and io are siblings"
    "include/reshard/base/bad.h:2: base includes format/internal.h: a public header includes an internal header"
    "src/cuda/bad.cc:1: cuda includes reshard/io/c.h: cuda may include base and"
    "tools/reshard/bad.cc:1: cli includes reshard/cuda/h.h: the CLI links the core alone"
    "include/reshard/flat.h: a public header outside the layer directories"
    "src/core/old.cc: a source outside the layer directories")
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the checker did not report: ${expected}")
  endif()
endforeach()
