"""Training speculative heads by self-distillation: `data` builds and caches the target's answers and hidden states,
`medusa` trains Medusa-1 heads on them with the base model frozen.

    from hf_specdec.heads.train import build_default_data, train_medusa, MedusaTrainingConfig
"""

from .data import (
    DistillationData,
    build_default_data,
    build_distillation_data,
    load_distillation_data,
    make_prompts,
    prompt_recipe,
    spec_bench_overlap,
)
from .medusa import MedusaTrainingConfig, evaluate_medusa, latest_checkpoint, medusa_loss, train_medusa

__all__ = [
    "DistillationData",
    "MedusaTrainingConfig",
    "build_default_data",
    "build_distillation_data",
    "evaluate_medusa",
    "latest_checkpoint",
    "load_distillation_data",
    "make_prompts",
    "medusa_loss",
    "prompt_recipe",
    "spec_bench_overlap",
    "train_medusa",
]
