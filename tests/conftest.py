"""Test-session settings: what the distributed test workers inherit from the forkserver."""

import os

from hybridsp.testing import PRELOAD_ENV

# Importing transformers' model code and DeepSpeed costs several CPU seconds per process;
# the forkserver imports them once and every gloo worker of every test inherits them.
os.environ.setdefault(
    PRELOAD_ENV,
    ",".join([
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.qwen3.modeling_qwen3",
        "transformers.models.mistral.modeling_mistral",
        "deepspeed",
    ]),
)
