#!/usr/bin/env bash
# The GPU check in one command (shared/GPU-CHECK.md), two halves.
#
# On the development machine, from the repository root (needs the network for the wheel, and the export extras):
#   examples/gpu_check.sh prepare build/gpu-check
# downloads the pinned onnxruntime-gpu wheel in parts of at most 60 MB (build/gpu-check/wheel/*.part-*) and writes
# the packs the check runs, exported with `--attention-dtype fp16` (build/gpu-check/pack, build/gpu-check/moe-pack).
#
# On the GPU machine, from the repository root, with build/gpu-check brought along:
#   examples/gpu_check.sh run build/gpu-check [examples/gpu_check.py options]
# installs the wheel into a scratch folder (never over the machine's onnxruntime), imports pipeshard from this tree,
# and runs examples/gpu_check.py on cuda under a 350 s limit; its JSON lands in build/gpu-check/out as each stage
# finishes. First run 2026-12-04 (docs/benchmarks.md, "The first GPU run").
#
# A device call carries at most 64 MiB, the working tree included: split the wheel into parts of about 49 MiB
# (`split -n 5`), each in its own ignored folder, carry one per call into the machine's /tmp while it stays warm,
# and in the last call copy them into FOLDER/wheel as *.part-aa ... *.part-ae before `run`.
set -euo pipefail
action=${1:?usage: examples/gpu_check.sh prepare|run FOLDER [options]}
folder=${2:?usage: examples/gpu_check.sh prepare|run FOLDER [options]}
shift 2
python=${PYTHON:-python3}
version=1.31.1  # tests/ort_kernels.py's ONNXRUNTIME_GPU: the kernel table the device graphs were checked against

if [ "$action" = prepare ]; then
    mkdir -p "$folder/wheel"
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 "onnxruntime-gpu==$version" -d "$folder/wheel"
    for wheel in "$folder"/wheel/*.whl; do
        split -b 60M "$wheel" "$wheel.part-" && rm "$wheel"
    done
    for model in llama moe; do
        "$python" -m pipeshard export "tiny:$model" "$folder/export-$model" --attention-dtype fp16 --force --quiet
    done
    "$python" -m pipeshard partition "$folder/export-llama" "$folder/pack" --force
    "$python" -m pipeshard partition "$folder/export-moe" "$folder/moe-pack" --force
    exit 0
fi

scratch=$(mktemp -d)
first_part=$(ls "$folder"/wheel/*.part-aa)
wheel="$scratch/$(basename "${first_part%.part-aa}")"
cat "${first_part%aa}"* > "$wheel"
"$python" -m pip install --quiet --no-deps --target "$scratch/site" "$wheel"
# pipeshard from this tree: its package folders as pyproject.toml maps them
mkdir -p "$scratch/root/pipeshard"
for path in pipeshard/*; do ln -s "$PWD/$path" "$scratch/root/pipeshard/"; done
for part in exporter partitioner runtime profiles; do ln -s "$PWD/$part" "$scratch/root/pipeshard/$part"; done
export PYTHONPATH="$scratch/site:$scratch/root"
"$python" -c "import onnxruntime; onnxruntime.preload_dlls(); print(onnxruntime.__version__, onnxruntime.get_available_providers())"
moe=()
[ -d "$folder/moe-pack" ] && moe=(--moe-pack "$folder/moe-pack")
timeout 350 "$python" examples/gpu_check.py --pack "$folder/pack" "${moe[@]}" --device cuda \
    --out "$folder/out" "$@"
