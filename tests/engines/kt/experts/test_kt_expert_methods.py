"""Choosing the experts method (engines/kt/experts/methods.py) from what this CPU's kt-kernel build runs.

The avx2 build is what an AMD EPYC Rome/Milan or an older Xeon loads; `KT_KERNEL_CPU_VARIANT=avx2` forces
it on any x86-64 machine, so these tests check the non-AMX path wherever CI runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import require_kt_kernel
from tests.ops_support import ServerProcess, child_pythonpath

require_kt_kernel()

from engines.kt.experts.methods import (  # noqa: E402
    ExpertsUnsupportedError, available_methods, choose_method, cpu_variant, normalize_method)

AVX2 = {"KT_KERNEL_CPU_VARIANT": "avx2"}


def choices_on_avx2(*calls: str) -> list:
    """Run choose_method(...) calls (Python argument text) under the avx2 build; their results or errors."""
    code = ("import json\nfrom engines.kt.experts.methods import choose_method\nout = []\n"
            + "".join(f"try:\n    c = choose_method({call})\n    out.append([c.method, c.reason])\n"
                      f"except ValueError as e:\n    out.append(['error', str(e)])\n" for call in calls)
            + "print(json.dumps(out))\n")
    env = {**os.environ, **AVX2, "PYTHONPATH": child_pythonpath()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rule_method_this_build_runs_is_kept():
    method = available_methods()[0]
    assert choose_method(method) == choose_method(method, explicit=None)
    assert choose_method(method).method == method and choose_method(method).reason == ""


@pytest.mark.parametrize(("spelling", "method"), [("AMXInt8", "AMXINT8"), ("amxint4", "AMXINT4"), ("AMXBF16", "BF16"),
                                                 ("llamafile", "LLAMAFILE"), ("fp8", "FP8"), ("RAWINT4", "RAWINT4")])
def test_methods_are_understood_as_kt_kernel_and_ktransformers_spell_them(spelling, method):
    assert normalize_method(spelling, "kt_method") == method


def test_an_unknown_method_names_the_key_and_the_known_ones():
    with pytest.raises(ExpertsUnsupportedError, match="kt_method 'INT3' is not an experts method; known: AMXINT8"):
        choose_method(None, explicit="INT3")


def test_on_avx2_rule_methods_fall_back_to_the_fastest_replacement_and_say_why():
    int8, int4, bf16, llamafile = choices_on_avx2("'AMXINT8'", "'AMXINT4'", "'BF16'", "'LLAMAFILE'")
    assert int8[0] == "BF16" and "AMXINT8" in int8[1] and "avx2" in int8[1] and "fastest" in int8[1]
    assert int4[0] == "RAWINT4"
    assert bf16 == ["BF16", ""] and llamafile == ["LLAMAFILE", ""]


def test_on_avx2_an_8_bit_rule_keeps_8_bits_when_bf16_experts_would_not_fit_in_memory():
    shape = "ExpertShape(7168, 2048, 10 ** 15)"  # a petabyte of bf16 experts; 8 bits still too big: most compact
    [(method, reason)] = choices_on_avx2(f"'AMXINT8', shape=__import__('engines.kt.experts.methods', "
                                         f"fromlist=['x']).{shape}")
    assert method in ("LLAMAFILE", "FP8") and "none fits in memory" in reason


def test_on_avx2_a_replacement_must_fit_the_model_sizes():
    # V2-Lite: intermediate 1408 is no multiple of LLAMAFILE's 256, so the compact 8-bit choice is FP8
    [(method, _)] = choices_on_avx2("'AMXINT8', shape=__import__('engines.kt.experts.methods', "
                                    "fromlist=['x']).ExpertShape(2048, 1408, 10 ** 15)")
    assert method == "FP8"


def test_on_avx2_an_explicit_kt_method_it_cannot_run_is_an_error_naming_key_build_and_choices():
    [(kind, message)] = choices_on_avx2("None, explicit='AMXINT8'")
    assert kind == "error"
    assert message.startswith("kt_method AMXINT8:") and "avx2 build" in message
    assert "BF16, FP8, RAWINT4, LLAMAFILE" in message


@pytest.fixture(scope="module")
def avx2_server():
    server = ServerProcess("--log-format", "json", env=AVX2)  # no model, no flags: the README's serve command
    try:
        server.wait_healthy()
        yield server
    finally:
        server.kill()


def test_with_no_flags_the_avx2_build_serves_chat(avx2_server):
    import openai

    client = openai.OpenAI(base_url=avx2_server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(model="ktserve-demo", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_the_fallback_is_shown_in_version_and_logged_once(avx2_server):
    import httpx

    details = httpx.get(avx2_server.url + "/version", timeout=10).json()["engine_details"]
    assert details["cpu_variant"] == "avx2"
    assert (details["experts_method"], details["experts_method_requested"]) == ("BF16", "AMXINT8")
    warnings = [line for line in avx2_server.lines if "replacement it runs" in line]
    assert len(warnings) == 1 and "DeepSeek-CPU.yaml" in warnings[0] and "avx2" in warnings[0]


def test_an_explicit_method_the_build_cannot_run_stops_start_up_naming_the_key():
    server = ServerProcess("--kt-method", "AMXINT8", env=AVX2)
    try:
        assert server.wait(timeout=300) != 0
    finally:
        server.kill()
    assert any("kt_method AMXINT8" in line and "avx2" in line for line in server.lines), server.lines[-5:]


def test_this_machine_reports_the_build_it_loaded():
    assert cpu_variant() in ("amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2")
