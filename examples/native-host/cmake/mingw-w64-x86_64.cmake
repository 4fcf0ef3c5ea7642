# Windows x64 from Linux: Debian's mingw-w64 cross compilers (its posix flavour: std::thread needs it), the C++ and
# GCC runtimes linked in statically (the DLL and programs need no mingw DLL beside them), tests run under Wine.
#   cmake -S examples/native-host -B build/native-host/build-windows \
#         -DCMAKE_TOOLCHAIN_FILE=examples/native-host/cmake/mingw-w64-x86_64.cmake
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_PROCESSOR x86_64)
set(CMAKE_C_COMPILER x86_64-w64-mingw32-gcc-posix)
set(CMAKE_CXX_COMPILER x86_64-w64-mingw32-g++-posix)
set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(static_runtime "-static-libgcc -static-libstdc++ -Wl,-Bstatic,--whole-archive -lwinpthread -Wl,--no-whole-archive,-Bdynamic")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${static_runtime}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "${static_runtime}")
find_program(PIPESHARD_WINE64 NAMES wine64 PATHS /usr/lib/wine NO_CMAKE_FIND_ROOT_PATH)
if(PIPESHARD_WINE64)
  set(CMAKE_CROSSCOMPILING_EMULATOR "${PIPESHARD_WINE64}")
endif()
