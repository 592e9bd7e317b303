"""The trainer interface: one `TrainerKind` per trained head kind, what differs between the kinds' trainers behind one
signature each: the head class and the trainer's config class, whether a loaded head is bound to its target, the
target layers a fresh head reads, the trainer (`Train`), the held-out scorer (`HeldOut`) and the ``hf-specdec train``
command (`TrainerCommand`). A kind's descriptor (`hf_specdec.kinds.HeadKind.trainer`) names its `TrainerKind`;
`trainer_kinds` collects them for callers that loop over every kind (the GPU recipe, ``hf-specdec train``). The
module imports the classes and trainers only when a callable runs, so the objects are cheap.

    kind = trainer_kinds()["medusa"]
    head, report = kind.train(model, data, "out/run", kind.config_class()(max_steps=100), False, "cpu", None)
    head.save_pretrained("out/medusa")
    scores = kind.held_out(kind.load("out/medusa", model), held, model, "cpu", 4096)  # {"held_out_top1": ...}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..kinds import HEAD_KINDS
from .labels import head_positions
from .run import RunConfig
from .shards import DistillationData
from .trainer_cli import TrainerCommand

# (model, data, run_dir, trainer config, resume, device, init_head) -> (head on the CPU, training report): one trainer
# call, no progress bar; ``init_head`` (or None: a fresh head) is a head of the same kind to fine-tune
Train = Callable[
    [nn.Module, DistillationData, "str | os.PathLike", RunConfig, bool, str, "nn.Module | None"], tuple[nn.Module, dict]
]
# (head, held-out data, model, device, max_positions) -> {"held_out_top1": ..., "held_out_positions": ..., ...}:
# teacher-forced scores on the held-out data (the keys each kind adds are its scorer's); the head ends on the CPU
HeldOut = Callable[[nn.Module, DistillationData, nn.Module, str, int], dict]


@dataclass(frozen=True)
class TrainerKind:
    """One trained head kind: what the trainers' callers need of it.

    Attributes:
        name: the kind's name (`hf_specdec.kinds.HEAD_KINDS`).
        head_class: ``() -> class``: the head's class (``from_pretrained``, ``save_pretrained``, ``for_model``).
        config_class: ``() -> class``: its trainer's config (a `RunConfig`).
        binds: a loaded head is ``.bind(model)``-ed to its target before it drafts or is scored (EAGLE, DFlash).
        feature_layers: ``(model) -> layer ids``: the entries of the target's ``hidden_states`` a fresh head reads
            besides the final state where it reads any (an EAGLE-3 head's, a DFlash head's); none for Medusa and the
            MLP speculator, which read the final state only.
        train: `Train`, the kind's trainer behind one signature.
        held_out: `HeldOut`, the kind's held-out scorer behind one signature.
        command: ``() -> TrainerCommand``: the kind's ``hf-specdec train <name>`` command.
    """

    name: str
    head_class: Callable[[], type]
    config_class: Callable[[], type]
    binds: bool
    feature_layers: Callable[[nn.Module], tuple[int, ...]]
    train: Train
    held_out: HeldOut
    command: Callable[[], TrainerCommand]

    def load(self, folder: str | os.PathLike, model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The head saved in ``folder``, loaded with ``from_pretrained`` in ``dtype``, bound to ``model`` where the
        kind binds, in eval mode."""
        head = self.head_class().from_pretrained(folder, dtype=dtype)
        if self.binds:
            head = head.bind(model)
        return head.eval()


# ---------------------------------------------------------------------------------------------------- shared
def _every_sequence(held: DistillationData) -> torch.Tensor:
    """`[S]` the ids of every sequence in ``held``."""
    return torch.arange(held.seq_bounds.shape[0])


def _sampled_positions(held: DistillationData, max_positions: int) -> torch.Tensor:
    """`[P]` the positions a final-state head is scored at: every sequence's `head_positions` on the target's path,
    at most ``max_positions`` of them (a seeded sample, in order)."""
    pos = head_positions(held, _every_sequence(held))
    pos = pos[held.on_target_path()[pos]]
    if pos.numel() > max_positions:
        pos = pos[torch.randperm(pos.numel(), generator=torch.Generator().manual_seed(1))[:max_positions]].sort().values
    return pos


@contextmanager
def _on(head: nn.Module, device: str) -> Iterator[nn.Module]:
    """``head`` on ``device`` inside the block, back on the CPU after it."""
    try:
        yield head.to(device)
    finally:
        head.to("cpu")


def _no_feature_layers(model: nn.Module) -> tuple[int, ...]:
    """A head that reads the final state only."""
    return ()


# ---------------------------------------------------------------------------------------------------- EAGLE
def _eagle_class() -> type:
    from ..heads.eagle import EagleHead

    return EagleHead


def _eagle_config() -> type:
    from .eagle import EagleTrainingConfig

    return EagleTrainingConfig


def _eagle3_layers(model: nn.Module) -> tuple[int, ...]:
    from ..heads.eagle import eagle3_feature_layers

    return tuple(eagle3_feature_layers(model))


def _train_eagle(model, data, run_dir, cfg, resume, device, init_head):
    from .eagle import train_eagle

    return train_eagle(model, data, run_dir, cfg, resume=resume, progress=False, device=device, init_head=init_head)


@torch.no_grad()
def _held_out_eagle(head, held, model, device, max_positions) -> dict:
    from .eagle import evaluate_eagle

    with _on(head, device) as on:
        scores = evaluate_eagle(on, held, _every_sequence(held), max_positions)
    return {"held_out_top1": scores["top1"], "held_out_top4": scores["top4"], "held_out_positions": scores["positions"]}


# ---------------------------------------------------------------------------------------------------- DFlash
def _dflash_class() -> type:
    from ..heads.dflash import DFlashHead

    return DFlashHead


def _dflash_config() -> type:
    from .dflash import DFlashTrainingConfig

    return DFlashTrainingConfig


def _dflash_layers(model: nn.Module) -> tuple[int, ...]:
    from ..heads.dflash import default_feature_layers

    return tuple(default_feature_layers(int(model.config.num_hidden_layers)))


def _train_dflash(model, data, run_dir, cfg, resume, device, init_head):
    from .dflash import train_dflash

    return train_dflash(model, data, run_dir, cfg, resume=resume, progress=False, device=device, init_head=init_head)


@torch.no_grad()
def _held_out_dflash(head, held, model, device, max_positions) -> dict:
    from .dflash import evaluate_dflash

    with _on(head, device) as on:
        scores = evaluate_dflash(on, held, _every_sequence(held), max_positions)
    return {"held_out_top1": scores["top1"], "held_out_chain_tau": scores["chain_tau"],
            "held_out_per_depth": scores["per_depth"], "held_out_positions": scores["positions"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- Medusa
def _medusa_class() -> type:
    from ..heads.medusa import MedusaHeads

    return MedusaHeads


def _medusa_config() -> type:
    from .medusa import MedusaTrainingConfig

    return MedusaTrainingConfig


def _train_medusa(model, data, run_dir, cfg, resume, device, init_head):
    from .medusa import train_medusa

    return train_medusa(data, run_dir, model.get_output_embeddings(), cfg, resume=resume, progress=False,
                        cpu=not str(device).startswith("cuda"), init_heads=init_head)  # fmt: skip


@torch.no_grad()
def _held_out_medusa(head, held, model, device, max_positions) -> dict:
    from .medusa import _frozen_lm_head, evaluate_medusa

    pos = _sampled_positions(held, max_positions)  # [P]
    weight, bias = _frozen_lm_head(model.get_output_embeddings(), held, device)  # [V, H], [V] or None
    with _on(head, device) as on:
        scores = evaluate_medusa(on, held, pos, weight, bias)
    return {"held_out_top1": scores["top1_per_head"], "held_out_positions": int(pos.numel())}


# ---------------------------------------------------------------------------------------------------- MLP speculator
def _mlp_speculator_class() -> type:
    from ..heads.mlp_speculator import MLPSpeculator

    return MLPSpeculator


def _mlp_speculator_config() -> type:
    from .mlp_speculator import MLPSpeculatorTrainingConfig

    return MLPSpeculatorTrainingConfig


def _train_mlp_speculator(model, data, run_dir, cfg, resume, device, init_head):
    from .mlp_speculator import train_mlp_speculator

    return train_mlp_speculator(data, run_dir, cfg, resume=resume, progress=False, device=device,
                                init_speculator=init_head)  # fmt: skip


@torch.no_grad()
def _held_out_mlp_speculator(head, held, model, device, max_positions) -> dict:
    from .mlp_speculator import evaluate_mlp_speculator

    pos = _sampled_positions(held, max_positions)  # [P]
    with _on(head, device) as on:
        scores = evaluate_mlp_speculator(on, held, pos)
    return {"held_out_top1": scores["top1_per_stage"], "held_out_positions": int(pos.numel())}


# ---------------------------------------------------------------------------------------------------- commands
def _eagle_command() -> TrainerCommand:
    from .eagle_cli import EAGLE_COMMAND

    return EAGLE_COMMAND


def _dflash_command() -> TrainerCommand:
    from .eagle_cli import DFLASH_COMMAND

    return DFLASH_COMMAND


def _medusa_command() -> TrainerCommand:
    from .medusa_cli import MEDUSA_COMMAND

    return MEDUSA_COMMAND


def _mlp_speculator_command() -> TrainerCommand:
    from .mlp_speculator import MLP_SPECULATOR_COMMAND

    return MLP_SPECULATOR_COMMAND


# ---------------------------------------------------------------------------------------------------- the kinds
EAGLE_TRAINER = TrainerKind("eagle", _eagle_class, _eagle_config, True, _eagle3_layers, _train_eagle, _held_out_eagle,
                            _eagle_command)  # fmt: skip
MEDUSA_TRAINER = TrainerKind("medusa", _medusa_class, _medusa_config, False, _no_feature_layers, _train_medusa,
                             _held_out_medusa, _medusa_command)  # fmt: skip
MLP_SPECULATOR_TRAINER = TrainerKind("mlp_speculator", _mlp_speculator_class, _mlp_speculator_config, False,
                                     _no_feature_layers, _train_mlp_speculator, _held_out_mlp_speculator,
                                     _mlp_speculator_command)  # fmt: skip
DFLASH_TRAINER = TrainerKind("dflash", _dflash_class, _dflash_config, True, _dflash_layers, _train_dflash,
                             _held_out_dflash, _dflash_command)  # fmt: skip


def trainer_kinds() -> dict[str, TrainerKind]:
    """``{name: TrainerKind}`` of every kind whose descriptor names a trainer, in `hf_specdec.kinds.HEAD_KINDS`
    order."""
    return {kind.name: kind.load("trainer") for kind in HEAD_KINDS.values() if kind.trainer is not None}


__all__ = ["DFLASH_TRAINER", "EAGLE_TRAINER", "HeldOut", "MEDUSA_TRAINER", "MLP_SPECULATOR_TRAINER", "Train",
           "TrainerKind", "trainer_kinds"]  # fmt: skip
