"""Training speculative heads by self-distillation.

The data, in the order they are made: where text comes from (`benchmark_questions`: the benchmark's questions, kept
out of every prompt; `conversations`: ShareGPT; `text_sources`: real text installed on this machine), how prompts are
built from it (`chat_template`, `template_prompts`, `task_prompts`), the target answering them or read over fixed text
(`target_states`), the folders that come out (`distillation_data`, `default_data`, `task_data`, `conversation_data`,
`teacher_forced`), how they are stored and read (`shards`), and the labels the trainers read from them (`labels`);
`online_states` stores nothing and runs the target at every training step instead (EAGLE's and DFlash's online
training). Then the trainers: `run` holds what every trainer shares (held-out split, schedule, checkpoints and resume,
the step loop), `step_inputs` what a step reads from stored or online data alike, `medusa` trains Medusa-1 heads with the base model frozen, `medusa_tree` picks their static tree from held-out
acceptance and `step_cost` (what a step with an n-node tree costs on this machine). Every trainer's command line
(``hf-specdec train <kind>``) has one shape, `trainer_cli`'s: each kind defines a `TrainerCommand` next to its trainer
(`medusa_cli`, `mlp_speculator`, `eagle_cli` for eagle and dflash), which its `TrainerKind` (`head_kinds`: the trainer
interface) names; `trainer_commands` lists them in the kinds' order.

    from hf_specdec.training import build_default_data, train_medusa, MedusaTrainingConfig
"""

from .benchmark_questions import find_questions_file, read_questions, spec_bench_overlap
from .default_data import CONTEXT_STAGE_DIR, build_default_data
from .distillation_data import build_distillation_data
from .head_kinds import TrainerKind, trainer_kinds
from .labels import head_positions
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
from .online_states import OnlineTeacherForcing
from .run import (
    HeldOutSplit,
    RunConfig,
    TrainingRun,
    held_out_split,
    latest_checkpoint,
    split_sequences,
)
from .shards import DistillationData, load_distillation_data
from .step_cost import cpu_timer, random_tree_mask, step_cost_curve, verify_cost_curve
from .template_prompts import make_context_prompts, make_prompts, prompt_recipe
from .trainer_cli import TrainerCommand, add_trainer_arguments


def trainer_commands() -> list[TrainerCommand]:
    """Every trained head kind's ``hf-specdec train`` command, in the kinds' order (`hf_specdec.kinds.HEAD_KINDS`)."""
    return [kind.command() for kind in trainer_kinds().values()]


__all__ = [
    "TrainerCommand",
    "TrainerKind",
    "trainer_commands",
    "trainer_kinds",
    "add_trainer_arguments",
    "CONTEXT_STAGE_DIR",
    "DistillationData",
    "HeldOutSplit",
    "RunConfig",
    "TrainingRun",
    "MedusaTrainingConfig",
    "OnlineTeacherForcing",
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
