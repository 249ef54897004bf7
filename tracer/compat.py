"""What differs between the transformers versions the tracer runs on, in one place.

The KV cache's keyword: models take it as `cache` in transformers >= 5.2x and as `past_key_values` before (5.17,
the lent GPU machines' image, tests/gpu/README.md). Passed under the other name the model would ignore it,
silently, and build a DynamicCache of its own; every caller passes it through `cache_kwargs`.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The keyword under which `model_class.forward` takes the KV cache: `cache` in transformers >= 5.2x,
    `past_key_values` before (5.17, the lent GPU machines' image). Passed under the other name, the cache would
    be ignored, silently: the model would build a DynamicCache of its own. Read from the signature, once per
    model class; `generate` takes the cache under the same name."""
    parameters = inspect.signature(model_class.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes neither `cache` nor `past_key_values`: this transformers "
                    "version is not supported (install transformers >= 5.17)")


def cache_kwargs(model, cache) -> dict:
    """`{keyword: cache}` for `model(...)` or `model.generate(...)`, under the name this transformers expects."""
    return {cache_keyword(type(model)): cache}
