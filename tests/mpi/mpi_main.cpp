// The main of mpi_tests, the MPI test program: MPI_Init, then the Catch2 session (or the
// --digest mode), one verdict for every rank, MPI_Finalize. Its own translation unit: Catch's
// implementation (CATCH_CONFIG_RUNNER) compiles here, outside the test files' precompiled header.

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "mpi_main.hpp"

#include <mpi.h>

#include <string>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  if (argc > 1 && std::string(argv[1]) == "--digest")
    rc = linattn_test::print_digest();
  else
    rc = Catch::Session().run(argc, argv);
  int worst = 0;  // one verdict for the job: fail on every rank when any rank failed
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
