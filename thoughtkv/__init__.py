"""thoughtkv: trace collector + discrete-event memory-hierarchy simulator for reasoning-LLM KV caches.

This package is the top layer: the `thoughtkv` command dispatcher, the demo and the crosscheck orchestration.
Nothing imports it. The shared error type and version live at the bottom, in `thoughtkv_base`.
"""

from thoughtkv_base import __version__

__all__ = ["__version__"]
