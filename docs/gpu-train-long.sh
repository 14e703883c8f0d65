#!/usr/bin/env bash
# Issue #36 on one GPU box (torch, transformers, typer; no vLLM): the long recipe for both shapes at once, each
# paused by `timeout` with its checkpoint saved, then, with the time left, the reference engine's grid of random
# eviction (kvtier.reference: the engine's schedule and keyed keep-sets in transformers) on every finished model,
# the eviction-trained ones first. Results: $OUT/<shape>.tgz (phase directories), $OUT/<shape>-<phase>-ckpt.pt (a
# paused phase), $OUT/grid-logs.tgz (grids and logs): at most 6 files. From the repository root:
#   OUT=out bash docs/gpu-train-long.sh [TRAIN_SECONDS] [TOTAL_SECONDS]
# pydantic (the reference engine's request spec) travels as wheels in .whl/ (docs/reasoner.md says how).
# WORK and GRID_ARGS: a dry run's (another work directory; a smaller grid, e.g. "--problems 2 --runs 1").
set -u
TRAIN_S=${1:-430}; TOTAL_S=${2:-560}; OUT=${OUT:-out}; WORK=${WORK:-train}; GRID_ARGS=${GRID_ARGS:-}
L="$WORK/logs"; G="$WORK/grid"; mkdir -p "$OUT" "$L" "$G"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
DEVICE=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
for s in long-2kv long-8kv; do
  (timeout -s TERM -k 30 "$TRAIN_S" python3 -m kvtier.models.cli train-recipe --shape $s --work "$WORK/$s" \
     --device "$DEVICE" --workers 6 --attention mask > "$L/$s.log" 2>&1; echo "exit $?" >> "$L/$s.log") &
done
wait
for m in long-8kv/evict long-2kv/evict long-8kv/p5 long-2kv/p5; do
  left=$((TOTAL_S - SECONDS - 20))
  [ -f "$WORK/$m/TRAINING.json" ] && [ $left -gt 30 ] || continue
  name=${m/\//-}
  timeout -s KILL $left python3 -m kvtier.evaluation.reasoner_cli reasoner --engine reference --model "$WORK/$m" \
    --family chains-long --policies random --budgets 256,512,1024 $GRID_ARGS --out "$G/$name" > "$L/grid-$name.log" 2>&1
  echo "grid $name: exit $? at ${SECONDS}s" >> "$L/grid.log"
done
for s in long-2kv long-8kv; do
  [ -d "$WORK/$s" ] && tar --exclude=ckpt.pt --exclude='*.tmp' -czf "$OUT/$s.tgz" -C "$WORK" $s
  for p in p1 p2 p3 p3b p4 p5 evict; do [ -f "$WORK/$s/$p/ckpt.pt" ] && cp "$WORK/$s/$p/ckpt.pt" "$OUT/$s-$p-ckpt.pt"; done
done
tar -czf "$OUT/grid-logs.tgz" -C "$WORK" grid logs
grep -h "speed\|paused\|stopped\|done\|Error\|exit\|training into\|resum" "$L"/*.log | cut -c1-300
ls -la "$OUT"
