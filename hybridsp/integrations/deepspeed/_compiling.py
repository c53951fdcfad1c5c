"""The ``"compile"`` section of a DeepSpeed config: ``torch.compile`` of the engine at ``initialize``.

DeepSpeed documented the section as ``"compile": {"enabled": true, "backend": "inductor",
"kwargs": {...}}``; DeepSpeed 0.19 keeps only DeepCompile's keys there (``deepcompile``, ``passes``,
offload switches: any other key is refused) and compiles only when the caller runs
``engine.compile()``. :func:`hybridsp.integrations.deepspeed.initialize` reads the three keys
(:func:`compile_settings`), hands DeepSpeed the rest (:func:`without_compile_keys`), and calls
``engine.compile(backend, compile_kwargs)`` when ``enabled`` is true. The switched attention is one
custom operator in the graph (Note [compiled call] in :mod:`hybridsp.attention._compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SECTION = "compile"
OUR_KEYS = ("enabled", "backend", "kwargs")


@dataclass(frozen=True)
class CompileSettings:
    """Whether ``initialize`` compiles the engine, with which backend (None: DeepSpeed's default for the
    accelerator, inductor on CPU and CUDA) and ``torch.compile`` keyword arguments."""

    enabled: bool = False
    backend: str | None = None
    kwargs: dict = field(default_factory=dict)

    def apply(self, engine) -> None:
        """``engine.compile(...)`` when enabled."""
        if not self.enabled:
            return
        if self.backend is None:
            engine.compile(compile_kwargs=dict(self.kwargs))
        else:
            engine.compile(backend=self.backend, compile_kwargs=dict(self.kwargs))


def compile_settings(config: dict) -> CompileSettings:
    """The :class:`CompileSettings` of a DeepSpeed config dict; ValueError for values of the wrong type."""
    section = config.get(SECTION, {})
    if not isinstance(section, dict):
        raise ValueError(f'"compile" must be a JSON object such as {{"enabled": true}}; got {section!r}')
    enabled, backend, kwargs = section.get("enabled", False), section.get("backend"), section.get("kwargs", {})
    if not isinstance(enabled, bool):
        raise ValueError(f'"compile.enabled" must be true or false; got {enabled!r}')
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f'"compile.backend" must name a torch.compile backend such as "inductor"; got {backend!r}')
    if not isinstance(kwargs, dict):
        raise ValueError(f'"compile.kwargs" must be a JSON object of torch.compile arguments; got {kwargs!r}')
    return CompileSettings(enabled, backend, kwargs)


def without_compile_keys(config: dict) -> dict:
    """``config`` without the keys :func:`compile_settings` reads (a section left empty goes too)."""
    section = config.get(SECTION)
    if not isinstance(section, dict):
        return config
    rest = {key: value for key, value in section.items() if key not in OUR_KEYS}
    cleaned = {key: value for key, value in config.items() if key != SECTION}
    return {**cleaned, SECTION: rest} if rest else cleaned
