#!/usr/bin/env bash
# The measurements of one lent GPU session, in one call (../shared/GPU.md): run from the
# project root on the GPU machine after `bash ../shared/gpu/prepare.sh` and
# `cp models/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/tokenizer/`
# here, with carry [".gpu"]. Results go to $OUT (or /tmp/gpu_out): one file per part.
#   sync   bench/sync_in_loop.py on the GPU, bfloat16, at two shapes: ~268M (ideal, no_sync,
#          shared, auto, cuda_ipc) and Qwen2.5-1.5B's (1.42B: ideal, shared, auto, cuda_ipc):
#          step period, step_over_ideal, the explorer's sync_wait/receive/apply per version
#          (a table in sync*.log), then bench/weight_sync.py --device cuda (shared, cuda_ipc);
#          9.5 min at most: one call, `bash bench/gpu/session.sh sync` (never run yet)
#   recipe examples/gsm8k/one_gpu_full.yaml on a random-init model of Qwen2.5-1.5B's shape
#          (transformers engine): step time, sync figures, measured peak memory beside
#          `streamrft plan`'s estimate
# Usage: bash bench/gpu/session.sh [PART...]   (default: sync recipe)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
ROOT=$(pwd) G=$(pwd)/.gpu O=${OUT:-/tmp/gpu_out}
mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl $G/streamrft-*.whl 2>&1 | grep -v "already exists" | tail -3
mkdir -p /tmp/site/bin && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$G/juicefs.xz'), open('/tmp/site/bin/juicefs', 'wb'))" && chmod +x /tmp/site/bin/juicefs
export PYTHONPATH=/tmp/site:$ROOT PATH=/tmp/site/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } | tee "$O/machine.txt"
sampler() { python3 bench/gpu/gpu_memory.py "$O/$1.memory.json" & SAMPLER=$!; }
stop_sampler() { kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null; }
for part in ${@:-sync recipe}; do case $part in
  sync)
    s=$(date +%s); sampler sync
    timeout 230 python3 bench/sync_in_loop.py --device cuda --dtype bfloat16 --shape 268m \
      --batch-size 32 --steps 8 --timeout 45 --points ideal,no_sync,shared,auto,cuda_ipc \
      > "$O/sync.json" 2> "$O/sync.log"
    echo "== sync 268m rc=$? wall=$(( $(date +%s)-s ))s"; tail -n 7 "$O/sync.log"
    s=$(date +%s)
    timeout 290 python3 bench/sync_in_loop.py --device cuda --dtype bfloat16 --shape qwen2.5-1.5b \
      --batch-size 32 --steps 8 --timeout 70 --points ideal,shared,auto,cuda_ipc \
      > "$O/sync15.json" 2> "$O/sync15.log"
    echo "== sync qwen2.5-1.5b rc=$? wall=$(( $(date +%s)-s ))s"; stop_sampler; tail -n 6 "$O/sync15.log"
    timeout 50 python3 bench/weight_sync.py --device cuda --dtype bfloat16 --mb 512 \
      --methods shared,cuda_ipc > "$O/weights.txt" 2>&1
    echo "== weight_sync cuda rc=$?"; grep -E "^(shared|cuda_ipc|overall)" "$O/weights.txt" ;;
  recipe|recipe_lora)
    s=$(date +%s); Y=examples/gsm8k/one_gpu_full.yaml; [ $part = recipe_lora ] && Y=examples/gsm8k/one_gpu_lora.yaml
    python3 bench/gpu/random_model.py /tmp/qwen15 --tokenizer $G/tokenizer --device cuda | tee "$O/model.json"
    R="-o model.path=/tmp/qwen15 -o taskset.path=$ROOT/examples/data/gsm8k_format_sample.parquet -o eval.path=$ROOT/examples/data/gsm8k_format_sample.eval.parquet -o explorer.max_new_tokens=128 -o eval.max_new_tokens=128 -o trainer.checkpoint_store=local -o trainer.lr_warmup_steps=2"
    python3 -m streamrft.app.cli plan $Y $R > "$O/$part.plan.txt" 2>&1
    python3 -m streamrft.app.cli plan $Y $R --json > "$O/$part.plan.json" 2>/dev/null
    cat "$O/$part.plan.txt"
    sampler $part
    timeout 240 python3 -m streamrft.app.cli run $Y --no-progress --max-steps 6 $R \
      -o run.dir=/tmp/runs/$part --summary "$O/$part.summary.json" > "$O/$part.console.log" 2>&1
    echo "== $part rc=$? wall=$(( $(date +%s)-s ))s"; stop_sampler
    cat "$O/$part.memory.json"
    for f in /tmp/runs/$part/*/metrics.jsonl; do cp "$f" "$O/$part.metrics.jsonl"; done
    for f in /tmp/runs/$part/*/logs/*.log; do tail -c 300000 "$f" > "$O/$part.$(basename $f .log).txt"; done
    grep -h "published (\|applied version" "$O"/$part.*log | tail -4 ;;
  *) echo "unknown part $part" ;;
esac; done
ls -la "$O"; (cd "$O" && tar czf results.tgz --exclude results.tgz . && find . -type f ! -name results.tgz -delete)  # few files come back
