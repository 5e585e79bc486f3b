# Runs one fuzzer for a bounded time (the CTests of label fuzz):
#   cmake -DFUZZER=<exe> -DSEEDS=<seed dir> -DWORK=<scratch dir> -DSECONDS=<n> -P run_fuzzer.cmake
# The fuzzer works on a copy of the seeds in WORK/corpus (it adds the inputs it finds
# interesting there, and the checked-in seeds stay as they are); an input that crashes,
# leaks, times out or breaks a property is written to WORK/artifacts/ and fails the test.
foreach(var FUZZER SEEDS WORK SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_fuzzer.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}/corpus")
file(MAKE_DIRECTORY "${WORK}/corpus" "${WORK}/artifacts")
file(GLOB seeds "${SEEDS}/*")
if(seeds)
  file(COPY ${seeds} DESTINATION "${WORK}/corpus")
endif()
execute_process(
  COMMAND "${FUZZER}" -max_total_time=${SECONDS} -timeout=5 -rss_limit_mb=2048
          -artifact_prefix=${WORK}/artifacts/ -print_final_stats=1 "${WORK}/corpus"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${FUZZER} failed (${rc}); the failing input is in ${WORK}/artifacts/ "
                      "(replay it with: ${FUZZER} <file>)")
endif()
