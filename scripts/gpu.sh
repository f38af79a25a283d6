#!/usr/bin/env bash
# The GPU run, on the machine with the GPU (the device tool), from the repo root:
#   bash scripts/gpu.sh [STEP ...]
#   steps: info tests sanitizer check check-sanitized demo tune tune-bwd tune-layers profile bench
#   bench-layers bench-decode bench-moe bench-new (linear_attn mla attention_fp8 eager train generate;
#   peers from wheels: see the device README) bench-gemm bench-gemm4 gemm-explore attention-explore ep-one ep fa-suite tune-moe tune-decode ncu ab (default, in this order: info tests check demo bench bench-layers
#   bench-decode sanitizer).
#   check-sanitized is lanekit check under compute-sanitizer's memcheck: every kernel on every
#   registered sample, checked for out-of-bounds accesses as well as against its oracle.
#   CHECK_ARGS narrows check and check-sanitized (e.g. CHECK_ARGS='--op fused_moe --op grouped_mm').
#   ncu profiles one launch of each NCU_CASES entry, family:case:kernel-regex[:TABLE.field=value+...]
#   (a ~ in the case stands for a space; the settings replace fields of this GPU's tuning rows, as
#   benchmarks.run_case --set does), with Nsight Compute's throughput, memory and stall sections
#   (and any more named in NCU_SECTIONS, e.g. "--section SourceCounters").
#   ab times one case across source trees, alternating (benchmarks.ab):
#   AB_ARGS='layers "qk_norm_rope_quant e4m3" old=.gpu/old/src new=src' (carry .gpu).
# Uses the machine's own python3 (torch, triton, transformers preinstalled); lanekit from src/.
# Each step's log goes to $OUT/<step>.log; a line per step with its exit code and last line. The device
# tool brings back at most 8 files from $OUT: more steps than that in one call lose their logs.
set -u
OUT=${OUT:-/tmp/lanekit-gpu}
mkdir -p "$OUT"
# .gpu/minilm: an fp16 copy of all-MiniLM-L6-v2 (the fp32 one is over the 64 MiB the device tool carries)
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LANEKIT_MINILM_DIR="$PWD/.gpu/minilm"
[ -f .gpu/minilm/config.json ] || echo "warning: .gpu/minilm is missing (carry .gpu): the MiniLM tests and the demo will fail"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info tests check demo bench bench-layers bench-decode sanitizer)

run_step() {
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc $((SECONDS - t0))s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -1)"
}

# The suite over 8 workers, then the tests that take tens of GiB (marker bigmem) one at a time:
# beside 8 workers they ran the GPU out of memory, theirs and their neighbours' (H100, 2026-12-07).
# -v names each test as it ends, so a run cut short still says which failed.
run_tests() {
  local rc=0 r
  python3 -m pytest ${TESTS:-tests} -v -p no:cacheprovider -p no:benchmark -n 8 --durations=25 -m "not bigmem" || rc=1
  python3 -m pytest ${TESTS:-tests} -v -p no:cacheprovider -p no:benchmark -m bigmem; r=$?
  [ $r -eq 0 ] || [ $r -eq 5 ] || rc=1     # 5: none of them among TESTS
  return $rc
}

for s in "${steps[@]}"; do
  case $s in
    info) run_step info bash -c 'nvidia-smi; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    tests) run_step tests run_tests ;;
    sanitizer) run_step sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 \
                 python3 -m pytest ${SANITIZE_TESTS:-tests/test_attention.py tests/test_attention_backward.py} -q -p no:cacheprovider \
                 -k "${SANITIZE_K:-not random and not every_head_dim and not fifty and not over_2_to_the_31 and not compile}" ;;
    check) run_step check python3 -m lanekit check ${CHECK_ARGS:-} --json "$OUT/sm90.json" ;;
    check-sanitized) run_step check-sanitized compute-sanitizer --tool memcheck --error-exitcode 9 \
                 python3 -m lanekit check ${CHECK_ARGS:-} --json "$OUT/sm90.json" ;;
    demo) run_step demo python3 -m lanekit demo --model-dir .gpu/minilm ;;
    tune) run_step tune python3 -m benchmarks.tune_attention ;;
    profile) run_step profile python3 -m benchmarks.profile_attention --dims ${DIMS:-64 128} ;;
    tune-layers) IFS=, read -ra tables <<<"${TUNE_TABLES:-}"; run_step tune-layers python3 -m benchmarks.tune_layers "${tables[@]}" ;;
    tune-bwd) run_step tune-bwd python3 -m benchmarks.tune_attention --backward --dims ${DIMS:-64 128} ;;
    bench) run_step bench python3 -m benchmarks.run attention attention_train attention_fp32 --json "$OUT/bench.json" ;;
    bench-layers) run_step bench-layers python3 -m benchmarks.run layers --json "$OUT/bench-layers.json" ;;
    bench-decode) run_step bench-decode python3 -m benchmarks.run decode prefill --json "$OUT/bench-decode.json" ;;
    bench-new) run_step bench-new python3 -m benchmarks.run linear_attn mla attention_fp8 eager train generate --json "$OUT/bench-new.json" ;;
    # --quick: the full shapes of gemm, quant and gemm_4bit took longer than a call can give them (H100, 2026-12-07)
    bench-gemm) run_step bench-gemm python3 -m benchmarks.run gemm_graphs quant_graphs --quick --json "$OUT/bench-gemm.json" ;;
    bench-gemm4) run_step bench-gemm4 python3 -m benchmarks.run gemm4_graphs gemm4_svdquant gemm4_int --quick \
                   --json "$OUT/bench-gemm4.json" ;;
    gemm-explore) run_step gemm-explore python3 -m benchmarks.explore_gemm_sm90 ;;
    attention-explore) run_step attention-explore python3 -m benchmarks.explore_attention_sm90 ;;
    ep-one) run_step ep-one bash -c "python3 -m benchmarks.moe_ep --world 1 --smoke && python3 -m benchmarks.moe_ep --world 1" ;;
    ep) run_step ep bash -c "LANEKIT_EP_BACKEND=nccl python3 -m pytest -q -rs tests/test_moe_distributed.py && python3 -m benchmarks.moe_ep --world ${EP_WORLD:-2} --smoke && python3 -m benchmarks.moe_ep --world ${EP_WORLD:-2}" ;;
    fa-suite) run_step fa-suite python3 scripts/run_fa_suite.py --tests ${FA_TESTS:-.gpu/fa_tests/test_flash_attn.py} --sample ${FA_SAMPLE:-3} --json "$OUT/fa.json" ;;
    bench-moe) run_step bench-moe python3 -m benchmarks.run moe --json "$OUT/bench-moe.json" ;;
    tune-moe) run_step tune-moe python3 -m benchmarks.tune_moe ${TUNE_ARGS:-} ;;
    tune-decode) run_step tune-decode python3 -m benchmarks.tune_decode ${TUNE_ARGS:-} ;;
    ab) run_step ab bash -c "python3 -m benchmarks.ab ${AB_ARGS:-}" ;;
    ncu) run_step ncu bash -c 'for spec in ${NCU_CASES:-"layers:adaln:_norm_fwd"}; do
           IFS=: read -r fam case kernel sets <<<"$spec"; echo "=== $fam $case ($kernel) $sets"
           ncu --clock-control none -k "regex:$kernel" --launch-skip 2 --launch-count 1 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
             --section LaunchStats --section WarpStateStats --section SchedulerStats ${NCU_SECTIONS:-} \
             python3 -m benchmarks.run_case "$fam" "${case//\~/ }" $(for x in ${sets//+/ }; do echo --set $x; done); done' ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
