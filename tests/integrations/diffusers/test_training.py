"""Training and sampling through the diffusers switch equal one process (tiny Wan, fp32).

FSDP2: torch's ``fully_shard`` over the whole world (the parameters really are sharded), three
flow-matching AdamW steps, losses and final parameters against the unmodified transformer on one
process. Sampling: four Euler steps of diffusers' ``FlowMatchEulerDiscreteScheduler`` (a loop over
the transformer; no pipeline, so no text encoder or VAE) switched against unswitched.
"""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.preload import preload
from tests.helpers.workers.diffusion_training import fsdp2_trajectory, one_process_trajectory, sampling

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
