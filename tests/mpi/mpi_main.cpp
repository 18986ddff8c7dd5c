// The main of mpi_tests, the MPI test program: MPI_Init, then the Catch2 session (or the
// --digest mode), one verdict for every rank, MPI_Finalize. Catch's implementation is
// tests/catch_session.cpp's.

#include "catch_session.hpp"
#include "mpi_main.hpp"

#include <mpi.h>

#include <string>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  if (argc > 1 && std::string(argv[1]) == "--digest")
    rc = linattn_test::print_digest();
  else
    rc = linattn_test::run_catch_session(argc, argv);
  int worst = 0;  // one verdict for the job: fail on every rank when any rank failed
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
