#!/usr/bin/env bash
# Which guard a real micro-batch fails after the drafter's warmup (issue 29; docs/performance.md, "FP8 parity").
#   bash trainer/lab/gpu/warmup_recompiles.sh TINY_DIR OUT_DIR [more dflash-train flags]
# TINY_DIR: what dflash-tiny wrote (target/, data/), e.g. by trainer/lab/gpu/fp8_parity.py. One dflash-train run on
# GPU 0, --compile all, a few steps; every recompile is logged with its reason (TORCH_LOGS=recompiles), and
# after the warmup a shape its graphs do not cover fails the run naming the guard (DFLASH_AFTER_WARMUP_STANCE,
# trainer/ops/compiling.py; the trainer's own default compiles it and logs the step). The failure's traceback is in
# OUT_DIR/logs/. DFLASH_AFTER_WARMUP_STANCE=default in the caller's environment runs the trainer's default:
# the run goes on, and the log's "compiled after the warmup" lines count the graphs the warmup did not cover.
set -u
tiny=$1 out=$2
shift 2
rm -rf "$out"
DFLASH_AFTER_WARMUP_STANCE=${DFLASH_AFTER_WARMUP_STANCE:-fail_on_recompile} TORCH_LOGS="recompiles,graph_breaks" \
python -m trainer --target-model "$tiny/target" --data-dir "$tiny/data" --output-dir "$out" \
  --target-gpus 0 --drafter-gpus 0 --max-steps 4 --seed 0 --token-budget 4096 --max-seq-len 512 \
  --block-size 16 --max-anchors 64 --num-draft-layers 5 --grad-accum 1 --lr 1e-3 --epochs 1000 \
  --save-interval 1000000 --profile-interval 600 --compile all "$@"
rc=$?
echo "dflash-train exit $rc"
for f in "$out"/logs/train-*.log; do echo "== $f"; grep -n -A40 "Traceback\|guard\|Recompil\|recompil" "$f" | head -200; done
exit $rc
