#!/usr/bin/env bash
# Issue 39 on one GPU in one device call: ours against torchtitan 0.2.2, levers on/off, a profile, SFT vs TRL.
#
#   bash bench/ahead_of_titan.sh pretrain   # torchtitan's rows, then ours: base, levers at mb 28, profiles
#   bash bench/ahead_of_titan.sh tests      # the GPU tests (tests/test_gpu.py)
#   bash bench/ahead_of_titan.sh sft        # TRL's SFTTrainer rows, then finetune_throughput's compiled rows
#
# Device call (after `bash ../shared/bench/prep_wheels.sh`): carry .whl_tt, .whl_trl and .peer; OUT is where
# the logs go (default /tmp/titan; the JSON beside them in JSON_DIR, default /tmp, since a call brings back
# at most 8 files). ROWS / TT_ROWS / BUDGET override the row lists and the time limits. Every sub-run has its
# own timeout and tees its log into OUT, so one hang or a cut call still leaves data (the logs hold each row's
# JSON line, which bench/titan_report.py and peer_trl.py's report read).
set -uo pipefail
mode=${1:-pretrain}
OUT=${OUT:-/tmp/titan}
J=${JSON_DIR:-/tmp}
mkdir -p "$OUT" "$J"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
py=${PYTHON:-python3}
start=$(date +%s)
left() { echo $(($1 - $(date +%s) + start)); }  # seconds left of a budget counted from the start
install() {  # the carried wheels into /tmp/site (the image has torch, transformers and triton; not these)
  $py -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$1"/*.whl && rm -rf /tmp/site/test
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$OUT/gpu.txt"

if [ "$mode" = pretrain ]; then
  install .whl_tt || exit 1
  $py -c "import torch; from importlib.metadata import version as v
print('torch', torch.__version__, 'torchao', v('torchao'), 'liger-kernel', v('liger-kernel'), 'torchtitan', v('torchtitan'))" |
    tee -a "$OUT/gpu.txt"
  tt_rows=${TT_ROWS:-tt_bf16,tt_fp8}
  timeout "${TT_S:-230}" $py .peer/peer_torchtitan.py --rows "$tt_rows" --sizes "${TT_SIZES:-14,28}" --out "$J/tt.json" 2>&1 |
    grep -v "^\[rank0\]:\[W" | tee "$OUT/tt.log"
  rows=${ROWS:-ours_liger_compile@14:28,ours_fp8_tensorwise@14:28,ours_fp8_tensorwise+fa@14:28,ours_liger_compile+flce0@28,ours_liger_compile+flash@28,ours_liger_compile+flex@28,ours_liger_compile+foreach@28,ours_fp8_tensorwise+fp8logits@14}
  timeout "$(left "${BUDGET:-575}")" $py bench/train_throughput.py --warmup 3 --steps 6 --only "$rows" \
    --profile "${PROFILE:-ours_liger_compile@28,ours_fp8_tensorwise@28}" --out "$J/ours.json" 2>&1 |
    tee "$OUT/ours.log"
  $py bench/titan_report.py "$OUT/ours.log" "$OUT/tt.log" | tee "$OUT/report.txt"
elif [ "$mode" = tests ]; then
  install .whl_tt || exit 1  # liger and torchao, as the gpu extra installs them
  timeout "${BUDGET:-240}" $py -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_gpu.py} 2>&1 |
    tail -25 | tee "$OUT/tests.log"
elif [ "$mode" = sft ]; then
  rm -rf /tmp/site && install .whl_trl || exit 1
  # Ours first (OURS_S seconds at most), then TRL's rows in the time left: TRL_VARIANTS in peer_trl.py's names.
  timeout "${OURS_S:-300}" $py bench/finetune_throughput.py --warm-all --warmup 2 --steps 6 --memory-vocab 0 \
    --only "${ROWS:-ours_packed_compile,ours_padded_compile,ours_packed_capped_compile}" --out "$J/ft.json" 2>&1 |
    tee "$OUT/ft.log"
  trl_s=$(left "${BUDGET:-575}")
  timeout "$trl_s" $py .peer/peer_trl.py --proj . --warm-all --warmup 2 --steps 6 --budget-s $((trl_s - 40)) \
    --variants "${TRL_VARIANTS:-trl_padfree,trl_padded,trl_bfd,trl_padfree_mb16}" --out "$J/trl.json" 2>&1 |
    grep -v "^\[rank0\]:\[W" | tee "$OUT/trl.log"
  $py .peer/peer_trl.py report "$OUT/ft.log" "$OUT/trl.log" | tee "$OUT/sft_report.txt"
else
  echo "mode is pretrain, tests or sft, got $mode" >&2
  exit 2
fi
