"""Choosing the MLA attention backend and switching prefix caching off: the settings, the flags, and what
the ktransformers engine does with them on a machine without a GPU."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import start_server
from engines.base import engine_options
from engines.kt.options import KTOptions
from tests.helpers import require_kt_kernel
from server.cli import _cli_overrides, _serve_parser, main
from server.settings import SettingsError, load_settings


def parse(*flags: str):
    import argparse

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return load_settings(None, _cli_overrides(parser.parse_args(["serve", *flags])), env={})


def kt_options(settings) -> KTOptions:
    """What the ktransformers engine reads from these settings."""
    return engine_options(KTOptions, settings.engine_config("/m").settings)


def test_prefix_caching_is_on_by_default_and_the_flag_turns_it_off():
    assert parse().prefix_cache is True
    assert parse("--no-prefix-cache").prefix_cache is False
    assert kt_options(parse("--no-prefix-cache")).prefix_cache is False


def test_prefix_caching_can_be_turned_off_from_the_environment():
    assert load_settings(None, env={"KTSERVE_PREFIX_CACHE": "false"}).prefix_cache is False


def test_the_attention_backend_flag_reaches_the_engine_config():
    assert parse().attention_backend == "auto"
    assert kt_options(parse("--attention-backend", "torch")).attention_backend == "torch"


def test_an_unknown_attention_backend_names_the_key():
    with pytest.raises(SettingsError, match="attention_backend"):
        load_settings(None, env={"KTSERVE_ATTENTION_BACKEND": "triton"})
    with pytest.raises(SystemExit):
        main(["serve", "--attention-backend", "triton"])


def test_auto_chooses_torch_without_a_gpu_and_says_why():
    from engines.kt.families.deepseek_mla.flashinfer import choose_backend

    backend, why = choose_backend("auto", [torch.device("cpu")], 512, 64)
    assert backend == "torch" and "CPU" in why


def test_flashinfer_asked_for_where_it_cannot_run_is_an_error_naming_the_key():
    from engines.kt.families.deepseek_mla.flashinfer import choose_backend

    with pytest.raises(ValueError, match="attention_backend: flashinfer cannot run here"):
        choose_backend("flashinfer", [torch.device("cpu")], 512, 64)


def test_the_engine_logs_and_reports_which_attention_runs(demo_model_dir, caplog):
    require_kt_kernel()
    with caplog.at_level(logging.INFO, logger="ktserve.engine.kt"):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16")
        try:
            details = running.http().get("/version").json()["engine_details"]
        finally:
            running.stop()
    assert any("MLA attention: torch (attention runs on the CPU" in r.getMessage() for r in caplog.records)
    assert details["attention_backend"] == "torch"


def test_the_engine_refuses_to_start_with_flashinfer_on_the_cpu(demo_model_dir):
    require_kt_kernel()
    with pytest.raises(RuntimeError, match="attention_backend: flashinfer cannot run here"):
        start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", attention_backend="flashinfer")
