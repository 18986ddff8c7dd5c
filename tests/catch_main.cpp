// The main of every test program but the MPI one (tests/mpi/mpi_main.cpp): the Catch2 session.
#include "catch_session.hpp"

int main(int argc, char** argv) { return linattn_test::run_catch_session(argc, argv); }
