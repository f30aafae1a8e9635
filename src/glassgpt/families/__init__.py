"""The book's next models after GPT-2, one glass file each: Qwen3 and its MoE (qwen3.py), Llama 3.2
(llama3.py) and the bonus Gemma 3 (gemma3.py) and Qwen3.5 (qwen3_5.py: linear and full attention layers, its
Qwen3_5Config a FamilyConfig with more fields).

    cfg = family_config("qwen3-0.6b", n_layers=2)   # FamilyConfig (glassgpt/config.py), a preset or your own
    model = build_model(cfg)                        # Qwen3Model or Llama3Model, by cfg.family

They share one config type (glassgpt/config.py), their pieces (layers.py: RMSNorm, RoPE, grouped-query
attention, SwiGLU); the engine's KVCache keeps their key/value groups (`cfg.kv_heads`); GPT-2 (model.py) stays as the book's chapter 4 has it.
glassgpt's memory.py counts their bytes from their description, its adopt.py reads the book's, the notebooks' and
transformers' Qwen3, Llama, Gemma 3, OLMo 3 and Tiny Aya modules in place.

The book's other bonus notebooks (issue 48), each a glass file with its own config (the notebook's keys):
olmo3.py (OLMo 3) and tiny_aya.py (Tiny Aya); sliding.py holds their sliding/full attention and the
cache that keeps a sliding layer's window only; bonus_hf.py transformers' names for them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import FAMILY_NAMES, FAMILY_PRESETS, FamilyConfig, RopeFreq, family_config
from .gemma3 import Gemma3Config, Gemma3Model
from .llama3 import Llama3Model
from .olmo3 import Olmo3Config, Olmo3Model
from .qwen3 import Qwen3Model
from .qwen3_5 import Qwen3_5Config, Qwen3_5Model
from .tiny_aya import TinyAyaConfig, TinyAyaModel

# The registry: which glass class builds each family. FamilyConfig builds the first three (Qwen3.5's Qwen3_5Config is
# a FamilyConfig with its own fields); Gemma 3 has its own config (gemma3.py's Gemma3Config, the notebook's keys),
# whose `family` is "gemma3".
FAMILIES: dict[str, type[nn.Module]] = {"qwen3": Qwen3Model, "llama3": Llama3Model, "qwen3_5": Qwen3_5Model,
                                        "gemma3": Gemma3Model}
assert tuple(FAMILIES)[:len(FAMILY_NAMES)] == FAMILY_NAMES
FAMILY_CONFIGS = (FamilyConfig, Gemma3Config)  # a family model's config is one of these (isinstance)

# The book's bonus models (issue 48), each with a config of its own (the notebook's keys): family -> (model, config).
# They run through generate, describe, trace and the file readers; the Qwen3/Llama-only machinery (the native
# step, why, verify, compare, export) does not take them yet.
BONUS_MODELS: dict[str, tuple[type[nn.Module], type]] = {"olmo3": (Olmo3Model, Olmo3Config),
                                                         "tiny_aya": (TinyAyaModel, TinyAyaConfig)}
BONUS_CONFIGS = (Olmo3Config, TinyAyaConfig)  # a bonus model's config is one of these (isinstance)

__all__ = ["BONUS_CONFIGS", "BONUS_MODELS", "FAMILIES", "FAMILY_CONFIGS", "FAMILY_PRESETS", "FamilyConfig",
           "Gemma3Config", "Gemma3Model", "Llama3Model", "Olmo3Config", "Olmo3Model", "Qwen3Model", "Qwen3_5Config",
           "Qwen3_5Model", "RopeFreq", "TinyAyaConfig", "TinyAyaModel", "build_model", "family_config",
           "is_bonus_model", "is_family_model",
           "random_family_model"]


def build_model(cfg: FamilyConfig | Gemma3Config | Olmo3Config | TinyAyaConfig) -> nn.Module:
    """The glass model of `cfg.family` (a FamilyConfig, Gemma 3's or a bonus model's config), with PyTorch's
    default initialisation (as the book's classes)."""
    if cfg.family in BONUS_MODELS:
        return BONUS_MODELS[cfg.family][0](cfg)
    return FAMILIES[cfg.family](cfg)


def is_family_model(model: object) -> bool:
    return isinstance(model, tuple(FAMILIES.values()))


def is_bonus_model(model: object) -> bool:
    """One of the book's bonus models (BONUS_MODELS): OLMo 3, Tiny Aya."""
    return isinstance(model, tuple(m for m, _ in BONUS_MODELS.values()))



def random_family_model(cfg: FamilyConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> nn.Module:
    """A model of `cfg` with random weights (a new training run, the benchmarks): N(0, 0.02) matrices,
    norms at 1, drawn from a generator of its own, so the same seed gives the same weights whatever
    the global RNG's state."""
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied matrix is drawn once
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:  # a norm at 1: Gemma's multiplies by (1 + scale)
                p.fill_(0.0 if cfg.family == "gemma3" else 1.0)
    return model.to(device=device, dtype=dtype).eval()
