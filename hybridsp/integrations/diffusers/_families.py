"""The diffusion transformers the switch knows: where their token streams are cut and gathered.

A family says, for one diffusers transformer class, how many tokens each stream has in a forward
(from the full inputs), which tensors carry a stream (a module's input, by argument name, or its
output, by index) and along which dim, which module's output is gathered, and which attention
processors it may hold. The cut points are those of the model's own ``_cp_plan`` in diffusers
0.42, except that Flux and Qwen-Image place text tokens by the same plan as image tokens (so that
pads and masked text never become visible keys: Note [pads as a document] in ``_plan``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, TypeGuard

import torch

Arguments = dict[str, Any]  # the transformer's forward arguments, bound by name


@dataclass(frozen=True)
class Cut:
    """``module``'s input ``arg`` (a name) or output ``arg`` (an index) carries ``stream`` along ``dim``.

    ``module`` is a dotted path below the transformer (``""``: the transformer itself), and may end
    in ``.*`` for every child of a list (``transformer_blocks.*``). ``ndim``: cut only a tensor of that many
    dimensions (Wan 2.2 TI2V's per-token time embeddings [B, L, D]; Wan 2.1's [B, D] is every token's)."""

    module: str
    arg: str | int
    stream: str
    dim: int
    ndim: int | None = None

    def applies(self, value: Any) -> TypeGuard[torch.Tensor]:
        return isinstance(value, torch.Tensor) and (self.ndim is None or value.ndim == self.ndim)


@dataclass(frozen=True)
class Family:
    """One transformer class: its streams in joint order, cuts, gathered output, processors."""

    model: str
    streams: tuple[str, ...]
    cuts: tuple[Cut, ...]
    gather: str  # the module whose output [B, L_img, F] is gathered
    processors: tuple[str, ...]
    tokens: Callable[[Any, Arguments], dict[str, torch.Tensor]]  # (model, args) -> {stream: [T] bool, True: place}
    check: Callable[[Any], None] = lambda model: None
    mask_arg: str | None = None  # the forward's text-mask argument (rows may differ: Note [rows with different masks])


def _all(count: int, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(count, dtype=torch.bool, device=like.device)


def _wan_tokens(model: Any, args: Arguments) -> dict[str, torch.Tensor]:
    hidden, timestep = args["hidden_states"], args["timestep"]  # [B, C, F, H, W], [B] or [B, L] (Wan 2.2 TI2V)
    patch = model.config.patch_size
    count = (hidden.shape[2] // patch[0]) * (hidden.shape[3] // patch[1]) * (hidden.shape[4] // patch[2])
    if timestep is not None and timestep.ndim == 2 and timestep.shape[1] != count:
        raise ValueError(
            f"per-token timesteps of {timestep.shape[1]} tokens for a latent of {count} tokens: pass one timestep "
            "per latent token (Wan 2.2 TI2V) or one per row"
        )
    return {"img": _all(count, hidden)}


def _text_mask(mask: torch.Tensor | None, count: int, like: torch.Tensor) -> torch.Tensor:
    """[T] bool from a [B, T] text mask that every row shares (None: every token)."""
    if mask is None:
        return _all(count, like)
    rows = mask.bool()
    if not bool((rows == rows[:1]).all()):
        raise ValueError("rows with different text masks reached the token plan (the switch runs them row by row)")
    if not bool(rows[0].any()):
        raise ValueError("the text mask hides every text token; keep at least one")
    return rows[0]


def _joint_tokens(mask_arg: str | None) -> Callable[[Any, Arguments], dict[str, torch.Tensor]]:
    def tokens(model: Any, args: Arguments) -> dict[str, torch.Tensor]:
        hidden, text = args["hidden_states"], args["encoder_hidden_states"]  # [B, T_img, C], [B, T_txt, D]
        for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if args.get(name) is not None:
                raise ValueError(f"{name} are not supported by the switch; run the ControlNet without it")
        mask = args.get(mask_arg) if mask_arg else None
        return {"txt": _text_mask(mask, text.shape[1], text), "img": _all(hidden.shape[1], hidden)}

    return tokens


FAMILIES = {
    family.model: family
    for family in (
        Family(
            model="WanTransformer3DModel",
            streams=("img",),
            cuts=(
                Cut("rope", 0, "img", 1),
                Cut("rope", 1, "img", 1),
                Cut("condition_embedder", 0, "img", 1, ndim=3),  # temb [B, L, D] of per-token timesteps
                Cut("condition_embedder", 1, "img", 1, ndim=3),  # timestep_proj [B, L, 6 D]
                Cut("blocks.0", "hidden_states", "img", 1),
            ),
            gather="proj_out",
            processors=("WanAttnProcessor",),
            tokens=_wan_tokens,
        ),
        Family(
            model="FluxTransformer2DModel",
            streams=("txt", "img"),
            cuts=(
                Cut("", "hidden_states", "img", 1),
                Cut("", "encoder_hidden_states", "txt", 1),
                Cut("", "img_ids", "img", -2),
                Cut("", "txt_ids", "txt", -2),
            ),
            gather="proj_out",
            processors=("FluxAttnProcessor",),
            tokens=_joint_tokens(None),
        ),
        Family(
            model="QwenImageTransformer2DModel",
            streams=("txt", "img"),
            cuts=(
                Cut("transformer_blocks.0", "hidden_states", "img", 1),
                Cut("transformer_blocks.0", "encoder_hidden_states", "txt", 1),
                Cut("transformer_blocks.*", "encoder_hidden_states_mask", "txt", 1),
                Cut("transformer_blocks.*", "modulate_index", "img", 1),  # zero_cond_t: [B, L_img] per token
                Cut("pos_embed", 0, "img", 0),
                Cut("pos_embed", 1, "txt", 0),
            ),
            gather="proj_out",
            processors=("QwenDoubleStreamAttnProcessor2_0",),
            tokens=_joint_tokens("encoder_hidden_states_mask"),
            mask_arg="encoder_hidden_states_mask",
        ),
    )
}


def family_of(model: Any) -> Family:
    """The family of ``model`` (by class, not by name of the checkpoint), or ValueError."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise ValueError(
        f"{type(model).__name__} is not a transformer the diffusers switch knows; supported: {sorted(FAMILIES)}"
    )


def bind(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``module.forward``'s arguments by name (defaults applied), to read and replace them."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound
