# The Debian packages, built by CPack from the install components
# (`cmake --build build --target package`, into build/packages; docs/packaging.md):
#   liblockstep1      component lib     the shared library
#   liblockstep-dev   component dev     header, CMake package config, lockstep.pc
#   lockstep-master   component master  the master and its systemd unit
#   python3-lockstep  component python  the Python package for Debian's python3
#   python3-lockstep-torch  component torch  lockstep.torch, the torch.distributed backend
#                     (where libtorch-dev was found: it depends on libtorch)
# Debian's layout needs the build configured with -DCMAKE_INSTALL_PREFIX=/usr (the
# library in lib/<multiarch>, the Python package in lib/python3/dist-packages): with any
# other prefix the package target stops with a message saying so.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME lockstep)
set(CPACK_PACKAGE_VENDOR lockstep)
set(LOCKSTEP_PACKAGE_CONTACT "lockstep maintainers <maintainers@lockstep.invalid>" CACHE STRING
    "The Maintainer field of the Debian packages")
set(CPACK_PACKAGE_CONTACT "${LOCKSTEP_PACKAGE_CONTACT}")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DIRECTORY ${CMAKE_BINARY_DIR}/packages)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL lib dev master python)
if(NOT LOCKSTEP_BUILD_TOOLS)
  list(REMOVE_ITEM CPACK_COMPONENTS_ALL master)
endif()
if(NOT LOCKSTEP_BUILD_PYTHON)
  list(REMOVE_ITEM CPACK_COMPONENTS_ALL python)
endif()
if(LOCKSTEP_TORCH_BUILT)
  list(APPEND CPACK_COMPONENTS_ALL torch)
endif()

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Depends from the ELF files (dpkg-shlibdeps), and between our packages from the
# components' DEPENDS below, as exact versions.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
# The Python module needs liblockstep.so.1, which no installed package owns yet: the
# build's copy lets dpkg-shlibdeps read it (the Depends on liblockstep1 comes from the
# python component's DEPENDS).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CMAKE_BINARY_DIR}/lib)

# The library package is named after the soname (Debian policy 8.1).
get_target_property(_lockstep_soversion lockstep SOVERSION)
set(CPACK_DEBIAN_LIB_PACKAGE_NAME liblockstep${_lockstep_soversion})
set(CPACK_DEBIAN_LIB_PACKAGE_SECTION libs)
# A shlibs file for every library with a soname (liblockstep.so.1 only), so that packages
# linking it get a Depends on liblockstep1; CPack adds the ldconfig calls (postinst,
# postrm) for a library in /usr/lib.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_LIB_DESCRIPTION "fault-tolerant collective communication: the shared library
liblockstep: peers of a training run join and leave at any moment, every membership
change and collective outcome is decided by the master through micro-consensus, and a
dead or silent peer is an ordinary, bounded error. Ring all-reduce over TCP, shared
state kept bit-identical across peers, topology optimization.")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME liblockstep-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libc6-dev | libc-dev")
set(CPACK_DEBIAN_DEV_DESCRIPTION "fault-tolerant collective communication: development files
The C99 header lockstep/lockstep.h, the CMake package config (find_package(lockstep),
target lockstep::lockstep) and the pkg-config file (pkg-config --cflags --libs
lockstep) of liblockstep.")

set(CPACK_DEBIAN_MASTER_PACKAGE_NAME lockstep-master)
set(CPACK_DEBIAN_MASTER_PACKAGE_SECTION net)
set(CPACK_DEBIAN_MASTER_DESCRIPTION "fault-tolerant collective communication: the master
lockstep-master, the process every peer of a lockstep run connects to: the authority on
membership, ring order and the outcome of every operation. With a systemd unit,
lockstep-master.service, not enabled on install.")

set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-lockstep)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
if(LOCKSTEP_BUILD_PYTHON)
  # The module is built for this python3 (its ABI tag), as Debian's python3-* are.
  set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
      "python3 (>= ${LOCKSTEP_PYTHON_VERSION}~), python3 (<< ${LOCKSTEP_PYTHON_NEXT_VERSION})")
endif()
set(CPACK_DEBIAN_PYTHON_PACKAGE_RECOMMENDS "python3-numpy")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SUGGESTS "python3-torch")
set(CPACK_DEBIAN_PYTHON_DESCRIPTION "fault-tolerant collective communication: Python 3 package
The Python package lockstep over liblockstep: NumPy arrays and CPU PyTorch tensors
used in place, exceptions per status code, every blocking call releasing the GIL.")
set(CPACK_DEBIAN_TORCH_PACKAGE_NAME python3-lockstep-torch)
set(CPACK_DEBIAN_TORCH_PACKAGE_SECTION python)
set(CPACK_DEBIAN_TORCH_PACKAGE_DEPENDS "python3-torch")
set(CPACK_DEBIAN_TORCH_DESCRIPTION "fault-tolerant collective communication: PyTorch backend
lockstep.torch: the torch.distributed backend \"lockstep\" (dist.init_process_group(
\"lockstep\", ...)) over liblockstep, for fixed-size jobs and elastic ones.")

# Python writes __pycache__ into the package's directory when run as root: removed
# with the package (what py3clean does for packages built by dh_python3).
configure_file(${CMAKE_CURRENT_LIST_DIR}/python3-lockstep.prerm.in
  ${CMAKE_BINARY_DIR}/packaging/python/prerm @ONLY)
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_EXTRA ${CMAKE_BINARY_DIR}/packaging/python/prerm)
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_STRICT_PERMISSION ON)

# The packages' layout is right only for a build configured with prefix /usr.
set(CPACK_PROJECT_CONFIG_FILE ${CMAKE_BINARY_DIR}/packaging/cpack-project-config.cmake)
file(WRITE ${CPACK_PROJECT_CONFIG_FILE}
  "if(NOT \"${CMAKE_INSTALL_PREFIX}\" STREQUAL \"/usr\")\n"
  "  message(FATAL_ERROR \"The Debian packages need the Debian layout: configure the build with "
  "-DCMAKE_INSTALL_PREFIX=/usr (it is ${CMAKE_INSTALL_PREFIX}); docs/packaging.md\")\n"
  "endif()\n"
  "# The Python module has no soname, which CPack's shlibs generation reports as an author warning.\n"
  "set(CMAKE_SUPPRESS_DEVELOPER_WARNINGS ON)\n")

include(CPack)
cpack_add_component(lib DISPLAY_NAME "shared library")
cpack_add_component(dev DISPLAY_NAME "development files" DEPENDS lib)
cpack_add_component(master DISPLAY_NAME "master")
cpack_add_component(python DISPLAY_NAME "Python package" DEPENDS lib)
cpack_add_component(torch DISPLAY_NAME "PyTorch backend" DEPENDS python)
