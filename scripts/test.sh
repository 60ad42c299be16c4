#!/usr/bin/env bash
# Install everything (idempotently, with the test tools) and run the test suite.
# Arguments go to pytest (e.g. `scripts/test.sh -k chat`, `scripts/test.sh -m gpu`).
#
# A whole-suite run (no test paths or -k/-m selection among the arguments) on a machine where kt-kernel
# loads a build above avx2 (AMX or AVX-512) then runs the experts, LoRA and guide-config tests again under the
# forced avx2 build, the one AMD EPYC Rome/Milan and older Xeons get: both paths are checked wherever CI
# lands. KTSERVE_TEST_VARIANTS="avx2 avx512_bf16" names other builds to check; "" skips the second pass.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install.sh" test
cd "$root"
python="${KTSERVE_VENV:-$root/.venv}/bin/python"

whole_suite=1
for arg in "$@"; do
  case "$arg" in
    -k|-m|--deselect|tests*|*.py|*::*) whole_suite=0 ;;
  esac
done

status=0
"$python" -m pytest "$@" || status=$?

loaded="$("$python" -c 'from engines.kt.expert_methods import cpu_variant; print(cpu_variant())' 2>/dev/null || echo none)"
variants="${KTSERVE_TEST_VARIANTS-avx2}"
if [ "$whole_suite" = 1 ] && [ "$loaded" != none ]; then
  for variant in $variants; do
    [ "$variant" = "$loaded" ] && continue
    echo "== kt-kernel's $variant build (this machine loads $loaded): experts, engine and LoRA tests"
    # test_kt_expert_methods.py forces avx2 itself (and serves chat under it); the huggingface half of the LoRA
    # tests has no kt-kernel in it
    KT_KERNEL_CPU_VARIANT="$variant" "$python" -m pytest "$@" tests/test_kt_experts_cpu.py tests/test_lora_outputs.py \
      tests/test_guide_config.py -k "not huggingface" || status=$?
  done
fi
exit "$status"
