#pragma once
// The test programs' entry to Catch2 (catch_session.cpp holds Catch's implementation, which
// declares Catch::Session only where it is compiled).

namespace linattn_test {

// Runs every test case the command line selects; returns the exit status.
int run_catch_session(int argc, char** argv);

}  // namespace linattn_test
