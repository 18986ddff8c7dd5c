# The optional PyTorch component: linattn::torch (include/linattn/torch.hpp on libtorch) and
# the Python extension linattn.torch._ext with its package, its pytest suite registered with
# ctest. Included by one line of the top-level CMakeLists.txt; skipped when Torch is not found
# and in sanitizer builds (an ASan-instrumented extension would need ASan preloaded into the
# python interpreter, which Debian's python3 and torch are not built for).
if(LINATTN_SANITIZE)
  message(STATUS "linattn: sanitizer build, the PyTorch component is skipped")
  return()
endif()
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  # clang 14 with libstdc++ 12 rejects Torch 1.13's headers in C++20 (std::vector<c10::IValue>
  # instantiated while IValue is incomplete); the component is built with g++.
  message(STATUS "linattn: the PyTorch component is built with g++ only; skipped under clang")
  return()
endif()
find_package(Torch CONFIG QUIET)
if(NOT Torch_FOUND)
  message(STATUS "linattn: Torch not found (Debian: libtorch-dev), the PyTorch component is skipped")
  return()
endif()
message(STATUS "linattn: PyTorch component on Torch ${Torch_VERSION}")

add_library(linattn_torch INTERFACE)
add_library(linattn::torch ALIAS linattn_torch)
set_target_properties(linattn_torch PROPERTIES EXPORT_NAME torch)
target_link_libraries(linattn_torch INTERFACE linattn "${TORCH_LIBRARIES}")
target_include_directories(linattn_torch SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})

# The interpreter that imports this Torch: the one installed beside it (Debian: /usr/bin/python3
# with python3-torch), not whichever python3 comes first on PATH.
if(NOT DEFINED Python3_EXECUTABLE AND EXISTS "${TORCH_INSTALL_PREFIX}/bin/python3")
  set(Python3_EXECUTABLE "${TORCH_INSTALL_PREFIX}/bin/python3")
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module)
find_package(pybind11 CONFIG QUIET)
get_filename_component(LINATTN_TORCH_LIBDIR "${TORCH_LIBRARY}" DIRECTORY)
find_library(LINATTN_TORCH_PYTHON_LIBRARY torch_python HINTS "${LINATTN_TORCH_LIBDIR}")
if(NOT Python3_FOUND OR NOT pybind11_FOUND OR NOT LINATTN_TORCH_PYTHON_LIBRARY)
  message(STATUS "linattn: python3-dev, pybind11-dev or libtorch_python missing; no Python extension")
  return()
endif()

# The package is assembled in the build tree: python/linattn/**.py copied beside the extension.
set(LINATTN_PYTHON_DIR "${PROJECT_BINARY_DIR}/python")
file(GLOB_RECURSE LINATTN_PY_SOURCES CONFIGURE_DEPENDS RELATIVE "${PROJECT_SOURCE_DIR}/python"
     "${PROJECT_SOURCE_DIR}/python/linattn/*.py")
foreach(py IN LISTS LINATTN_PY_SOURCES)
  configure_file("${PROJECT_SOURCE_DIR}/python/${py}" "${LINATTN_PYTHON_DIR}/${py}" COPYONLY)
endforeach()

Python3_add_library(linattn_torch_ext MODULE WITH_SOABI python/src/linattn_torch.cpp)
target_link_libraries(linattn_torch_ext PRIVATE linattn::torch pybind11::headers
                      "${LINATTN_TORCH_PYTHON_LIBRARY}" linattn_dev_flags)
target_compile_definitions(linattn_torch_ext PRIVATE TORCH_EXTENSION_NAME=_ext
                           TORCH_API_INCLUDE_EXTENSION_H)
set_target_properties(linattn_torch_ext PROPERTIES OUTPUT_NAME _ext
  LIBRARY_OUTPUT_DIRECTORY "${LINATTN_PYTHON_DIR}/linattn/torch" CXX_VISIBILITY_PRESET hidden)

if(LINATTN_BUILD_TESTS)
  add_test(NAME torch.pytest
    COMMAND "${Python3_EXECUTABLE}" -m pytest -q -p no:cacheprovider "${PROJECT_SOURCE_DIR}/tests/torch")
  # The PyTorch example runs too (prefill, then decode with the carried states; it checks itself).
  add_test(NAME example.torch_tiny_lm
    COMMAND "${Python3_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/examples/torch/tiny_lm.py")
  set_tests_properties(torch.pytest example.torch_tiny_lm PROPERTIES
    ENVIRONMENT "PYTHONPATH=${LINATTN_PYTHON_DIR};OMP_NUM_THREADS=2" TIMEOUT 300)
  # The longest test: started first by ctest -j, so that it does not run alone at the end.
  set_tests_properties(torch.pytest PROPERTIES COST 200)
endif()
