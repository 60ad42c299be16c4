#!/usr/bin/env bash
# Install everything (idempotently, with the test tools) and run the test suite.
# Arguments go to pytest (e.g. `scripts/test.sh -k chat`, `scripts/test.sh -m gpu`).
#
# A whole-suite run (no test paths or -k/-m selection among the arguments) on a machine where kt-kernel
# loads a build above avx2 (AMX or AVX-512) then runs the experts, expert-deferral, decode-kernel-against-kt-kernel,
# LoRA, guide-config and batch-invariance tests again under the forced avx2 build, the one AMD EPYC Rome/Milan and older Xeons get: both
# paths are checked wherever CI lands. KTSERVE_TEST_VARIANTS="avx2 avx512_bf16" names other builds to check; ""
# skips the second pass.
#
# A whole-suite run also runs the vllm engine's tests (`-m vllm`), in an environment of their own
# (KTSERVE_VLLM_VENV, default .venv-vllm): vLLM pins older transformers, fastapi, numpy and llguidance than
# .venv has and brings uvloop, which uvicorn would pick up, so installing it into .venv would change what the
# main suite tests. That install runs in the background while the main suite runs. KTSERVE_TEST_VLLM=0 skips
# the pass; `scripts/test.sh -m vllm` runs it alone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${KTSERVE_VENV:-$root/.venv}/bin/python"
vllm_venv="${KTSERVE_VLLM_VENV:-$root/.venv-vllm}"

whole_suite=1
vllm_only=0
previous=
for arg in "$@"; do
  case "$arg" in
    -k|-m|--deselect|tests*|*.py|*::*) whole_suite=0 ;;
  esac
  [ "$previous" = -m ] && [ "$arg" = vllm ] && vllm_only=1
  previous="$arg"
done

install_vllm() {
  KTSERVE_VENV="$vllm_venv" "$root/scripts/install.sh" test,vllm
}

run_vllm_tests() {
  echo "== the vllm engine's tests (pytest -m vllm) in $vllm_venv"
  KTSERVE_VENV="$vllm_venv" "$vllm_venv/bin/python" -m pytest "$@" -m vllm
}

if [ "$vllm_only" = 1 ]; then
  install_vllm
  run_vllm_tests "$@"
  exit
fi

"$root/scripts/install.sh" test
echo "== ${python%/bin/python} ready in $SECONDS s"
vllm_pass=0
if [ "$whole_suite" = 1 ] && [ "${KTSERVE_TEST_VLLM:-1}" != 0 ]; then
  vllm_pass=1
  vllm_log="$(mktemp)"
  (
    started=$SECONDS
    install_vllm && echo "== $vllm_venv ready in $((SECONDS - started)) s (installed while the main suite ran)"
  ) >"$vllm_log" 2>&1 &
  vllm_install=$!
fi

status=0
"$python" -m pytest "$@" || status=$?

loaded="$("$python" -c 'from engines.kt.experts.methods import cpu_variant; print(cpu_variant())' 2>/dev/null || echo none)"
variants="${KTSERVE_TEST_VARIANTS-avx2}"
if [ "$whole_suite" = 1 ] && [ "$loaded" != none ]; then
  for variant in $variants; do
    [ "$variant" = "$loaded" ] && continue
    echo "== kt-kernel's $variant build (this machine loads $loaded): experts, engine, LoRA and batch-invariance tests"
    # test_kt_expert_methods.py forces avx2 itself (and serves chat under it); the huggingface half of the LoRA
    # tests has no kt-kernel in it, nor do the V3.2 tests other than the two named
    KT_KERNEL_CPU_VARIANT="$variant" "$python" -m pytest "$@" \
      tests/engines/kt/experts/test_kt_experts_cpu.py tests/engines/kt/experts/test_kt_expert_deferral.py \
      tests/engines/kt/experts/test_decode_calls.py \
      tests/engines/lora/test_lora_outputs.py tests/engines/lora/test_guide_config.py \
      tests/engines/runtime/test_batch_invariance.py -k "not huggingface" \
      tests/engines/kt/families/deepseek_v32/test_kt_deepseek_v32.py::test_prompt_logprobs_with_kt_kernel_experts_match_transformers \
      tests/engines/kt/families/deepseek_v32/test_kt_deepseek_v32.py::test_streamed_text_equals_the_whole_reply || status=$?
  done
fi

if [ "$vllm_pass" = 1 ]; then
  if wait "$vllm_install"; then
    tail -n 1 "$vllm_log"
    run_vllm_tests "$@" || status=$?
  else
    cat "$vllm_log" >&2
    echo "installing vLLM into $vllm_venv failed (output above)" >&2
    status=1
  fi
  rm -f "$vllm_log"
fi
exit "$status"
