# linattn::mpi: sequence-parallel prefill over MPI (include/linattn/mpi.hpp and the
# include/linattn/detail/mpi_*.hpp it uses). Optional and separate: found with CMake's FindMPI;
# the core target linattn::linattn never sees MPI. Without MPI (or with LINATTN_MPI=OFF) the
# target, its tests, benchmark and example are skipped with a message, not an error.
# Included by one line of the top-level CMakeLists.txt, after the core targets.

option(LINATTN_MPI "Build linattn::mpi, its tests, benchmark and example (needs MPI)"
       ${PROJECT_IS_TOP_LEVEL})
if(NOT LINATTN_MPI)
  return()
endif()
find_package(MPI COMPONENTS CXX QUIET)
if(NOT MPI_CXX_FOUND)
  message(STATUS "linattn: MPI not found; linattn::mpi and its tests, benchmark and example "
                 "are skipped (Debian: apt-get install openmpi-bin libopenmpi-dev)")
  return()
endif()
message(STATUS "linattn: MPI ${MPI_CXX_VERSION} found (${MPIEXEC_EXECUTABLE}); building linattn::mpi")

add_library(linattn_mpi INTERFACE)
add_library(linattn::mpi ALIAS linattn_mpi)
set_target_properties(linattn_mpi PROPERTIES EXPORT_NAME mpi)
target_link_libraries(linattn_mpi INTERFACE linattn MPI::MPI_CXX)
file(GLOB LINATTN_MPI_HEADERS CONFIGURE_DEPENDS
     "${PROJECT_SOURCE_DIR}/include/linattn/mpi.hpp"
     "${PROJECT_SOURCE_DIR}/include/linattn/mpi_*.hpp"
     "${PROJECT_SOURCE_DIR}/include/linattn/detail/mpi_*.hpp")
target_sources(linattn_mpi INTERFACE
  FILE_SET HEADERS BASE_DIRS "${PROJECT_SOURCE_DIR}/include" FILES ${LINATTN_MPI_HEADERS})

# How ctest starts N processes here: mpiexec from FindMPI; Open MPI also needs
# --oversubscribe for more ranks than cores and, as root (containers, CI), --allow-run-as-root;
# under the sanitizers, -x passes the sanitizer options on to the ranks.
set(LINATTN_MPIEXEC_FLAGS ${MPIEXEC_PREFLAGS})
execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version OUTPUT_VARIABLE _linattn_mpiexec_version
                ERROR_QUIET)
if(_linattn_mpiexec_version MATCHES "Open MPI|OpenRTE")
  list(APPEND LINATTN_MPIEXEC_FLAGS --oversubscribe)
  execute_process(COMMAND id -u OUTPUT_VARIABLE _linattn_uid OUTPUT_STRIP_TRAILING_WHITESPACE
                  ERROR_QUIET)
  if(_linattn_uid STREQUAL "0")
    list(APPEND LINATTN_MPIEXEC_FLAGS --allow-run-as-root)
  endif()
  if(LINATTN_SANITIZE)
    list(APPEND LINATTN_MPIEXEC_FLAGS -x LSAN_OPTIONS -x ASAN_OPTIONS)
  endif()
endif()

if(LINATTN_BUILD_TESTS)
  set_target_properties(linattn_mpi PROPERTIES VERIFY_INTERFACE_HEADER_SETS ON)
  add_subdirectory(tests/mpi)
endif()
if(LINATTN_BUILD_EXAMPLES)
  add_executable(example_distributed_prefill examples/mpi/distributed_prefill.cpp)
  target_link_libraries(example_distributed_prefill PRIVATE linattn::mpi linattn_dev_flags)
  if(LINATTN_BUILD_TESTS)
    add_test(NAME example.distributed_prefill
             COMMAND ${MPIEXEC_EXECUTABLE} ${LINATTN_MPIEXEC_FLAGS} ${MPIEXEC_NUMPROC_FLAG} 2
                     $<TARGET_FILE:example_distributed_prefill> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(example.distributed_prefill PROPERTIES TIMEOUT 120)
  endif()
endif()
if(LINATTN_BUILD_BENCH)
  add_executable(bench_mpi bench/mpi/bench_mpi.cpp)
  target_compile_options(bench_mpi PRIVATE -O3)
  target_compile_definitions(bench_mpi PRIVATE NDEBUG)
  target_link_libraries(bench_mpi PRIVATE linattn::mpi linattn_dev_flags)
endif()
