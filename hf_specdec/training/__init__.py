"""Training speculative heads by self-distillation: `data` builds and caches the target's answers and hidden states,
`run` holds what every trainer shares (held-out split, schedule, checkpoints and resume, the step loop), `medusa`
trains Medusa-1 heads with the base model frozen, `medusa_tree` picks their static tree from held-out acceptance and
`step_cost` (what a step with an n-node tree costs on this machine), `benchmark_questions` keeps the benchmark's
questions out of the training prompts.

    from hf_specdec.training import build_default_data, train_medusa, MedusaTrainingConfig
"""

from .benchmark_questions import find_questions_file, read_questions, spec_bench_overlap
from .data import (
    CONTEXT_STAGE_DIR,
    DistillationData,
    build_default_data,
    build_distillation_data,
    load_distillation_data,
    make_context_prompts,
    make_prompts,
    prompt_recipe,
)
from .medusa import MedusaTrainingConfig, evaluate_medusa, medusa_loss, train_medusa
from .medusa_tree import (
    TreeTuning,
    acceptance_table,
    guess_matches,
    measure_step_cost,
    tree_tau,
    tune_and_save_tree,
    tune_tree,
)
from .run import (
    HeldOutSplit,
    RunConfig,
    TrainingRun,
    head_positions,
    held_out_split,
    latest_checkpoint,
    split_sequences,
)
from .step_cost import cpu_timer, random_tree_mask, step_cost_curve, verify_cost_curve

__all__ = [
    "CONTEXT_STAGE_DIR",
    "DistillationData",
    "HeldOutSplit",
    "RunConfig",
    "TrainingRun",
    "MedusaTrainingConfig",
    "build_default_data",
    "build_distillation_data",
    "cpu_timer",
    "random_tree_mask",
    "step_cost_curve",
    "verify_cost_curve",
    "TreeTuning",
    "acceptance_table",
    "evaluate_medusa",
    "find_questions_file",
    "read_questions",
    "guess_matches",
    "head_positions",
    "held_out_split",
    "latest_checkpoint",
    "load_distillation_data",
    "make_context_prompts",
    "make_prompts",
    "medusa_loss",
    "prompt_recipe",
    "measure_step_cost",
    "spec_bench_overlap",
    "split_sequences",
    "train_medusa",
    "tree_tau",
    "tune_and_save_tree",
    "tune_tree",
]
