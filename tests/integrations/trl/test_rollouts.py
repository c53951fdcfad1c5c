"""The pieces of the RL trainers that need no training run: right-aligned scoring rows against TRL's own
per-token log-probs, the replica view of the accelerator, and the refusals at construction."""

import pytest
import torch

pytest.importorskip("trl", reason="TRL is optional: pip install -e '.[trl]' (the test extra installs it)")

from hybridsp.testing import run_distributed  # noqa: E402

pytestmark = pytest.mark.integration


def _trl_rows(batch: int = 3, prompt: int = 7, completion: int = 6, seed: int = 0):
    """TRL's layout: prompts left-padded, completions right-padded; B x (P + C) ids and mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (batch, prompt + completion), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(batch):
        lead = int(torch.randint(0, prompt, (1,), generator=generator))  # at least one real prompt token
        tail = int(torch.randint(0, completion, (1,), generator=generator))
        mask[row, :lead] = 0
        mask[row, prompt + completion - tail :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_right_aligned_rows_keep_trls_completion_log_probs():
    """Per row: the rolled row's log-probs read through ``index`` equal TRL's log_probs[:, -C:] on the
    original row (the model alone, fp32: RoPE sees positions shifted by the row's padding, equal up to
    rounding), on every real completion token; the labels score exactly the completion's real tokens."""
    from trl.trainer.utils import add_fused_lm_head

    from hybridsp.integrations.trl._rollouts import right_aligned
    from tests.helpers.workers.trainer import tiny_llama

    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, mask = _trl_rows()
    completion = 6
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion] = -100
    plain = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    rolled, rolled_mask, rolled_labels, index = right_aligned(ids, mask, completion)
    assert bool((rolled_mask[:, 1:] <= rolled_mask[:, :-1]).all())  # right padding only
    assert int((rolled_labels != -100).sum()) == int(mask[:, -completion:].sum())
    ours = model(input_ids=rolled, attention_mask=rolled_mask, labels=rolled_labels, fused_lm_head=True)
    real = mask[:, -completion:].bool()  # [B, C]
    for field in ("log_probs", "entropy"):
        expected = getattr(plain, field)[:, -completion:][real]
        got = getattr(ours, field).gather(1, index)[real]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_right_aligned_refuses_a_row_without_a_prompt_token():
    from hybridsp.integrations.trl._rollouts import right_aligned

    ids, mask = _trl_rows()
    mask[1, :7] = 0
    with pytest.raises(ValueError, match="row 1 has no real prompt token"):
        right_aligned(ids, mask, 6)


def _construction_checks(rank, world_size):
    """On 2 ranks (U2, one replica): the replica view's counts and gathers, and what the trainer refuses
    before TRL's constructor runs."""
    import tempfile

    from trl import GRPOConfig

    from hybridsp import init_mesh
    from hybridsp.integrations.trl import HybridGRPOTrainer
    from hybridsp.integrations.trl._rollouts import ReplicaAccelerator
    from tests.helpers.workers.trainer import ds_config, tiny_llama

    mesh = init_mesh(ulysses=2, ring=1)

    class Plain:
        process_index, num_processes, device = rank, world_size, "cpu"

    view = ReplicaAccelerator(Plain(), mesh)
    gathered = view.gather(torch.tensor([1.0, 2.0]))  # one replica: its values once, not twice
    summed = view.reduce(torch.tensor([3.0]))
    padded = view.pad_across_processes(torch.ones(2), pad_index=-1)
    found = {
        "index": view.process_index,
        "count": view.num_processes,
        "device": view.device,
        "gathered": gathered.tolist(),
        "summed": summed.tolist(),
        "padded": padded.tolist(),
    }
    errors = []
    with tempfile.TemporaryDirectory(prefix=f"rl-checks{rank}-") as out:
        settings = dict(
            output_dir=out,
            report_to=[],
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            deepspeed=ds_config(2, 1, 2, False),
        )
        for config, extra in (
            (dict(per_device_train_batch_size=3, num_generations=2), {}),
            (dict(per_device_train_batch_size=2, num_generations=2), {"tools": [len]}),
        ):
            try:
                HybridGRPOTrainer(
                    model=tiny_llama(), reward_funcs=[len], args=GRPOConfig(**settings, **config), **extra
                )
            except ValueError as error:
                errors.append(str(error))
    return {**found, "errors": errors}


@pytest.mark.distributed
def test_replica_view_and_refusals_before_any_collective():
    results = run_distributed(_construction_checks, 2, timeout=300)
    for result in results:
        assert (result["index"], result["count"], result["device"]) == (0, 1, "cpu")
        assert result["gathered"] == [1.0, 2.0] and result["summed"] == [3.0] and result["padded"] == [1.0, 1.0]
        assert len(result["errors"]) == 2, result["errors"]
        assert "per_device_train_batch_size=3 x 1 replicas x steps_per_generation=1 = 3" in result["errors"][0]
        assert "num_generations=2" in result["errors"][0]
        assert "['tools']" in result["errors"][1]
