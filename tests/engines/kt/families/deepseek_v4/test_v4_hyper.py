"""The switch of DeepSeek-V4's fused hyper-connection kernel (kt_fused_hyper_connections) on a machine without a
GPU: the setting reaches the engine, and what it leaves in place is transformers' forward, said in the details.
The kernel itself is checked on a GPU (tests/engines/kt/families/deepseek_v4/test_v4_hyper_gpu.py)."""
from __future__ import annotations

import torch

from engines.base import engine_options
from engines.kt.families.deepseek_v4.hyper import install_fused_hyper_connections, is_fused, norm_eps
from engines.kt.options import KTOptions
from server.settings import load_settings


def _tiny_connections(**config_kwargs) -> torch.nn.Module:
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    config = DeepseekV4Config(hidden_size=8, **config_kwargs)
    return torch.nn.ModuleDict({"attn_hc": DeepseekV4HyperConnection(config), "hc_head": DeepseekV4HyperHead(config)})


def test_the_fused_hyper_connections_are_on_by_default_and_the_environment_turns_them_off():
    def options(env):
        return engine_options(KTOptions, load_settings(None, env=env).engine_config("/m").settings)

    assert options({}).kt_fused_hyper_connections is True
    assert options({"KTSERVE_KT_FUSED_HYPER_CONNECTIONS": "false"}).kt_fused_hyper_connections is False


def test_turned_off_the_hyper_connections_keep_transformers_forward_and_the_details_say_so():
    model = _tiny_connections()
    described = install_fused_hyper_connections(model, torch.bfloat16, enabled=False)
    assert described == "transformers' modules: kt_fused_hyper_connections is off"
    assert not any(is_fused(m) for m in model.values())



def test_the_fused_kernel_takes_the_norm_epsilon_from_the_installed_transformers_modules():
    # transformers 5.25 renamed the unweighted RMSNorm's `eps` to `variance_epsilon`: reading the old name made the
    # kernel's warm-up fail on the GPU, and transformers' modules served instead
    model = _tiny_connections(rms_norm_eps=3e-4)
    assert [norm_eps(m.input_norm) for m in model.values()] == [3e-4, 3e-4]
