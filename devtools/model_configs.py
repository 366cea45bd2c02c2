"""Model configurations shared by the transformers tests, examples and benchmarks.

No weights can be downloaded in this project's environments, so the examples, GPU tests and the
end-to-end benchmark build models from real architecture configurations with random weights drawn
from a fixed seed. The shapes (hidden size, heads, KV heads, head_dim, intermediate size,
vocabulary) are those of the public checkpoints, which is what matters for attention performance
and for exercising the kernel's GQA and head_dim paths.

* ``"qwen2-0.5b"``: Qwen2-0.5B (24 layers, 14 heads, 2 KV heads, head_dim 64).
* ``"llama-3.2-1b"``: Llama-3.2-1B (16 layers, 32 heads, 8 KV heads, head_dim 64, llama3 RoPE).
* ``"llama-2-7b"``: Llama-2-7B shapes (32 heads, 32 KV heads, head_dim 128), 2 layers by default.
* ``"gemma-3-1b"``: Gemma-3-1B text shapes (4 heads, 1 KV head, head_dim 256; sliding and full
  attention layers), 2 layers by default.
* ``"phi-3-mini"``: Phi-3-mini shapes (32 heads, head_dim 96), 2 layers by default.
* ``"phi-2"``: Phi-2 shapes (32 heads, head_dim 80, partial rotary 0.4, LayerNorm), 2 layers.

:data:`TINY_CONFIGS` are two-layer models small enough for CPU unit tests: Llama, Qwen2, Qwen3 and
Mistral with head_dim 64, and Gemma 3, Phi-3 and Phi-2 with their real head dims (256, 96, 80).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, Optional, Union

import torch

__all__ = [
    "REALISTIC_CONFIGS",
    "TINY_CONFIGS",
    "build_random_model",
    "load_model",
    "make_config",
]

# Random weights and no tokenizer: no special token ids (transformers would otherwise pick the
# checkpoint's defaults, which mean nothing for these models).
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Keyword arguments of the transformers config classes, keyed by a short name. "model_type"
# selects the config class (transformers.AutoConfig.for_model).
REALISTIC_CONFIGS: Dict[str, Dict[str, Any]] = {
    "qwen2-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        hidden_act="silu",
        **_NO_SPECIAL_TOKENS,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        hidden_act="silu",
        **_NO_SPECIAL_TOKENS,
    ),
    "llama-2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        **_NO_SPECIAL_TOKENS,
    ),
    "gemma-3-1b": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=6912,
        vocab_size=262144,
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
        sliding_window=512,
        # The real model repeats 5 sliding layers and 1 full one; 2 layers keep one of each
        # (make_config rebuilds the list for another layer count: gemma3_layer_types).
        layer_types=["sliding_attention", "full_attention"],
        rms_norm_eps=1e-6,
        **_NO_SPECIAL_TOKENS,
    ),
    "phi-3-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        vocab_size=32064,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        **_NO_SPECIAL_TOKENS,
    ),
    "phi-2": dict(
        model_type="phi",
        hidden_size=2560,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=10240,
        vocab_size=51200,
        max_position_embeddings=2048,
        partial_rotary_factor=0.4,
        **_NO_SPECIAL_TOKENS,
    ),
}

_TINY_COMMON = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=256,
    vocab_size=128,
    max_position_embeddings=512,
    hidden_act="silu",
    **_NO_SPECIAL_TOKENS,
)

TINY_CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": dict(model_type="llama", **_TINY_COMMON),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False, **_TINY_COMMON),
    "qwen3": dict(model_type="qwen3", **_TINY_COMMON),
    # Mistral keeps its default sliding window (4096): longer than any test prompt, so the
    # masks it builds are plain causal + padding masks.
    "mistral": dict(model_type="mistral", **_TINY_COMMON),
    # The head dims of Gemma 3 (256), Phi-3 (96) and Phi-2 (80), which the kernels run on the
    # tails of their 256 / 128 buckets.
    "gemma3": dict(model_type="gemma3_text", **{**_TINY_COMMON, "head_dim": 256},
                   query_pre_attn_scalar=256, sliding_window=512,
                   layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(model_type="phi3", **{**_TINY_COMMON, "hidden_size": 192, "head_dim": 96,
                                       "num_key_value_heads": 2}),
    "phi": dict(model_type="phi", **{**_TINY_COMMON, "hidden_size": 160, "head_dim": 80,
                                     "num_key_value_heads": 2}, partial_rotary_factor=0.4),
}


def _register_attention() -> None:
    """Register ``"flash_attention_sm75"`` with transformers (importing the integration does)."""
    from flash_attention_sm75.integrations import transformers as _hf

    _hf.register()


def gemma3_layer_types(num_layers: int) -> list:
    """Gemma 3's attention pattern for ``num_layers`` layers: every sixth layer full, the others
    sliding-window, and the last layer full when there are fewer than six (so that a cut-down
    model still has both kinds)."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(num_layers)]
    if num_layers and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def make_config(name: str, num_hidden_layers: Optional[int] = None, **overrides: Any):
    """Build a transformers config from one of the named configurations.

    Parameters
    ----------
    name : str
        A key of :data:`REALISTIC_CONFIGS` (``"qwen2-0.5b"``, ``"llama-3.2-1b"``,
        ``"llama-2-7b"``, ``"gemma-3-1b"``, ``"phi-3-mini"``, ``"phi-2"``) or of
        :data:`TINY_CONFIGS` (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``,
        ``"gemma3"``, ``"phi3"``, ``"phi"``).
    num_hidden_layers : int, optional
        Override the number of decoder layers (e.g. a few layers of a big model for fast tests).
        Gemma 3's per-layer attention kinds follow (:func:`gemma3_layer_types`).
    **overrides
        Any other config attribute to override.

    Returns
    -------
    transformers.PretrainedConfig
        A config of the model family's own class (``LlamaConfig``, ``Qwen2Config``, ...).

    Raises
    ------
    KeyError
        If ``name`` is not a known configuration.
    """
    from transformers import AutoConfig

    if name in REALISTIC_CONFIGS:
        kwargs = copy.deepcopy(REALISTIC_CONFIGS[name])
    elif name in TINY_CONFIGS:
        kwargs = copy.deepcopy(TINY_CONFIGS[name])
    else:
        known = sorted(REALISTIC_CONFIGS) + sorted(TINY_CONFIGS)
        raise KeyError(f"unknown config {name!r}; known: {known}")
    if num_hidden_layers is not None:
        kwargs["num_hidden_layers"] = int(num_hidden_layers)
    kwargs.update(overrides)
    n = kwargs.get("num_hidden_layers")
    if "layer_types" in kwargs and "layer_types" not in overrides and n is not None \
            and len(kwargs["layer_types"]) != n:
        kwargs["layer_types"] = gemma3_layer_types(n)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def build_random_model(
    config,
    *,
    dtype: torch.dtype = torch.float16,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    num_hidden_layers: Optional[int] = None,
    init_device: Union[str, torch.device, None] = None,
):
    """Build a causal LM with random weights from a fixed seed, in eval mode.

    Parameters
    ----------
    config : str or transformers.PretrainedConfig
        A name accepted by :func:`make_config`, or a config object.
    dtype : torch.dtype, optional
        Parameter dtype (default ``torch.float16``).
    device : str or torch.device, optional
        Where the model ends up.
    seed : int, optional
        Seed of ``torch.manual_seed`` before the weights are initialised.
    attn_implementation : str, optional
        ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_sm75"``, ... The model can switch
        later with ``model.set_attn_implementation``.
    num_hidden_layers : int, optional
        Override the number of layers when ``config`` is a name.
    init_device : str or torch.device, optional
        Device on which the weights are allocated and drawn (default: ``device``; initialising a
        0.5B-parameter model on a GPU takes a fraction of a second, on a CPU tens of seconds).
        A seed gives the same weights for the same ``init_device`` (CPU and CUDA generators
        differ).

    Returns
    -------
    transformers.PreTrainedModel
        An ``AutoModelForCausalLM`` model in eval mode.
    """
    from transformers import AutoModelForCausalLM

    if attn_implementation == "flash_attention_sm75":
        _register_attention()
    if isinstance(config, str):
        config = make_config(config, num_hidden_layers=num_hidden_layers)
    init_device = torch.device(init_device if init_device is not None else device)
    torch.manual_seed(seed)
    try:
        with init_device:
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attn_implementation)
    except Exception as e:  # pragma: no cover - initialisation on that device not supported
        if init_device.type == "cpu":
            raise
        import logging

        logging.getLogger("flash_attention_sm75").warning(
            "initialising on %s failed (%s: %s); initialising on the CPU", init_device,
            type(e).__name__, e)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


def load_model(
    path_or_name: str,
    *,
    dtype: torch.dtype = torch.float16,
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    num_hidden_layers: Optional[int] = None,
):
    """Load a local checkpoint, or build a random-weight model from a named configuration.

    Parameters
    ----------
    path_or_name : str
        A local directory with a transformers checkpoint (loaded with ``from_pretrained``, never
        downloaded: ``local_files_only=True``), or a configuration name (see
        :func:`make_config`).
    dtype, device, seed, attn_implementation, num_hidden_layers
        As in :func:`build_random_model`; ``seed`` and ``num_hidden_layers`` only apply to
        random-weight models (initialised on ``device``).

    Returns
    -------
    transformers.PreTrainedModel
        The model in eval mode on ``device``.
    """
    if os.path.isdir(path_or_name):
        from transformers import AutoModelForCausalLM

        if attn_implementation == "flash_attention_sm75":
            _register_attention()
        model = AutoModelForCausalLM.from_pretrained(
            path_or_name, dtype=dtype, attn_implementation=attn_implementation,
            local_files_only=True)
        return model.to(device).eval()
    return build_random_model(path_or_name, dtype=dtype, device=device, seed=seed,
                              attn_implementation=attn_implementation,
                              num_hidden_layers=num_hidden_layers)
