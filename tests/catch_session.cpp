// Catch2's implementation, compiled once for every test program: the ordinary ones take their
// main from catch_main.cpp, the MPI program from tests/mpi/mpi_main.cpp.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_session.hpp"

int linattn_test::run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }
