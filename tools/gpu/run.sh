#!/bin/bash
# The project's steps ON the GPU machine, from the checkout root:  bash tools/gpu/run.sh STEP...
# (tools/gpu/device.sh is the measured recipe it extends; tools/gpu/README.md gives the call plans.)
#
#   (PAY=.gpu26 takes the payload from .gpu26/ instead of .gpu/: vLLM 0.26.0, see tools/gpu/README.md)
#   stash     copy the carried vLLM part(s) .gpu/cN/* to /tmp/parts (a carried path is gone at the next call)
#   deps      pip-install the carried wheels into /tmp/site: .gpu/whl (vLLM's missing imports),
#             .gpu/w2 (speculators 0.3.0, loguru, compressed-tensors 0.15.0.1, wrapt) and, if carried,
#             .gpu/tf4 (transformers 4.57.6 + huggingface-hub 0.36.2 + tokenizers 0.22.2) into /tmp/site-tf4,
#             first on the path (TF5_RUNS=1: only for prepare; vLLM then runs on the image's transformers)
#   project   build this checkout's wheel and install it into /tmp/site (entry points included:
#             the vllm.general_plugins plugin reaches vLLM's workers through PYTHONPATH)
#   info      GPU, driver, python, the versions that matter
#   prepare   tests/gpu/prepare.py: the models (llama, dsv3, kimi INT4, perf 1.2B) and HF fp32
#             references under /tmp/g016 -- no vLLM needed, so it runs in call 1
#   vllm      join /tmp/parts/vllm.tar.xz.*, check the sha256, untar into /tmp/site
#   extra     llguidance wheel + stripped xgrammar tarball (.gpu/x1) into /tmp/site (0.26: llguidance,
#             xgrammar and apache-tvm-ffi wheels)
#   import    python3 -c "import vllm; from vllm import LLM" (and speculators' generator)
#   modcheck  tools/gpu/modcheck.py: every missing third-party module of ~30 vLLM modules at once
#   check     python3 -m speculators_compat.check (text) -> $OUT/check.txt
#   tests     tests/gpu/runner.py: prepare (no-op if done), TP=1 + perf, TP=2; $OUT/results.json
#             + $OUT/logs.tar.gz. RUNNER_ARGS adds options (default: --parallel when 2 GPUs);
#             the budget is what is left of 570 s since this script started (BUDGET overrides)
#   tests-tp1 | tests-tp2 | tests-perf   one phase only (for a call after a partial run)
#   selfcheck  tools/gpu/selfcheck.py on llama-8b, dsv3 and kimi: $OUT/selfcheck-*.json
#   bench-models  benchmarks/gpu.py build: the random bf16 Llamas "1.2B" and "8B" under $BM
#             (/tmp/g016/bm; transformers 4.57 as for prepare; no vLLM needed, so it runs in call 1)
#   bench     benchmarks/gpu.py bench on each of $BENCH_MODELS (llama-1b llama-8b): vLLM's
#             eager prefill, the generator as installed and its steps alone, 3 rotated rounds ->
#             $OUT/bench-<model>.json (also kept in $BM for `stock`); BENCH_ARGS adds options;
#             BENCH_TAG names another report (bench-<model>$BENCH_TAG.json; `stock` reads the untagged one)
#   stock     benchmarks/gpu.py stock on llama-8b: the stock script through `speculators-compat
#             run`, $STOCK_CALLS (50) calls of 16 x 1024 tokens saved to /tmp/stock, against the disk's
#             and the save path's bandwidth and the bench's prefill -> $OUT/stock-llama-8b$STOCK_TAG.json
#             (STOCK_ARGS: e.g. "--batch 8 --runs 2 --writer torch"; its log, stock-<model>$STOCK_TAG.log)
#   smoke     tools/gpu/run_llm.py on the tiny llama (plain vLLM, the recipe's check)
#   stub34    vLLM 0.33/0.34: the MiniMax-M3 warm-up module (imports the CuTe DSL, not carried) made a
#             no-op (it returns at once for other models and on SM90); stated in the records
#   (SC_MODELS: the models of `selfcheck`, default the 8B bench model, dsv3 and kimi)
#   runners   vLLM 0.26 - 0.33 (both runners): each of $RUNNERS_MODELS (llama qwen3 dsv3 kimi) extracted
#             under the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), then under Model Runner V2 (=1; needs
#             RECORD=1 until mrv2-rows is validated on the release), sets $RUNNERS_SETS (mixed,chunked);
#             both against HF fp32 and MRv2's rows against V1's -> $OUT/runners-<model>.json
#   multi-dp   tests/gpu/multi.py dp (2+ GPUs): the stock script through `speculators-compat run
#             --data-parallel 2` (one GPU per shard; MULTI_TP=2 on 4 GPUs: TP=2 shards) against one
#             process, byte-equal; shard 1 SIGKILLed and resumed; `verify --full` -> $OUT/multi-dp.json
#             + multi-dp.log (the runs' logs: $G016_ROOT/multi/dp/*.log); needs `prepare` (the llama)
#   multi-kill tests/gpu/multi.py kill: a vLLM worker SIGKILLed mid-call at TP=$MULTI_KILL_TP (2) under
#             NCCL: seconds to WorkerDiedError, orphans, /dev/shm, GPU memory -> $OUT/multi-kill.json
#   tests-multi  the same two through pytest (tests/gpu/test_multi.py, runner --phase multi):
#             results.json's summary.multi_dp / multi_kill
#   selfcheck-tp2  `selfcheck` at --tp ${SC_TP:-2} on $SC_MODELS (default dsv3 and kimi):
#             $OUT/selfcheck-tp2-*.json (the self-check's separation and its seconds at TP>1)
set -o pipefail
SITE=${SITE:-/tmp/site}; PARTS=${PARTS:-/tmp/parts}   # overridable for a dry run elsewhere
PAY=${PAY:-.gpu}   # the payload folder (tools/gpu/pack.sh's OUTDIR): .gpu (vLLM 0.20.0), .gpu26 (vLLM 0.26.0)
SITE_TF4=${SITE_TF4:-$SITE-tf4}   # transformers 4.57 + its hub/tokenizers, ahead of $SITE
# TF5_RUNS=1: vLLM and the shim run on the image's transformers 5.x (once the shim supports it);
# prepare (the model builders, the INT4 quantization, HF references) always uses transformers 4.57
# (vLLM 0.26 requires transformers>=5.5.3: TF5_RUNS=1 is a must there). The runner's prepare phase
# and the tests' `prepared` fixture get $SITE_TF4 first through G016_PREPARE_PYTHONPATH.
if [ "${TF5_RUNS:-0}" = 1 ]; then RUN_PATH=$SITE; export G016_PREPARE_PYTHONPATH=$SITE_TF4:$SITE
else RUN_PATH=$SITE_TF4:$SITE; fi
# vLLM 0.26's V1 sampler imports flashinfer (not in the payload) unless its sampler is off; the
# extraction never samples
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONUNBUFFERED=1 PYTHONPATH=$RUN_PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 G016_ROOT=${G016_ROOT:-/tmp/g016}
# The patches decide as for any user. RECORD=1 makes this a validation run on CUDA
# (SPECULATORS_COMPAT_RECORD=$G016_ROOT/record, or the folder you set): patches apply on a release
# no validation run recorded yet (before it is recorded, the performance patches are left off
# there: `bench` then names them in missing_features). The runner writes what applied as
# $OUT/validation-run.json either way (tools/matrix.py record merges it).
if [ "${RECORD:-0}" = 1 ]; then export SPECULATORS_COMPAT_RECORD=${SPECULATORS_COMPAT_RECORD:-$G016_ROOT/record}; fi
echo "SPECULATORS_COMPAT_RECORD=${SPECULATORS_COMPAT_RECORD:-(unset)}"
BM=${BM:-$G016_ROOT/bm}; BENCH_MODELS=${BENCH_MODELS:-llama-1b llama-8b}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$SITE" "$G016_ROOT"
T_START=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - T_START ))s)"; }
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@" 2>&1 \
           | grep -v -E "WARNING: Target directory|already exists. Specify --upgrade"; return 0; }
pipi2() { local target=$1; shift
           python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@" 2>&1 \
           | grep -v -E "WARNING: Target directory|already exists. Specify --upgrade"; return 0; }
runner() {
  local budget=${BUDGET:-$(( 570 - ( $(date +%s) - T_START ) ))}
  local extra=${RUNNER_ARGS-}
  if [ -z "${RUNNER_ARGS+x}" ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then extra=--parallel; fi
  ( cd "$G016_ROOT" && python3 "$OLDPWD/tests/gpu/runner.py" --out "$OUT" --budget "$budget" $extra "$@" ) 2>&1 | tail -60
}

for s in "$@"; do
  step "$s"
  case $s in
  stash)
    mkdir -p "$PARTS"; cp -v "$PAY"/c*/* "$PARTS"/ 2>&1; ls -l "$PARTS" ;;
  deps)
    pipi "$PAY"/whl/*.whl "$PAY"/w2/*.whl
    if [ -d "$PAY"/tf4 ]; then mkdir -p "$SITE_TF4"; pipi2 "$SITE_TF4" "$PAY"/tf4/*.whl; fi
    # speculators 0.3.0 imports on transformers 5.x only through the shim (installed by `project`):
    # check the wheels on the transformers 4.57 path
    # (without tf4 in this call -- it travels later -- speculators is left out of the check)
    spec=speculators,; [ -d "$PAY"/tf4 ] || spec=
    PYTHONPATH=$SITE_TF4:$SITE python3 -c "import transformers, tokenizers, huggingface_hub, $spec compressed_tensors, loguru, wrapt, pydantic
print('deps ok: transformers', transformers.__version__, 'hub', huggingface_hub.__version__, 'tokenizers', tokenizers.__version__,
      'compressed-tensors', compressed_tensors.__version__, 'wrapt', wrapt.__version__)" 2>&1 | tail -3 ;;
  project)
    rm -rf /tmp/g016-wheel; mkdir -p /tmp/g016-wheel
    python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/g016-wheel . 2>&1 | tail -3
    pipi /tmp/g016-wheel/speculators_compat-*.whl
    ( cd /tmp && python3 -c "import speculators_compat, importlib.metadata as m
eps = [e.name for e in m.entry_points(group='vllm.general_plugins')]
print('speculators_compat', m.version('speculators_compat'), 'from', speculators_compat.__file__, 'plugins', eps)" ) ;;
  info)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys,torch;print(sys.version.split()[0],torch.__version__,torch.version.cuda,torch.cuda.get_device_capability(),'gpus',torch.cuda.device_count())"
    nproc; free -g | head -2; df -h /tmp | tail -1 ;;
  prepare)
    ( cd "$G016_ROOT" && PYTHONPATH=$SITE_TF4:$SITE python3 "$OLDPWD/tests/gpu/prepare.py" ) 2>&1 | grep -v -E "Compressing model|it/s\]" | tail -15 ;;
  vllm)
    cat "$PARTS"/vllm.tar.xz.? > "$PARTS"/vllm.tar.xz
    got=$(sha256sum "$PARTS"/vllm.tar.xz | cut -d' ' -f1); want=$(cat "$PARTS"/vllm.tar.xz.sha256)
    echo "sha256 $got want $want"; [ "$got" = "$want" ] || echo "SHA256 MISMATCH: a part is missing or damaged"
    if command -v xz >/dev/null; then xz -d -T0 -c "$PARTS"/vllm.tar.xz | tar -x -C "$SITE"
    else python3 -c "import tarfile,sys;tarfile.open(sys.argv[1],'r:xz').extractall(sys.argv[2])" "$PARTS"/vllm.tar.xz "$SITE"; fi
    rm -f "$PARTS"/vllm.tar.xz; du -sh "$SITE"/vllm ;;
  extra)
    pipi "$PAY"/x1/*.whl
    if ls "$PAY"/x1/xgrammar-*.tar.xz >/dev/null 2>&1; then tar -xJf "$PAY"/x1/xgrammar-*.tar.xz -C "$SITE"; fi
    ( cd /tmp && python3 -c "import llguidance, xgrammar, importlib.metadata as m
print('extra ok:', *(d + ' ' + m.version(d) for d in ('llguidance', 'xgrammar')), xgrammar.GrammarMatcher.__name__)" 2>&1 | tail -2 ) ;;
  import)
    ( cd /tmp && python3 -c "import time;t=time.time();import vllm;from vllm import LLM
import speculators_compat
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
print('vllm',vllm.__version__,'import_s',round(time.time()-t,1))" ) 2>&1 | grep -v -E "^(INFO|WARNING) " | tail -5 ;;
  modcheck)
    python3 tools/gpu/modcheck.py 2>&1 | tee "$OUT/modcheck.log" | grep -v "^ok " ;;
  check)
    ( cd /tmp && python3 -m speculators_compat.check ) > "$OUT/check.txt" 2>&1; echo "check exit $?"
    grep -E "refused|covered|unknown" "$OUT/check.txt" | head -20 ;;
  tests)      runner --phase all ;;
  tests-tp1)  runner --phase tp1 ;;
  tests-tp2)  runner --phase tp2 ;;
  tests-perf) runner --phase perf ;;
  tests-multi) runner --phase multi ;;
  multi-dp|multi-kill)
    n=${s#multi-}; tp=${MULTI_TP:-1}; [ "$n" = kill ] && tp=${MULTI_KILL_TP:-2}
    ( cd "$G016_ROOT" && timeout ${TMO_MULTI:-560} python3 "$OLDPWD/tests/gpu/multi.py" $n --tp $tp \
        --out "$OUT/multi-$n.json" ${MULTI_ARGS-} ) > "$OUT/multi-$n.log" 2>&1; echo "multi-$n rc=$?"
    tail -c 1500 "$OUT/multi-$n.log"
    ( cd "$G016_ROOT/multi/$n" 2>/dev/null && tar -czf "$OUT/multi-$n-logs.tar.gz" *.log ) ;;
  selfcheck-tp2)
    for m in ${SC_MODELS:-$G016_ROOT/models/dsv3 $G016_ROOT/models/kimi}; do
      n=$(basename "$m")
      timeout ${TMO_SC:-200} python3 tools/gpu/selfcheck.py "$m" --tp ${SC_TP:-2} \
        --out "$OUT/selfcheck-tp${SC_TP:-2}-$n.json" --prompts ${SC_PROMPTS:-16} --len ${SC_LEN:-1024} \
        > "$OUT/selfcheck-tp${SC_TP:-2}-$n.log" 2>&1
      echo "selfcheck-tp${SC_TP:-2} $n rc=$? (t=$(( $(date +%s) - T_START ))s)"
      grep -F "{" "$OUT/selfcheck-tp${SC_TP:-2}-$n.log" | cut -c1-300 | tail -8
    done ;;
  bench-models)
    ( cd /tmp && PYTHONPATH=$SITE_TF4:$SITE python3 "$OLDPWD/benchmarks/gpu.py" build "$BM" $BENCH_MODELS ) 2>&1 | tail -3
    ls "$BM" ;;
  bench)
    for m in $BENCH_MODELS; do
      timeout ${TMO_BENCH:-280} python3 benchmarks/gpu.py bench "$BM/$m" --out "$BM/bench-$m${BENCH_TAG-}.json" ${BENCH_ARGS-} \
        > "$OUT/bench-$m${BENCH_TAG-}.log" 2>&1; echo "bench $m rc=$? (t=$(( $(date +%s) - T_START ))s)"
      cp "$BM/bench-$m${BENCH_TAG-}.json" "$OUT/" 2>/dev/null
      grep -E "^WARNING: not applied|^\{" "$OUT/bench-$m${BENCH_TAG-}.log" | cut -c1-1500 | tail -2
    done ;;
  stock)
    m=${STOCK_MODEL:-llama-8b}
    timeout ${TMO_STOCK:-290} python3 benchmarks/gpu.py stock "$BM/$m" --out "$BM/stock-$m.json" \
      --calls ${STOCK_CALLS:-50} --batch 16 --disk ${STOCK_DISK:-/tmp/stock} --prefill-json "$BM/bench-$m.json" ${STOCK_ARGS-} \
      > "$OUT/stock-$m${STOCK_TAG-}.log" 2>&1; echo "stock $m rc=$? (t=$(( $(date +%s) - T_START ))s)"
    cp "$BM/stock-$m.json" "$OUT/stock-$m${STOCK_TAG-}.json" 2>/dev/null
    tail -c 200000 "$BM/stock-$m.json.child.log" > "$OUT/stock-$m${STOCK_TAG-}.child.log" 2>/dev/null
    rm -rf "${STOCK_DISK:-/tmp/stock}/out"
    grep -E "^\{" "$OUT/stock-$m${STOCK_TAG-}.log" | cut -c1-1500 | tail -1 ;;
  selfcheck)
    # the self-check's separation (correct rows against each test-only fault) on the 8B bench model
    # and the prepared DeepSeek-V3 MLA and Kimi-shaped INT4 models
    for m in ${SC_MODELS:-$BM/llama-8b $G016_ROOT/models/dsv3 $G016_ROOT/models/kimi}; do
      n=$(basename "$m")
      timeout ${TMO_SC:-150} python3 tools/gpu/selfcheck.py "$m" --out "$OUT/selfcheck-$n.json" \
        --prompts ${SC_PROMPTS:-16} --len ${SC_LEN:-1024} > "$OUT/selfcheck-$n.log" 2>&1
      echo "selfcheck $n rc=$? (t=$(( $(date +%s) - T_START ))s)"; grep -F "{" "$OUT/selfcheck-$n.log" | cut -c1-300 | tail -8
    done ;;
  tf5)
    # the image's own transformers 5.x (no 4.57 ahead on the path): import speculators 0.3.0 through the
    # tf5-* patches, then one extraction (models and references were built on 4.57 by prepare)
    ( cd "$G016_ROOT/work" 2>/dev/null || cd /tmp; PYTHONPATH=$SITE timeout ${TMO:-150} python3 "$OLDPWD/tests/gpu/extract.py" llama --tp 1 \
        --sets mixed --out "$OUT/extract_llama_tf5.json" > "$OUT/tf5.log" 2>&1; echo "tf5 rc=$?" )
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:(v['ok'],str(v.get('error',''))[:300]) for k,v in d['steps'].items()});print('mixed',{k:d['steps'].get('mixed',{}).get('value',{}).get(k) for k in ('max_rel_l2','pooled_rel_l2','rows_ok')})" "$OUT/extract_llama_tf5.json" 2>&1 | tail -3
    PYTHONPATH=$SITE python3 -c "import transformers;print('transformers',transformers.__version__)" ;;
  disabled)
    # one extraction with the patches in $DISABLE turned off (what the rows are without them), mixed set
    m=${DIS_MODEL:-llama}
    ( cd "$G016_ROOT/work" 2>/dev/null || cd /tmp; SPECULATORS_COMPAT_DISABLE=$DISABLE timeout ${TMO:-200} python3 "$OLDPWD/tests/gpu/extract.py" \
        $m --tp 1 --sets mixed --out "$OUT/extract_${m}_without_${DISABLE//,/_}.json" > "$OUT/disabled.log" 2>&1; echo "disabled $DISABLE rc=$?" )
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:(v['ok'],str(v.get('error',''))[:300]) for k,v in d['steps'].items()});print('mixed',{k:d['steps'].get('mixed',{}).get('value',{}).get(k) for k in ('max_rel_l2','pooled_rel_l2','rows_ok','outlier_rows')})" "$OUT/extract_${m}_without_${DISABLE//,/_}.json" 2>&1 | tail -3 ;;
  runners)
    for m in ${RUNNERS_MODELS:-llama qwen3 dsv3 kimi}; do
      rows=$G016_ROOT/work/rows-$m.pt
      for r in v1 mrv2; do
        if [ $r = v1 ]; then v=0; keep="--save-rows $rows"; else v=1; keep="--compare-rows $rows"; fi
        ( cd "$G016_ROOT/work" 2>/dev/null || cd /tmp; VLLM_USE_V2_MODEL_RUNNER=$v timeout ${TMO:-200} python3 \
            "$OLDPWD/tests/gpu/extract.py" $m --tp 1 --sets ${RUNNERS_SETS:-mixed,chunked} $keep \
            --out "$OUT/runners-$m-$r.json" > "$OUT/runners-$m-$r.log" 2>&1; echo "runners $m $r rc=$?" )
      done
      python3 tests/gpu/runners.py "$OUT/runners-$m.json" "$OUT/runners-$m-v1.json" "$OUT/runners-$m-mrv2.json" \
        && rm -f "$OUT/runners-$m-v1.json" "$OUT/runners-$m-mrv2.json"
      tar -czf "$OUT/runners-$m-logs.tar.gz" -C "$OUT" runners-$m-v1.log runners-$m-mrv2.log 2>/dev/null \
        && rm -f "$OUT/runners-$m-v1.log" "$OUT/runners-$m-mrv2.log"
    done ;;
  stub34)
    # vLLM 0.33/0.34 on the image: kernel_warmup imports model_executor/warmup/minimax_m3_msa_warmup.py
    # for every model on CUDA, which (0.34) imports the CuTe DSL (nvidia-cutlass-dsl, not carried);
    # its function returns at once for a model without MiniMax-M3 attention or a GPU that is not SM100
    f=$SITE/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
    if [ -f "$f" ]; then [ -f "$f.orig" ] || cp "$f" "$f.orig"
      printf '# speculators_compat GPU run: the original imports the CuTe DSL (not carried); it returns at once\n# for a model without MiniMaxM3SparseAttention or a GPU that is not SM100.\ndef minimax_m3_msa_warmup(worker):\n    return None\n' > "$f"
      rm -f "$SITE"/vllm/model_executor/warmup/__pycache__/minimax_m3_msa_warmup*; echo "stubbed $f"; fi ;;
  smoke)
    timeout ${TMO:-240} python3 tools/gpu/run_llm.py "$G016_ROOT/models/llama" > "$OUT/smoke.log" 2>&1
    echo "rc=$?"; grep -E "RESULT|Error|Traceback" "$OUT/smoke.log" | cut -c1-400 | tail -5 ;;
  *) echo "unknown step $s" ;;
  esac
done
step end
