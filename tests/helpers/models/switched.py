"""Tiny fp32 Hugging Face causal LMs (sdpa) and one sharded forward + backward of a switched model:
what the transformers, tensor-parallel and DeepSpeed-tensor tests compare against the unmodified model."""

import torch
import torch.distributed as dist

from hybridsp import gather_sequence, shard_batch, sharded_cross_entropy
from hybridsp.integrations import transformers as hf
from tests.helpers.models.tiny import tiny_causal_lm

PAD = 0
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    pad_token_id=PAD,
    attn_implementation="sdpa",
)
FAMILIES = {  # (config class, model class, overrides); heads: H / H_kv
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),  # q/k/v bias
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
}


def build(family: str, seed: int = 0, **overrides):
    """A small fp32 causal LM of ``family`` with weights fixed by ``seed``."""
    return tiny_causal_lm(family, seed=seed, **{**COMMON, **FAMILIES[family][2], **overrides})


def make_batch(seq: int, lengths: tuple[int, ...], seed: int = 0) -> dict:
    """input_ids [B, S] (PAD after each row's length), labels = input_ids; a mask if any row is short."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (len(lengths), seq), generator=gen)
    mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": ids.masked_fill(mask == 0, PAD), "labels": ids.masked_fill(mask == 0, PAD)}
    return {**batch, "attention_mask": mask} if min(lengths) < seq else batch


def sharded(model, mesh, batch):
    """(gathered logits [B, S_pad, V], loss, {name: grad summed over the context group}, local valid count)."""
    model.zero_grad(set_to_none=True)
    local = shard_batch(batch, mesh, pad_token_id=PAD, sliding_window=hf.layout_window(model))
    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        hybridsp_documents=local["documents"],
        use_cache=False,
    )
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()
    names, params = zip(*model.named_parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=mesh.context_group)
    grads = dict(zip(names, (g.view_as(p) for g, p in zip(flat.split([p.numel() for p in params]), params))))
    valid = int((local["shift_labels"] != -100).sum())
    return gather_sequence(out.logits.detach(), mesh, cu_seqlens=local["documents"]), loss.detach(), grads, valid


def expected_of(model, batch):
    """(logits, loss, {name: grad}) of the unmodified single-process model."""
    mask = batch.get("attention_mask")
    labels = batch["labels"] if mask is None else batch["labels"].masked_fill(mask == 0, -100)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def shard_of(full: torch.Tensor, dim, mesh) -> torch.Tensor:
    """This tensor rank's slice of a full tensor along ``dim`` (None: replicated)."""
    return full if dim is None else full.chunk(mesh.tensor, dim=dim)[mesh.tensor_rank]
