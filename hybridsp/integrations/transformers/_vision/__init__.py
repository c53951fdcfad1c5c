"""Vision-language models (Qwen2-VL, Qwen2.5-VL): ``model`` (what is switched), ``batch``
(``shard_vlm_batch``: 3-D positions, vision work per rank), ``generation`` (``generate_vlm``).
"""
