#!/bin/sh
# The host's two dependencies, from the npm registry (the Unity plugins a game already ships), pinned and checked:
#   com.github.asus4.onnxruntime 0.4.9            ONNX Runtime 1.29: C headers, Plugins/Linux/x64/libonnxruntime.so
#   com.github.asus4.onnxruntime-extensions 0.4.9 libortextensions.so (HfJsonTokenizer, BpeDecoder; no libpython)
# Usage: fetch_deps.sh DEPS_DIR. Downloads once (npm pack), verifies the tarballs' sha256, unpacks what the build
# needs into DEPS_DIR/onnxruntime and DEPS_DIR/extensions, and the Windows x64 DLLs of the same packages into
# DEPS_DIR/windows-x64 (the mingw-w64 build's). No other download.
set -eu
DEPS=$1
ORT_PACKAGE=com.github.asus4.onnxruntime-0.4.9.tgz
ORT_SHA256=e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d
EXT_PACKAGE=com.github.asus4.onnxruntime-extensions-0.4.9.tgz
EXT_SHA256=013055b4988fd3b96422c5e916bfc318b1c9eebd8f94600d4018860da1a08b1b
HEADERS="package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers"
WINDOWS=package/Plugins/Windows/x64
if [ -f "$DEPS/.complete" ] && [ -f "$DEPS/windows-x64/.complete" ]; then exit 0; fi
mkdir -p "$DEPS/npm"
cd "$DEPS/npm"
[ -f "$ORT_PACKAGE" ] || npm pack --silent com.github.asus4.onnxruntime@0.4.9 >/dev/null
[ -f "$EXT_PACKAGE" ] || npm pack --silent com.github.asus4.onnxruntime-extensions@0.4.9 >/dev/null
printf '%s  %s\n%s  %s\n' "$ORT_SHA256" "$ORT_PACKAGE" "$EXT_SHA256" "$EXT_PACKAGE" | sha256sum -c --quiet -
cd ..
if [ ! -f windows-x64/.complete ]; then
  rm -rf windows-x64 unpack && mkdir -p windows-x64 unpack
  tar -xzf "npm/$ORT_PACKAGE" -C unpack "$WINDOWS/onnxruntime.dll" "$WINDOWS/onnxruntime_providers_shared.dll"
  tar -xzf "npm/$EXT_PACKAGE" -C unpack "$WINDOWS/ortextensions.dll"
  mv unpack/$WINDOWS/*.dll windows-x64/
  rm -rf unpack
  touch windows-x64/.complete
fi
if [ -f .complete ]; then exit 0; fi
rm -rf onnxruntime extensions unpack
mkdir -p onnxruntime/include onnxruntime/lib extensions/lib unpack
tar -xzf "npm/$ORT_PACKAGE" -C unpack "$HEADERS" package/Plugins/Linux/x64/libonnxruntime.so package/LICENSE
mv unpack/$HEADERS/*.h onnxruntime/include/
mv unpack/package/Plugins/Linux/x64/libonnxruntime.so onnxruntime/lib/
mv unpack/package/LICENSE onnxruntime/LICENSE
rm -rf unpack && mkdir unpack
tar -xzf "npm/$EXT_PACKAGE" -C unpack package/Plugins/Linux/x64/libortextensions.so package/LICENSE
mv unpack/package/Plugins/Linux/x64/libortextensions.so extensions/lib/
mv unpack/package/LICENSE extensions/LICENSE
rm -rf unpack
touch .complete
