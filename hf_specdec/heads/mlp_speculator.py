"""IBM's MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding
Speculators", arXiv:2404.19124): a chain of small MLP stages on the target's final hidden state, stage i guessing the
token i + 1 positions after the root from the previous stage's state and the token chosen before it.

Stage i (docs/formats.md, "IBM MLP speculator"), with ``state_0`` the target's final normed hidden state at the last
committed token (RMS-normalised without parameters and divided by sqrt(2) when ``scale_input``)::

    z       = emb[i](token_i)                      # token_0 = the root, token_i = the token chosen at stage i - 1
    state   = proj[i](state) * state_weight + z * emb_weight
    state   = GELU(ln[i](state))                   # ln: RMS norm with weight and bias, eps 1e-6
    logits  = head[i](state)                       # guesses the token after token_i

with ``state_weight = 0.5 ** (0.5 / n_predict)`` and ``emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2)``.
With ``tie_weights`` every stage shares one ``emb``, ``head`` and ``ln`` and stages 1.. share ``proj[1]``; the tied
tensors are stored once (``emb.0.weight``, ``proj.0.weight``, ``proj.1.weight``, ``head.0.weight``, ``ln.0.*``).

`MLPSpeculator.from_pretrained` reads the published "accelerator" layout and our own format (both read by
`hf_specdec.heads.formats.mlp_speculator`). `save_pretrained` writes our format.

Our format may predict over a truncated vocabulary of ``draft_vocab_size`` tokens (``token_map`` `[V']`: draft index
-> token id, as vLLM's truncated Medusa heads): ``head`` has V' rows and ``emb`` V' + 1 rows, the last one standing
for every token outside the draft vocabulary (such tokens can still be the root).

The proposer that turns the stages into a token tree is
`hf_specdec.generation.proposers.mlp_speculator.MLPSpeculatorAssistant`; ``model.generate(ids, assistant=spec)``
builds it (after ``import hf_specdec``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_token_ids
from .derived import cached_derived, drafting_copy
from .formats.mlp_speculator import HEAD_TYPE, OWNER, read_mlp_speculator_checkpoint, speculator_shapes
from .hub import HeadSource, PretrainedHead, base_model_dims, base_model_name, check_base_model

LN_EPS = 1e-6


class StageNorm(nn.Module):
    """The speculator's layer norm: ``x * rsqrt(mean(x**2) + eps) * weight + bias`` (RMS-style, with a shift)."""

    def __init__(self, dim: int, eps: float = LN_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class MLPSpeculator(
    nn.Module,
    PretrainedHead,
    library_name="hf-specdec",
    tags=["speculative-decoding", "mlp-speculator"],
    paper_url="https://arxiv.org/abs/2404.19124",
):
    """An MLP speculator over a base model's final (normed) hidden states.

    Args:
        emb_dim: the base model's hidden size H.
        inner_dim: the stages' state size (0 = ``emb_dim``, as upstream).
        vocab_size: the base model's vocabulary size V.
        n_predict: number of stages (= deepest draft).
        top_k_tokens_per_head: children kept per node at each depth when drafting a tree (``n_predict`` entries).
        n_candidates: upstream's number of candidate paths; sets the default tree width per depth.
        tie_weights: share ``emb``/``head``/``ln`` across stages and ``proj[1]`` across stages 1..
        scale_input: RMS-normalise the base state (no parameters) and divide it by sqrt(2) before stage 0.
        draft_vocab_size: predict only this many tokens, mapped to token ids by the ``token_map`` buffer
            (None = the full vocabulary).
        base_model_name_or_path: the base model it was trained for (informational; sizes are checked).
        tree: tree defaults for the proposer: ``widths`` (nodes kept per depth), ``step_cost`` (``{nodes: cost of a
            step / a plain decoding step}`` measured on the training machine), ``depth_acceptance``.
        model_card: facts for the generated model card (``training_data``, ``tau``, ``speedup``, ``measured_on``,
            ``notes``); saved in config.json.
    """

    head_type = HEAD_TYPE

    def __init__(
        self,
        emb_dim: int,
        inner_dim: int = 0,
        vocab_size: int = 32000,
        n_predict: int = 3,
        top_k_tokens_per_head: list[int] | None = None,
        n_candidates: int = 5,
        tie_weights: bool = False,
        scale_input: bool = False,
        draft_vocab_size: int | None = None,
        base_model_name_or_path: str | None = None,
        tree: dict | None = None,
        model_card: dict | None = None,
    ):
        super().__init__()
        inner_dim = int(inner_dim) or int(emb_dim)
        top_k = [int(k) for k in (top_k_tokens_per_head or [1] * int(n_predict))]
        if emb_dim < 1 or inner_dim < 1 or vocab_size < 1 or n_predict < 1:
            raise ValueError(
                f"invalid MLPSpeculator sizes: emb_dim={emb_dim}, inner_dim={inner_dim}, vocab_size={vocab_size}, "
                f"n_predict={n_predict}"
            )
        if len(top_k) != n_predict or min(top_k) < 1:
            raise ValueError(
                f"top_k_tokens_per_head={top_k} must hold n_predict={n_predict} positive counts (one per stage)"
            )
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size={draft_vocab_size} must lie in [1, vocab_size={vocab_size}]")
        self.emb_dim, self.inner_dim, self.vocab_size = int(emb_dim), inner_dim, int(vocab_size)
        self.n_predict, self.top_k_tokens_per_head, self.n_candidates = int(n_predict), top_k, int(n_candidates)
        self.tie_weights, self.scale_input = bool(tie_weights), bool(scale_input)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.base_model_name_or_path = base_model_name_or_path
        self.tree = dict(tree or {})
        self.model_card = dict(model_card or {})
        self.source = None  # where from_pretrained read it
        self.source_format = "hf-specdec"
        self.state_weight = 0.5 ** (0.5 / self.n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (self.inner_dim / 2))

        out_rows = self.draft_vocab_size or self.vocab_size
        in_rows = self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size + 1
        n_own = 1 if self.tie_weights else self.n_predict
        n_proj = min(self.n_predict, 2) if self.tie_weights else self.n_predict
        self.emb = nn.ModuleList(nn.Embedding(in_rows, inner_dim) for _ in range(n_own))
        self.proj = nn.ModuleList(
            nn.Linear(self.emb_dim if i == 0 else inner_dim, inner_dim, bias=False) for i in range(n_proj)
        )
        self.head = nn.ModuleList(nn.Linear(inner_dim, out_rows, bias=False) for _ in range(n_own))
        self.ln = nn.ModuleList(StageNorm(inner_dim) for _ in range(n_own))
        if self.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(self.draft_vocab_size, dtype=torch.long))  # [V'] -> id
        else:
            self.token_map = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's initialisation: embeddings and linears ~ N(0, 1 / inner_dim), norms the identity."""
        std = 1.0 / math.sqrt(self.inner_dim)
        if self.emb[0].weight.is_meta:
            return
        with torch.no_grad():
            for module in [*self.emb, *self.proj, *self.head]:
                module.weight.normal_(0.0, std)
            for ln in self.ln:
                ln.weight.fill_(1.0)
                ln.bias.zero_()

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        inner_dim: int = 0,
        n_predict: int = 3,
        token_map: torch.Tensor | None = None,
        **kwargs,
    ) -> MLPSpeculator:
        """A fresh speculator sized for ``model`` (checked against it).

        Args:
            model: the target.
            inner_dim: state size (0 = the model's hidden size).
            n_predict: number of stages.
            token_map: `[V']` int64 token ids of a truncated draft vocabulary (None = the full vocabulary).
            kwargs: other `MLPSpeculator` arguments (``tie_weights``, ``scale_input``, ...).
        """
        hidden, vocab = base_model_dims(model)
        spec = cls(
            emb_dim=hidden,
            inner_dim=inner_dim,
            vocab_size=vocab,
            n_predict=n_predict,
            draft_vocab_size=None if token_map is None else int(token_map.numel()),
            base_model_name_or_path=kwargs.pop("base_model_name_or_path", base_model_name(model)),
            **kwargs,
        )
        if token_map is not None:
            spec.token_map.copy_(token_map.to(torch.long))
        spec.check_compatible(model)
        return spec

    @classmethod
    def _read_checkpoint(cls, source: HeadSource) -> tuple[dict, dict, str]:
        """``(init kwargs, tensors in our layout, source format)`` of the speculator in ``source`` (any layout)."""
        return read_mlp_speculator_checkpoint(source)

    def check_compatible(self, model: nn.Module) -> None:
        """Refuse a base model whose hidden size or vocabulary differ from this speculator's (naming both), or whose
        vocabulary lacks a ``token_map`` id."""
        owner = OWNER if self.source is None else f"{OWNER} loaded from {self.source}"
        check_base_model(owner, model, self.emb_dim, self.vocab_size, self.base_model_name_or_path)
        check_token_ids(OWNER, "token_map", self.token_map, base_model_dims(model)[1], self.source or "the speculator")

    # ------------------------------------------------------------------------------------------ math
    def _emb(self, i: int) -> nn.Embedding:
        return self.emb[0 if self.tie_weights else i]

    def _proj(self, i: int) -> nn.Linear:
        return self.proj[min(i, 1) if self.tie_weights else i]

    def _head(self, i: int) -> nn.Linear:
        return self.head[0 if self.tie_weights else i]

    def _ln(self, i: int) -> StageNorm:
        return self.ln[0 if self.tie_weights else i]

    def emb_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`[...]` int64 rows of ``emb`` for token ids `[...]` (with a truncated vocabulary: the draft index, or the
        last row for tokens outside it)."""
        if self.token_map is None:
            return token_ids
        m = self.token_map

        def invert() -> torch.Tensor:  # [V] draft index of every token id (m.numel() for tokens outside)
            rows = torch.full((self.vocab_size,), m.numel(), dtype=torch.long, device=m.device)
            rows[m] = torch.arange(m.numel(), device=m.device)
            return rows

        return cached_derived(self, "_emb_rows_cache", (m,), invert).to(token_ids.device)[token_ids]

    def draft_to_token(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids `[...]` of draft-vocabulary indices `[...]` (the identity without a truncated vocabulary)."""
        return index if self.token_map is None else self.token_map.to(index.device)[index]

    def drafting_copy(self, dtype: torch.dtype) -> MLPSpeculator:
        """This speculator computing in ``dtype`` (itself, or a cached copy; `derived.drafting_copy`)."""
        return drafting_copy(self, dtype)

    def base_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[..., H]` the stage-0 input state for base hidden states `[..., H]` (``scale_input`` applied)."""
        x = hidden_states.to(dtype=self.proj[0].weight.dtype, device=self.proj[0].weight.device)
        if self.scale_input:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LN_EPS) / math.sqrt(2.0)
        return x

    def stage(self, i: int, state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Stage ``i``'s new state `[..., inner]` from the previous state `[..., H or inner]` and `emb_rows` `[...]`."""
        z = self._emb(i)(rows.to(state.device))  # [..., inner]
        state = self._proj(i)(state) * self.state_weight + z * self.emb_weight
        return F.gelu(self._ln(i)(state))

    def stage_logits(self, i: int, state: torch.Tensor) -> torch.Tensor:
        """`[..., V']` stage ``i``'s logits over the draft vocabulary from its state `[..., inner]`."""
        return self._head(i)(state)

    def forward(self, hidden_states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of the first S stages.

        Args:
            hidden_states: `[N, H]` the base model's final hidden states at positions t.
            tokens: `[N, S]` int64, ``tokens[:, i]`` = the token at t + 1 + i (the root, then the tokens the stages
                are fed), S <= n_predict.
        Returns:
            `[S, N, V']` logits; stage i guesses the token at t + 2 + i.
        """
        if tokens.shape[-1] > self.n_predict:
            raise ValueError(f"{tokens.shape[-1]} stages requested from an MLPSpeculator with {self.n_predict}")
        state = self.base_state(hidden_states)
        rows = self.emb_rows(tokens)
        out = []
        for i in range(tokens.shape[-1]):
            state = self.stage(i, state, rows[:, i])
            out.append(self.stage_logits(i, state))
        return torch.stack(out)

    # ------------------------------------------------------------------------------------------ Hub I/O
    def default_widths(self) -> list[int]:
        """Nodes per depth of the default tree: ``tree.widths`` if set, else upstream's n_candidates best paths
        through the top_k_tokens_per_head product (``min(prod(k[:d + 1]), n_candidates)`` per depth)."""
        if self.tree.get("widths") is not None:
            return [int(w) for w in self.tree["widths"]]
        widths, product = [], 1
        for k in self.top_k_tokens_per_head:
            product *= k
            widths.append(min(product, max(self.n_candidates, 1)))
        return widths

    def config_dict(self) -> dict:
        """What ``config.json`` holds (our format)."""
        return {
            "head_type": HEAD_TYPE,
            "hidden_size": self.emb_dim,  # the base model's hidden size (= emb_dim), as every head's config says
            "emb_dim": self.emb_dim,
            "inner_dim": self.inner_dim,
            "vocab_size": self.vocab_size,
            "n_predict": self.n_predict,
            "top_k_tokens_per_head": self.top_k_tokens_per_head,
            "n_candidates": self.n_candidates,
            "tie_weights": self.tie_weights,
            "scale_input": self.scale_input,
            "draft_vocab_size": self.draft_vocab_size,
            "base_model_name_or_path": self.base_model_name_or_path,
            "tree": self.tree,
            "model_card": self.model_card,
            "source_format": self.source_format,
            "dtype": str(self.proj[0].weight.dtype).removeprefix("torch."),
        }

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor our format saves (tied copies once)."""
        return speculator_shapes(self.init_kwargs())

    def init_kwargs(self) -> dict:
        """`__init__` arguments that rebuild this module."""
        keys = ("emb_dim", "inner_dim", "vocab_size", "n_predict", "top_k_tokens_per_head", "n_candidates")
        keys += ("tie_weights", "scale_input", "draft_vocab_size", "base_model_name_or_path", "tree", "model_card")
        return {k: getattr(self, k) for k in keys}

    def _card_text(self, base: str, where: str) -> tuple[str, str, str, str]:
        vocab = f" over a truncated vocabulary of {self.draft_vocab_size} tokens" if self.draft_vocab_size else ""
        description = (
            f"An MLP speculator ([Wertheimer et al. 2024](https://arxiv.org/abs/2404.19124)) with {self.n_predict} "
            f"stages (state size {self.inner_dim}{', tied weights' if self.tie_weights else ''}){vocab} for "
            "speculative decoding with hf-specdec. Stage i reads the previous stage's state and the token chosen "
            "before it (stage 0: the base model's final hidden state and the root) and guesses the next token; the "
            "guesses form a token tree that the base model verifies in one forward pass: greedy output is identical "
            "to the base model's own and sampling stays exact."
        )
        load = f'MLPSpeculator.from_pretrained("{where}", base_model=model, dtype=model.dtype)'
        imports = "from hf_specdec.heads.mlp_speculator import MLPSpeculator"
        return f"MLP speculator for {base}", description, imports, load

    def extra_repr(self) -> str:
        return (
            f"emb_dim={self.emb_dim}, inner_dim={self.inner_dim}, vocab_size={self.vocab_size}, "
            f"n_predict={self.n_predict}, tie_weights={self.tie_weights}, scale_input={self.scale_input}"
            + (f", draft_vocab_size={self.draft_vocab_size}" if self.draft_vocab_size is not None else "")
        )


__all__ = ["MLPSpeculator", "StageNorm"]
