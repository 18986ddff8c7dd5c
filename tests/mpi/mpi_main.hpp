#pragma once
// What mpi_main.cpp's main() calls besides the Catch2 session.

namespace linattn_test {

// `mpi_tests --digest`: prints one hash of a fixed workload's outputs and states on rank 0
// (mpi_test.cpp; digest_check.cmake compares it between runs); returns the exit status.
int print_digest();

}  // namespace linattn_test
