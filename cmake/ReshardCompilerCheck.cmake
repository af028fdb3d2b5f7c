# Refuses, with a message that says what to install, a compiler without the C++20 that reshard
# is written in (std::span, string_view::starts_with, designated initializers, concepts).
include_guard(GLOBAL)
include(CheckCXXSourceCompiles)

set(_reshard_cxx_hint
  "reshard needs a C++20 compiler: GCC >= 11 or Clang >= 14 (with libstdc++ >= 11 or libc++ >= 14). "
  "On Debian/Ubuntu: apt-get install g++ (Debian 12 / Ubuntu 22.04 or newer ship GCC 12 / 11), "
  "then point CMake at it: CXX=g++-12 pip install --no-build-isolation . "
  "(or cmake -DCMAKE_CXX_COMPILER=g++-12).")

if(NOT "cxx_std_20" IN_LIST CMAKE_CXX_COMPILE_FEATURES)
  message(FATAL_ERROR
    "reshard: the C++ compiler ${CMAKE_CXX_COMPILER} (${CMAKE_CXX_COMPILER_ID} "
    "${CMAKE_CXX_COMPILER_VERSION}) has no C++20 mode.\n${_reshard_cxx_hint}")
endif()

set(_reshard_saved_quiet ${CMAKE_REQUIRED_QUIET})
set(CMAKE_REQUIRED_QUIET ON)
check_cxx_source_compiles([=[
#include <concepts>
#include <span>
#include <string_view>
struct Opts { int a = 0; int b = 0; };
template <std::integral T> constexpr T Twice(T v) { return 2 * v; }
int main() {
  constexpr Opts o{.a = 1, .b = 2};
  int data[3] = {1, 2, 3};
  std::span<const int> s(data);
  constexpr std::string_view n = "rank-00000";
  static_assert(n.starts_with("rank-") && Twice(o.b) == 4);
  return static_cast<int>(s.size()) - 3;
}
]=] RESHARD_COMPILER_HAS_CXX20)
set(CMAKE_REQUIRED_QUIET ${_reshard_saved_quiet})
if(NOT RESHARD_COMPILER_HAS_CXX20)
  unset(RESHARD_COMPILER_HAS_CXX20 CACHE)  # try again on the next configure (new compiler)
  message(FATAL_ERROR
    "reshard: the C++ compiler ${CMAKE_CXX_COMPILER} (${CMAKE_CXX_COMPILER_ID} "
    "${CMAKE_CXX_COMPILER_VERSION}) failed to compile a small C++20 program "
    "(std::span, concepts, designated initializers, string_view::starts_with) with "
    "-std=c++20.\n${_reshard_cxx_hint}")
endif()
