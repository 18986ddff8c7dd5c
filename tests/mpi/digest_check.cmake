# Runs `mpi_test --digest` under mpiexec several ways and fails unless every run prints the
# same digest: twice with Open MPI's default collectives, then with each allgather algorithm
# of its tuned component forced (1 linear, 2 Bruck, 4 ring).
# cmake -DMPIEXEC=... -DFLAGS="<flags>;-n;3" -DPROGRAM=... -P digest_check.cmake
set(variants "default" "default" 1 2 4)
set(first "")
foreach(variant IN LISTS variants)
  set(mca "")
  if(NOT variant STREQUAL "default")
    set(mca --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allgather_algorithm ${variant})
  endif()
  execute_process(COMMAND ${MPIEXEC} ${mca} ${FLAGS} ${PROGRAM} --digest
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  string(REGEX MATCH "linattn-mpi-digest ranks=[0-9]+ [0-9a-f]+" line "${out}")
  if(NOT rc EQUAL 0 OR line STREQUAL "")
    message(FATAL_ERROR "allgather algorithm ${variant}: rc ${rc}\n${out}\n${err}")
  endif()
  message(STATUS "allgather algorithm ${variant}: ${line}")
  if(first STREQUAL "")
    set(first "${line}")
  elseif(NOT line STREQUAL first)
    message(FATAL_ERROR "the digest changed with allgather algorithm ${variant}: ${line} vs ${first}")
  endif()
endforeach()
