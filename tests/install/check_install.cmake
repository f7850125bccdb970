# `cmake --install` of a built tree into a fresh prefix, then a C++ user's
# project (this folder) configured against it with find_package(strata),
# built and run: one training step, its result checked by the program.
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DLIBDIR=lib [-DGENERATOR=Ninja] -P check_install.cmake
foreach(var BUILD_DIR WORK_DIR LIBDIR)
  if(NOT ${var})
    message(FATAL_ERROR "check_install: -D${var}=... is required")
  endif()
endforeach()
set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "check_install: ${what} failed (${code}):\n${out}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(file include/strata/engine.h include/strata/layers/optim/optimizer.h ${LIBDIR}/cmake/strata/strataConfig.cmake
             ${LIBDIR}/cmake/strata/strataConfigVersion.cmake bin/strata)
  if(NOT EXISTS ${prefix}/${file})
    message(FATAL_ERROR "check_install: the install has no ${file}")
  endif()
endforeach()
run("strata version" ${prefix}/bin/strata version)
message(STATUS "${output}")

set(generator_args)
if(GENERATOR)
  set(generator_args -G ${GENERATOR})
endif()
run("configuring a project with find_package(strata)" ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}
    -B ${WORK_DIR}/build ${generator_args} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run("building it" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run("its training step" ${WORK_DIR}/build/train_step)
message(STATUS "${output}")
file(REMOVE_RECURSE ${WORK_DIR})
