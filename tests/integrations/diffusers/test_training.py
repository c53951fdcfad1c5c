"""Training and sampling through the diffusers switch equal one process (tiny Wan, fp32).

FSDP2: torch's ``fully_shard`` over the whole world (the parameters really are sharded), three
flow-matching AdamW steps, losses and final parameters against the unmodified transformer on one
process. DeepSpeed ZeRO-2 and ZeRO-3 (U = 2, through ``hybridsp.integrations.deepspeed.initialize``
with the switch as its attention switch) against DeepSpeed on one process. Sampling: four Euler steps of diffusers' ``FlowMatchEulerDiscreteScheduler`` (a loop over
the transformer; no pipeline, so no text encoder or VAE) switched against unswitched.
"""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.preload import preload
from tests.helpers.workers.diffusion_training import (
    deepspeed_trajectory,
    fsdp2_trajectory,
    one_process_trajectory,
    sampling,
)

pytest.importorskip("diffusers")
pytestmark = [pytest.mark.distributed, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _preload():
    preload("diffusers", "diffusers.models.transformers.transformer_wan")


def test_fsdp2_flow_matching_steps_equal_one_process():
    ref_losses, ref_params = one_process_trajectory(3)
    for losses, params, sharded in run_distributed(fsdp2_trajectory, 2, 2, 1, 3, timeout=800):
        assert sharded, "fully_shard left a parameter whole"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_sampling_loop_equals_the_unswitched_latents():
    for plain, switched in run_distributed(sampling, 2, 1, 2, 4, timeout=800):
        torch.testing.assert_close(switched, plain, rtol=1e-5, atol=1e-5)


def test_deepspeed_zero2_and_zero3_flow_matching_steps_equal_one_process(tmp_path):
    # The reference is DeepSpeed on one process: its ZeRO optimizer's third step differs from a plain
    # torch AdamW by ~1e-4 even without any sharding (world 1), so plain torch is not the reference here.
    preload("deepspeed")
    ref_losses, ref_params = run_distributed(deepspeed_trajectory, 1, 2, 3, str(tmp_path / "one"), timeout=800)[0]
    for stage in (2, 3):
        for losses, params in run_distributed(
            deepspeed_trajectory, 2, stage, 3, str(tmp_path / f"z{stage}"), timeout=800
        ):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            torch.testing.assert_close(params, ref_params, rtol=1e-5, atol=1e-6)
