"""Engines that run the target model behind one interface (base.py); open_engine starts the one named in config."""

from __future__ import annotations

from .base import Engine, EngineSettings


def open_engine(target_dir, settings: EngineSettings) -> Engine:
    """Start the engine named in config; import it only here so the rest never imports an engine library."""
    if settings.name == "transformers":
        from .transformers import TransformersEngine

        return TransformersEngine(target_dir, settings)
    if settings.name == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(target_dir, settings)
    raise ValueError(f"config key engine.name: unknown engine {settings.name!r}; use 'transformers' or 'vllm'")
