# What `cmake --install` puts where. Two cases:
# - a pip build (scikit-build-core sets SKBUILD; pyproject.toml): the module
#   strata._strata beside the package's .py files, and the `strata` command
#   in the environment's scripts folder (bin/);
# - otherwise, the C++ package under the prefix: the `strata` command in bin/,
#   the public headers in include/strata/, the headers of the layers the C++
#   API names by path (optim/optimizer.h, offload/training/train_step.h, ...)
#   in include/strata/layers/, the static libraries, and lib/cmake/strata/
#   for find_package(strata): the target strata::strata links every layer.

# The installed programs find the shared libraries they were linked with
# outside the system's paths (CUDA's runtime under /usr/local/cuda).
set_target_properties(strata PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
# NCCL from PyPI's wheel (CMakeLists.txt) is on no system path: the programs
# find it where they were linked with it, and the module installed by pip
# also in the nvidia-nccl-cu13 package beside it in site-packages.
if(STRATA_NCCL_LIBRARY_DIR)
  set_property(TARGET strata APPEND PROPERTY INSTALL_RPATH "${STRATA_NCCL_LIBRARY_DIR}")
  if(TARGET _strata)
    set_property(TARGET _strata APPEND PROPERTY INSTALL_RPATH "$ORIGIN/../nvidia/nccl/lib" "${STRATA_NCCL_LIBRARY_DIR}")
  endif()
endif()

if(SKBUILD)
  if(NOT STRATA_HAVE_PYTHON)
    message(FATAL_ERROR "strata: the pip build needs the Python module, and Python ${Python3_EXECUTABLE} "
                        "or pybind11 (pybind11_DIR '${pybind11_DIR}') was not found")
  endif()
  set_target_properties(_strata PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS _strata LIBRARY DESTINATION strata)
  install(TARGETS strata RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR})
  return()
endif()

install(TARGETS strata RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/strata DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The headers the C++ API includes by their path from the repository root
# (docs/api.md) and those they include. tests/install builds a program
# including them against an installed tree, so a header added to this closure
# and missing here fails there.
set(strata_layer_headers
  optim/optimizer.h optim/loss_scaler.h
  memory/chunk_layout.h memory/extent_allocator.h memory/tier_pool.h src/base/alignment.h
  offload/schedule/pipeline.h offload/schedule/planner.h
  offload/training/train_step.h offload/training/overlap_updates.h offload/training/group_update.h
  offload/training/grad_reducer.h offload/training/state_stream.h)
foreach(header ${strata_layer_headers})
  get_filename_component(folder ${header} DIRECTORY)
  install(FILES ${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/layers/${folder})
endforeach()

set(strata_libraries strata_base strata_config strata_device strata_storage strata_comm strata_optim strata_memory
    strata_schedule strata_training strata_persist strata_workloads strata_core)
set_target_properties(strata_core PROPERTIES EXPORT_NAME strata)
set(strata_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(TARGETS ${strata_libraries} EXPORT strataTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${strata_cmake_dir})

include(CMakePackageConfigHelpers)
configure_package_config_file(cmake/strataConfig.cmake.in ${CMAKE_BINARY_DIR}/strataConfig.cmake
                              INSTALL_DESTINATION ${strata_cmake_dir})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/strataConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/strataConfig.cmake ${CMAKE_BINARY_DIR}/strataConfigVersion.cmake
        DESTINATION ${strata_cmake_dir})
