"""The ``"generation"`` option of the ``"hybridsp"`` section and the mapping of TRL's generation settings.

No processes: the section's validation, TRL's settings mapped onto hybridsp's ``generate`` (and
what it refuses, with a ValueError naming the setting), and the trainers' refusal at construction
(before TRL's constructor, so before any collective). The sharded generation itself is checked
against the plain ``GRPOTrainer`` in tests/integrations/trl/test_rl_trainers.py.
"""

import pytest

pytest.importorskip("trl", reason="TRL is optional: pip install -e '.[trl]' (the test extra installs it)")

from hybridsp.integrations.deepspeed._config import HybridConfig  # noqa: E402
from hybridsp.integrations.trl._generation import config_settings, generate_options  # noqa: E402

pytestmark = pytest.mark.integration


def test_the_section_takes_plain_or_sharded_generation():
    assert HybridConfig.from_ds_config({"hybridsp": {"ulysses": 2}}).generation == "plain"
    assert HybridConfig.from_ds_config({"hybridsp": {"ulysses": 2, "generation": "sharded"}}).generation == "sharded"
    with pytest.raises(ValueError, match=r"unknown generation 'beam'.*'plain', 'sharded'"):
        HybridConfig.from_ds_config({"hybridsp": {"generation": "beam"}})


def _config(**overrides):
    from trl import GRPOConfig

    settings = dict(
        output_dir="unused",
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=7,
    )
    return GRPOConfig(**{**settings, **overrides})


def test_trl_settings_map_onto_hybridsp_generate():
    options = generate_options(config_settings(_config(temperature=0.7, top_k=5, top_p=0.9)), "T")
    assert options == {"max_new_tokens": 7, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    defaults = generate_options(
        {
            **config_settings(_config()),
            "eos_token_id": [2, 3],
            "pad_token_id": 0,
            "bos_token_id": 1,
            "disable_compile": True,
        },
        "T",
    )
    assert defaults["top_k"] is None and defaults["eos_token_id"] == [2, 3] and defaults["pad_token_id"] == 0
    greedy = generate_options(config_settings(_config(generation_kwargs={"do_sample": False, "use_cache": True})), "T")
    assert greedy["do_sample"] is False


@pytest.mark.parametrize(
    "overrides, quoted",
    [
        ({"min_p": 0.1}, "min_p=0.1"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
        ({"generation_kwargs": {"num_beams": 2}}, "num_beams=2"),
    ],
)
def test_settings_the_sharded_generation_cannot_honour_are_refused(overrides, quoted):
    with pytest.raises(ValueError, match=rf"HybridGRPOTrainer .*cannot honour .*{quoted}.*\"generation\": \"plain\""):
        generate_options(config_settings(_config(**overrides)), "HybridGRPOTrainer")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        generate_options(config_settings(_config(temperature=0.0)), "HybridGRPOTrainer")


def test_the_trainer_refuses_them_at_construction(tmp_path):
    """Before TRL's constructor: no model is loaded, no process group is needed."""
    from hybridsp.integrations.trl import HybridGRPOTrainer

    section = {"ulysses": 2, "generation": "sharded"}
    args = _config(
        min_p=0.05,
        deepspeed={"hybridsp": section, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}},
    )
    with pytest.raises(ValueError, match=r"cannot honour \['min_p=0.05'\]"):
        HybridGRPOTrainer(model="unused", reward_funcs=[], args=args)
    args = _config(
        deepspeed={
            "hybridsp": {**section, "layout": "balanced"},
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": 2},
        }
    )
    with pytest.raises(ValueError, match='layout="balanced" cannot place'):
        HybridGRPOTrainer(model="unused", reward_funcs=[], args=args)
