"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
arXiv:2401.10774): a stack of small heads on the target's final hidden state, head i guessing the token i + 2
positions ahead.

`MedusaHeads` is an ``nn.Module`` with huggingface_hub's `ModelHubMixin` (`from_pretrained` / `save_pretrained` /
`push_to_hub`). `from_pretrained` loads every published Medusa layout (FasterDecoding v0.1 ``medusa_lm_head.pt``, the
version-2 ResBlock-only heads, vLLM's layout, heads inside a sharded Medusa-2 checkpoint, our own format; see
`hf_specdec.heads.formats.medusa`), from a local folder or a Hub repo id. `save_pretrained` writes our format
(``config.json`` + ``model.safetensors`` + a generated ``README.md``), or with ``format="medusa"`` vLLM's Medusa
layout.

Use them with ``model.generate(ids, assistant=heads)`` (after ``import hf_specdec``); the proposer that turns their
top-k guesses into a static token tree is `hf_specdec.generation.proposers.medusa.MedusaAssistant`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .derived import dense_weight, drafting_copy, lm_head_logits
from .formats.medusa import (
    check_token_map,
    check_tree_choices,
    medusa_expected_shapes,
    medusa_to_vllm,
    read_medusa_checkpoint,
)
from .hub import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadSource,
    PretrainedHead,
    base_model_dims,
    base_model_name,
    check_base_model,
    tensor_names,
)


def _check_config_present(source: HeadSource) -> None:
    """Our format's weights are read with the config.json saved beside them: name that file when it is missing or
    empty (upstream layouts are told by their tensor names and need no config)."""
    config = source.json(CONFIG_NAME)
    if config:
        return
    path = source.file(WEIGHTS_NAME)
    if path is not None and "block_weight" in tensor_names(path):
        state = "missing" if config is None else "empty ({})"
        raise ValueError(
            f"MedusaHeads: {source}/{CONFIG_NAME} is {state}, but {path} holds hf-specdec Medusa heads (block_weight, "
            "...), which are read with the config.json saved beside them (head_type, num_heads, num_layers, "
            "hidden_size, ...): restore that file, or save the heads again with save_pretrained"
        )


