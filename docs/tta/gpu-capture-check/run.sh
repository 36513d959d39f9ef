#!/bin/bash
# device call 2: the capture fix (GPU tests), auto captured on case a, captured serial
# beside it, then where auto's tuning time goes and the captured steps' parts
set -o pipefail
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-330}))
left() { echo $(( END - $(date +%s) )); }
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi -L
make DEVICE=1 device-setup > $OUT/setup.log 2>&1 || { tail -40 $OUT/setup.log; exit 1; }
PP="env PYTHONPATH=/tmp/layerpar-site:$PWD"
el tests
timeout 100 $PP python3 -m pytest -q -p no:cacheprovider \
  "tests/gpu/test_cuda.py::test_auto_captured_step_trains_like_its_setting_eagerly" \
  "tests/gpu/test_cuda.py::test_captured_training_loop_does_not_synchronise" \
  "tests/gpu/test_cuda.py::test_capture_after_eager_steps_on_the_default_stream" \
  "tests/gpu/test_cuda.py::test_captured_step_trains_like_the_eager_step" \
  "tests/gpu/test_triton_cuda.py::test_choice_is_measured_once_per_shape" > $OUT/tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error|assert" $OUT/tests.log | tail -12 | cut -c1-500
A="mnist1d --epochs 8 --model dense --layers 1024 --width 32 --t-final 1 --device cuda --no-progress"
el auto left $(left)
timeout 130 $PP python3 -m layerpar.apps.tta worker $OUT/auto.json $A --auto > $OUT/auto.log 2>&1
echo "auto rc $?"; grep -v "^mnist1d:   \|Warn\|return Var" $OUT/auto.log | tail -8 | cut -c1-600
el serial-captured left $(left)
timeout 80 $PP python3 -m layerpar.apps.tta worker $OUT/serial-captured.json $A --levels 1 --tol 0 > $OUT/serial.log 2>&1
echo "serial rc $?"; grep -v "Warn\|return Var" $OUT/serial.log | tail -2 | cut -c1-300
L=$(left); el prof left $L
if [ $L -gt 25 ]; then
  timeout $(( L - 5 )) $PP python3 docs/tta/gpu-capture-check/prof.py > $OUT/prof.log 2>&1
  echo "prof rc $?"; grep -E "^(serial|L[0-9]|tune_s)" $OUT/prof.log | cut -c1-400
fi
el done
