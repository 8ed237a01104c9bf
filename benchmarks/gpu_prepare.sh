#!/usr/bin/env bash
# Prepares what benchmarks/gpu.sh needs on a lent GPU machine that has torch and transformers but
# no network: run it here (with network to PyPI and the package installed), then carry .whl and
# .gpucache to the GPU machine (both are git-ignored through .git/info/exclude).
#   .whl/       python 3.12 manylinux wheels of the dependencies the GPU image lacks
#   .gpucache/  SmolLM2's tokenizer and config (no weights): RLHF_TORCHRL_CACHE for gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpucache/' .git/info/exclude 2>/dev/null || echo /.gpucache/ >> .git/info/exclude
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl torchrl==0.14.1 "tensordict>=0.14.3,<0.15" hydra-core==1.3.2 \
    omegaconf==2.3.0 orjson pyvers==0.2.3 "hoptorch>=0.1.4" importlib_metadata "lazy-importer>=0.1" \
    gensim smart_open vaderSentiment
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3  # an sdist on PyPI
# SmolLM2's tokenizer (the tests' and the benchmark's), without its 540 MB of weights
src=$(python3 -c "from rlhf_torchrl.modules.models import smollm2_path; print(smollm2_path())")
mkdir -p .gpucache/SmolLM2-135M-Instruct
find "$src" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .gpucache/SmolLM2-135M-Instruct/ \;
du -sh .whl .gpucache