class MedusaHeads(
    nn.Module,
    PretrainedHead,
    library_name="hf-specdec",
    tags=["speculative-decoding", "medusa"],
    paper_url="https://arxiv.org/abs/2401.10774",
):
    """``num_heads`` Medusa heads over a base model's final (normed) hidden states.

    Head ``i`` is ``num_layers`` ResBlocks ``x <- x + SiLU(x W^T + b)`` (W zero-initialised, so a fresh head starts
    as the identity) followed by an lm_head: its own `[V, H]` projection, or, with ``share_lm_head=True`` (the
    Medusa "version 2" style, and our default), the **base model's** lm_head. Applied to the hidden state at
    position t (which the base lm_head maps to token t + 1), head ``i`` predicts token ``t + 2 + i``.

    Args:
        hidden_size: the base model's hidden size H.
        num_heads: number of heads (= deepest draft).
        num_layers: ResBlocks per head.
        vocab_size: the base model's vocabulary size V (checked against the target; None = not checked, only
            allowed with ``share_lm_head``).
        share_lm_head: take logits from the base model's lm_head (pass it with `bind` or per call) instead of
            per-head projections. A per-head lm_head costs V x H parameters per head (113 MB in fp32 for
            SmolLM2-135M's 49152 x 576).
        block_bias: whether the ResBlocks' linear layers have a bias (upstream Medusa: yes; vLLM: optional).
        draft_vocab_size: heads predict only this many tokens, mapped to token ids by the ``token_map`` buffer
            (vLLM's truncated vocabulary); None = the full vocabulary.
        base_model_name_or_path: the base model these heads were trained for (informational; sizes are checked).
        tree_choices: default static tree (Medusa choices list) for `MedusaAssistant`; None = its default.
        model_card: facts for the generated model card (``training_data``, ``tau``, ``speedup``,
            ``measured_on``, ``notes``); saved in config.json.
    """

    head_type = "medusa"
    export_formats = ("hf-specdec", "medusa")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        vocab_size: int | None = None,
        share_lm_head: bool = True,
        block_bias: bool = True,
        draft_vocab_size: int | None = None,
        base_model_name_or_path: str | None = None,
        tree_choices: list[list[int]] | None = None,
        model_card: dict | None = None,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 0 or hidden_size < 1:
            raise ValueError(
                f"invalid MedusaHeads sizes: num_heads={num_heads}, num_layers={num_layers}, hidden_size={hidden_size}"
            )
        if not share_lm_head and vocab_size is None and draft_vocab_size is None:
            raise ValueError("MedusaHeads with their own lm_heads (share_lm_head=False) need vocab_size")
        if draft_vocab_size is not None and vocab_size is None:
            raise ValueError("a truncated draft vocabulary (draft_vocab_size) needs the full vocab_size")
        self.hidden_size = int(hidden_size)
        self.num_heads = int(num_heads)
        self.num_layers = int(num_layers)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.share_lm_head = bool(share_lm_head)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.base_model_name_or_path = base_model_name_or_path
        self.tree_choices = check_tree_choices(
            tree_choices, self.num_heads, self.draft_vocab_size or self.vocab_size, "MedusaHeads tree_choices"
        )
        self.model_card = dict(model_card or {})
        self.source = None  # where from_pretrained read the heads
        self.source_format = "hf-specdec"
        self._base_lm_head = None  # plain attribute: not a submodule, never saved or moved with the heads

        h, n, layers = self.hidden_size, self.num_heads, self.num_layers
        bound = 1.0 / math.sqrt(h)  # nn.Linear's default init range
        self.block_weight = nn.Parameter(torch.zeros(n, layers, h, h))  # [heads, layers, H_out, H_in]
        if block_bias:
            self.block_bias = nn.Parameter(torch.empty(n, layers, h).uniform_(-bound, bound))  # [heads, layers, H]
        else:
            self.register_parameter("block_bias", None)
        if share_lm_head:
            self.register_parameter("lm_head_weight", None)
        else:
            rows = self.draft_vocab_size or self.vocab_size
            self.lm_head_weight = nn.Parameter(torch.empty(n, rows, h).uniform_(-bound, bound))  # [heads, V', H]
        if self.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(self.draft_vocab_size, dtype=torch.long))  # [V'] -> id
        else:
            self.token_map = None

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = True,
        **kwargs,
    ) -> MedusaHeads:
        """Fresh heads sized for ``model`` and bound to it. Per-head lm_heads start as copies of the base lm_head
        (as upstream Medusa initialises them)."""
        hidden, vocab = base_model_dims(model)
        heads = cls(
            hidden_size=hidden,
            num_heads=num_heads,
            num_layers=num_layers,
            vocab_size=vocab,
            share_lm_head=share_lm_head,
            base_model_name_or_path=kwargs.pop("base_model_name_or_path", base_model_name(model)),
            **kwargs,
        )
        if not share_lm_head:
            base_w = dense_weight(model.get_output_embeddings().weight).to(heads.lm_head_weight.dtype)
            if heads.token_map is not None:
                base_w = base_w[heads.token_map]
            with torch.no_grad():
                heads.lm_head_weight.copy_(base_w.unsqueeze(0).expand_as(heads.lm_head_weight))
        return heads.bind(model)

    @classmethod
    def _read_checkpoint(cls, source: HeadSource, num_heads: int | None = None) -> tuple[dict, dict, str]:
        """``(init kwargs, tensors in our layout, source format)`` of the Medusa heads in ``source`` (any layout),
        cut to the first ``num_heads`` heads when given."""
        _check_config_present(source)
        ckpt = read_medusa_checkpoint(source)
        tensors = ckpt.tensors
        if num_heads is not None:
            if not 1 <= num_heads <= ckpt.num_heads:
                raise ValueError(f"num_heads={num_heads}, but {source} holds {ckpt.num_heads} Medusa heads")
            tensors = {k: (v[:num_heads].clone() if k != "token_map" else v) for k, v in tensors.items()}
            ckpt.num_heads = num_heads
            if ckpt.tree_choices is not None:
                ckpt.tree_choices = [c for c in ckpt.tree_choices if len(c) <= num_heads]
        return ckpt.init_kwargs(), tensors, ckpt.source_format

    # ------------------------------------------------------------------------------------------ base model
    def check_compatible(self, model: nn.Module) -> None:
        """Refuse a base model whose hidden size or vocabulary differ from these heads' (the message names both)."""
        check_base_model("MedusaHeads", model, self.hidden_size, self.vocab_size, self.base_model_name_or_path)
        if self.token_map is not None and self.token_map.device.type != "meta":
            check_token_map(
                self.token_map, base_model_dims(model)[1], "MedusaHeads: the token_map (draft index -> token id)",
                f"the target {type(model).__name__}",
            )  # fmt: skip
        if (
            self.share_lm_head
            and (model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None) is None
        ):
            raise ValueError(
                f"MedusaHeads with share_lm_head=True take logits from the base model's lm_head, but "
                f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)"
            )

    def bind(self, model: nn.Module) -> MedusaHeads:
        """Check ``model`` and remember its lm_head (used when ``share_lm_head``); returns self."""
        self.check_compatible(model)
        if self.share_lm_head:
            object.__setattr__(self, "_base_lm_head", model.get_output_embeddings())
        return self

    # ------------------------------------------------------------------------------------------ math
    def head_states(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """`[n, ..., H]` every head's ResBlock output for base hidden states `[..., H]` (n = ``num_heads`` or all).

        The first ResBlock of every head reads the same input, so it runs as one `[N, H] x [H, n * H]` matmul; later
        layers (if any) as one batched matmul over the heads.
        """
        n = self.num_heads if num_heads is None else num_heads
        h = self.hidden_size
        lead = hidden_states.shape[:-1]
        w0 = self.block_weight
        x0 = hidden_states.reshape(-1, h).to(device=w0.device, dtype=w0.dtype)  # [N, H]
        if self.num_layers == 0:
            return x0.unsqueeze(0).expand(n, -1, -1).reshape(n, *lead, h)
        bias0 = None if self.block_bias is None else self.block_bias[:n, 0].reshape(n * h)
        y = F.linear(x0, self.block_weight[:n, 0].reshape(n * h, h), bias0)  # [N, n * H]
        x = x0.unsqueeze(0) + F.silu(y.view(-1, n, h).transpose(0, 1))  # [n, N, H]
        for layer in range(1, self.num_layers):
            w_t = self.block_weight[:n, layer].transpose(1, 2)  # [n, H_in, H_out]
            if self.block_bias is not None:
                y = torch.baddbmm(self.block_bias[:n, layer].unsqueeze(1), x, w_t)
            else:
                y = torch.bmm(x, w_t)
            x = x + F.silu(y)
        return x.reshape(n, *lead, h)

    def draft_logits(self, states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """`[n, ..., V']` logits over the draft vocabulary (the full vocabulary unless truncated) from `head_states`.

        Args:
            states: `[n, ..., H]` ResBlock outputs of the first n heads.
            lm_head: the base model's lm_head (needed with ``share_lm_head`` unless the heads were bound).
        """
        if self.share_lm_head:
            head = lm_head if lm_head is not None else self._base_lm_head
            if head is None:
                raise ValueError(
                    "these MedusaHeads take logits from the base model's lm_head (share_lm_head=True): call "
                    "heads.bind(model) or pass lm_head=model.get_output_embeddings()"
                )
            # the draft vocabulary's V' rows of the lm_head only, in the heads' dtype (`drafting_copy`)
            return lm_head_logits(self, head, states, self.token_map, self.block_weight.dtype)
        n = states.shape[0]
        flat = states.reshape(n, -1, self.hidden_size)
        logits = torch.bmm(flat, self.lm_head_weight[:n].transpose(1, 2))  # [n, N, V']
        return logits.reshape(*states.shape[:-1], logits.shape[-1])

    def drafting_copy(self, dtype: torch.dtype) -> MedusaHeads:
        """These heads computing in ``dtype`` (themselves, or a cached copy bound to the same lm_head;
        `derived.drafting_copy`)."""
        return drafting_copy(self, dtype, shared=("_base_lm_head",))

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Every head's logits.

        Args:
            hidden_states: `[..., H]` the base model's final normed hidden states (what its lm_head sees).
            lm_head: the base model's lm_head (only with ``share_lm_head`` when the heads are not bound).
        Returns:
            `[num_heads, ..., V]` logits; with a truncated draft vocabulary, tokens outside it get ``-inf``.
        """
        logits = self.draft_logits(self.head_states(hidden_states), lm_head)
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_map.to(full.device)] = logits
        return full

    @torch.no_grad()
    def topk_tokens(
        self,
        hidden_states: torch.Tensor,
        k: int,
        num_heads: int | None = None,
        lm_head: nn.Module | None = None,
    ) -> torch.Tensor:
        """`[N, n, k]` int64 token ids: the k best guesses of each of the first n heads, best first.

        Args:
            hidden_states: `[N, H]` base hidden states (one per row).
            k: guesses per head.
            num_heads: use the first n heads only (default: all).
            lm_head: the base lm_head (see `draft_logits`).
        """
        logits = self.draft_logits(self.head_states(hidden_states, num_heads), lm_head)  # [n, N, V']
        if k > logits.shape[-1]:
            raise ValueError(f"top-{k} guesses requested from heads over {logits.shape[-1]} tokens")
        return self.draft_to_token(logits.topk(k, dim=-1).indices).permute(1, 0, 2)  # [n, N, k] -> [N, n, k]

    def draft_to_token(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids `[...]` of draft-vocabulary indices `[...]` (the identity without a truncated vocabulary)."""
        return index if self.token_map is None else self.token_map.to(index.device)[index]

    # ------------------------------------------------------------------------------------------ Hub I/O
    def config_dict(self) -> dict:
        """What ``config.json`` holds (our format)."""
        return {
            "head_type": self.head_type,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "share_lm_head": self.share_lm_head,
            "block_bias": self.block_bias is not None,
            "draft_vocab_size": self.draft_vocab_size,
            "base_model_name_or_path": self.base_model_name_or_path,
            "tree_choices": self.tree_choices,
            "model_card": self.model_card,
            "source_format": self.source_format,
            "dtype": str(self.block_weight.dtype).removeprefix("torch."),
        }

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor our format saves."""
        return medusa_expected_shapes(
            self.num_heads,
            self.num_layers,
            self.hidden_size,
            self.share_lm_head,
            self.block_bias is not None,
            self.draft_vocab_size or self.vocab_size,
            self.draft_vocab_size,
        )

    def export_checkpoint(self, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json, tensors)`` in vLLM's Medusa layout (``fmt="medusa"``; `formats.medusa.medusa_to_vllm`)."""
        if fmt != "medusa":
            raise ValueError(f"MedusaHeads export the formats {list(self.export_formats)}, not {fmt!r}")
        base = None
        if self.share_lm_head and self._base_lm_head is not None:
            if getattr(self._base_lm_head, "bias", None) is not None:
                raise ValueError("the base model's lm_head has a bias, which vLLM's Medusa lm_heads do not have")
            base = self._base_lm_head.weight
        return medusa_to_vllm(self, base)

    def _card_text(self, base: str, where: str) -> tuple[str, str, str, str]:
        lm = "the base model's own lm_head" if self.share_lm_head else "its own lm_head"
        vocab = f" over a truncated vocabulary of {self.draft_vocab_size} tokens" if self.draft_vocab_size else ""
        description = (
            f"{self.num_heads} Medusa heads ([Cai et al. 2024](https://arxiv.org/abs/2401.10774)) for speculative "
            f"decoding with hf-specdec. Each head is "
            f"{self.num_layers} ResBlock(s) `x + SiLU(Wx + b)` on the base model's final hidden state followed by "
            f"{lm}{vocab}; head i guesses the token i + 2 positions ahead. The guesses form a static token tree that "
            "the base model verifies in one forward pass: greedy output is identical to the base model's own."
        )
        load = f'MedusaHeads.from_pretrained("{where}", base_model=model)'
        return f"Medusa heads for {base}", description, "from hf_specdec import MedusaHeads", load

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_layers={self.num_layers}, hidden_size={self.hidden_size}, "
            f"vocab_size={self.vocab_size}, share_lm_head={self.share_lm_head}"
            + (f", draft_vocab_size={self.draft_vocab_size}" if self.draft_vocab_size is not None else "")
        )
