"""Completions from hybridsp's sharded generation inside TRL's own generate path (``"generation": "sharded"``).

With ``"generation": "sharded"`` in the ``"hybridsp"`` section, :class:`~hybridsp.integrations.trl.HybridGRPOTrainer`
and :class:`~hybridsp.integrations.trl.HybridRLOOTrainer` keep the policy switched during
generation and TRL's call ``unwrapped_model.generate(input_ids=, attention_mask=,
generation_config=)`` is answered by :func:`hybridsp.integrations.transformers.generate` on the
switched policy (:func:`sharded_generate`): the left-padded prompt is sharded over the context
group, the K/V cache stays sharded, and each new token is chosen on every rank and agreed
(Note [how the model runs] in :mod:`hybridsp.integrations.transformers._generation`). The call
returns what ``model.generate`` returns, ``[B, S + new]`` with finished rows padded, so TRL's
post-processing (the completion after the prompt columns, the mask after the first EOS, the
truncation to ``max_completion_length``) runs unchanged.

Note [generation settings]: TRL builds its generation settings from the config
(``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``cache_implementation``, ``generation_kwargs``). :func:`generate_options`
maps them onto hybridsp's ``generate``: ``do_sample``, ``temperature``, ``top_k`` (``0`` / None:
off), ``top_p``, ``max_new_tokens``, ``eos_token_id``, ``pad_token_id``; ``bos_token_id``,
``cache_implementation`` and ``disable_compile`` do not change the tokens and are ignored. Any
other setting must be neutral (``min_p=None``, ``repetition_penalty=1.0``, ``num_beams=1``,
``use_cache=True``, or transformers' default value); otherwise a ValueError names it (at construction, from the config, before any
collective; again at each generation, from TRL's settings, on every rank alike).

Note [the same draws]: sampling draws from torch's global generator, as ``model.generate``
does (one ``torch.multinomial`` over ``[B, V]`` per step). Every context rank of a replica was
seeded alike (``seed + dp_rank``), computes the same logits and takes the same number of steps
(the chosen tokens, hence the finished rows, are agreed every step), so the generators stay
equal on all of them; the token used is context rank 0's in any case.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from transformers import GenerationConfig

from hybridsp.integrations.transformers._generation import generate
from hybridsp.integrations.transformers._sampling import check_sampling
from hybridsp.mesh._hybrid_mesh import HybridMesh

MAPPED = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")
IGNORED = ("bos_token_id", "cache_implementation", "disable_compile")
NEUTRAL = {
    "min_p": (None,),
    "repetition_penalty": (None, 1.0),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "use_cache": (None, True),
}  # else transformers' default (None in transformers 5)


def config_settings(config) -> dict:
    """TRL's generation settings as its trainers build them from a ``GRPOConfig`` / ``RLOOConfig``
    (eos and pad come from the tokenizer later; Note [generation settings])."""
    settings = {
        "max_new_tokens": config.max_completion_length,
        "do_sample": True,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "min_p": config.min_p,
        "repetition_penalty": config.repetition_penalty,
        "cache_implementation": config.cache_implementation,
    }
    return {**settings, **dict(config.generation_kwargs or {})}


def generate_options(settings: dict, name: str) -> dict:
    """hybridsp ``generate`` keyword arguments for TRL's generation ``settings``; ValueError naming every
    setting it cannot honour (Note [generation settings]). No communication."""
    defaults = GenerationConfig()
    refused = []
    for key, value in sorted(settings.items()):
        if key in MAPPED or key in IGNORED:
            continue
        neutral = NEUTRAL.get(key, (getattr(defaults, key, object()),))
        if not any(value is choice or value == choice for choice in neutral):
            refused.append(f"{key}={value!r}")
    if refused:
        raise ValueError(
            f'{name} with "generation": "sharded" samples with temperature, top_k and top_p only; it cannot '
            f'honour {refused}: leave them at their defaults, or set "generation": "plain" in the hybridsp section'
        )
    options = {key: settings[key] for key in MAPPED if key in settings}
    options["top_k"] = options.get("top_k") or None  # TRL: 0 is off; hybridsp: None is off
    check_sampling(
        options.get("do_sample", False), options.get("temperature", 1.0), options["top_k"], options.get("top_p", 1.0)
    )  # ValueError quoting the value
    return options


def sharded_generate(policy: nn.Module, mesh: HybridMesh, options: dict, name: str):
    """A stand-in for ``model.generate(input_ids=, attention_mask=, generation_config=)`` that runs
    :func:`~hybridsp.integrations.transformers.generate` on the switched ``policy`` with ``options``."""

    def generate_sharded(input_ids=None, attention_mask=None, generation_config=None, **extras: Any):
        given = sorted(key for key, value in extras.items() if value is not None)
        if given:
            raise ValueError(f'{name} with "generation": "sharded" generates from text only; got {given}')
        return generate(policy, input_ids, mesh=mesh, attention_mask=attention_mask, **options)  # [B, S + new]

    return generate_sharded


@contextlib.contextmanager
def generating_sharded(model: nn.Module, policy: nn.Module, mesh: HybridMesh, options: dict, name: str) -> Iterator:
    """During the block ``model.generate`` (the object TRL unwraps for generation) is :func:`sharded_generate`;
    the class's method is back on exit (also on an exception)."""
    model.generate = sharded_generate(policy, mesh, options, name)
    try:
        yield
    finally:
        del model.generate
