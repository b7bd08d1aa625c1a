# tests/compile_fail/check_compile.cmake — compiles one file with -fsyntax-only and checks the
# outcome; run by the `compile.*` tests of tests/CMakeLists.txt as
#
#   cmake -DCOMPILER=<c++> -DSOURCE=<file.cpp> -DINCLUDES=<dir|dir|...> [-DDEFINES=<A|B|...>]
#         -DEXPECT=success|failure [-DMESSAGE=<regex>] -P check_compile.cmake
#
# EXPECT=success: the file must compile. EXPECT=failure: the compiler must reject it, with
# MESSAGE in its output, and that as its only error (a readable static_assert, not a cascade).
# One script rather than WILL_FAIL + PASS_REGULAR_EXPRESSION: CTest inverts the regular
# expression's verdict under WILL_FAIL, so the pair cannot say "fails, and for this reason".
foreach(required COMPILER SOURCE INCLUDES EXPECT)
  if(NOT DEFINED ${required})
    message(FATAL_ERROR "check_compile.cmake: -D${required}=... is required")
  endif()
endforeach()

set(arguments -std=c++17 -fsyntax-only)
string(REPLACE "|" ";" include_list "${INCLUDES}")
foreach(directory IN LISTS include_list)
  list(APPEND arguments "-I${directory}")
endforeach()
if(DEFINED DEFINES AND NOT DEFINES STREQUAL "")
  string(REPLACE "|" ";" define_list "${DEFINES}")
  foreach(definition IN LISTS define_list)
    list(APPEND arguments "-D${definition}")
  endforeach()
endif()

execute_process(COMMAND ${COMPILER} ${arguments} ${SOURCE}
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
string(REPLACE ";" " " shown "${COMPILER} ${arguments} ${SOURCE}")

if(EXPECT STREQUAL "success")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "expected to compile, but the compiler failed (${result}):\n${shown}\n${output}")
  endif()
  message(STATUS "compiled, as expected: ${shown}")
elseif(EXPECT STREQUAL "failure")
  if(result EQUAL 0)
    message(FATAL_ERROR "expected the compiler to reject this, but it compiled:\n${shown}")
  endif()
  if(DEFINED MESSAGE AND NOT output MATCHES "${MESSAGE}")
    message(FATAL_ERROR "rejected, but without \"${MESSAGE}\":\n${shown}\n${output}")
  endif()
  string(REGEX MATCHALL "error:" errors "${output}")
  list(LENGTH errors error_count)
  if(NOT error_count EQUAL 1)
    message(FATAL_ERROR "rejected with ${error_count} errors; expected the static_assert alone:\n${shown}\n${output}")
  endif()
  message(STATUS "rejected, as expected, with: ${MESSAGE}")
else()
  message(FATAL_ERROR "check_compile.cmake: EXPECT=${EXPECT}; expected success or failure")
endif()
