"""Greedy answers of a batch over a static KV cache, each decoding step one replayed CUDA graph: the data builder's
fast path on a GPU (`target_states.Answering` with ``static=True``).

The builder's dynamic loop (`target_states.greedy_answers_with_states`) costs about the same per step on a GPU
whatever the batch: the host launches some 1,100 kernels a step for a 30-layer 135M model and the GPU waits for them
(docs/results/h200_builder_profile.txt). Here a batch gets a `transformers.StaticCache` sized for its prompts and
answers, and every step has the same shapes and the same tensors (`DecodeStep`): the input token, the position ids,
the write position and an additive attention bias built from them inside the step. On CUDA the step after the first is
captured once as a CUDA graph and replayed; elsewhere (or where capture fails) the same step runs eagerly, which is
also how the tests check it.

Finished rows keep decoding (a static shape cannot drop them); the loop stops once every row has forwarded its end
token, and each row's answer and states are cut there: the same answers and states as the dynamic loop's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import torch

from ..cache.model_arg import cache_kwarg
from ..text_config import text_config
from .padding import left_padded

logger = logging.getLogger(__name__)

STOP_CHECK_EVERY = 8  # steps between the host's checks whether every row has finished (each check is a sync)


def _takes(forward, name: str) -> bool:
    """Whether ``forward`` has a parameter ``name`` (transformers < 5.24 decoders take ``cache_position``)."""
    try:
        return name in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def check_static_decodable(model) -> None:
    """Refuse (ValueError, naming why) a model whose layers are not all full attention over one cache: sliding
    windows, linear attention and recurrent layers keep other caches than the static slots the step's bias covers."""
    config = text_config(model)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"static decoding needs full attention in every layer; {type(model).__name__} has {kinds}")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"static decoding has no sliding window; {type(model).__name__} has {config.sliding_window}")


class DecodeStep:
    """One greedy decoding step of a batch of ``B`` rows over a static cache of ``L`` slots, with fixed input and
    output tensors (what a CUDA graph replays): ``set(tokens [B], step)`` writes the inputs, ``run()`` returns
    ``(states [B, F], next tokens [B])``: the states of the tokens just fed (the final normed state, then each
    ``aux_layers`` entry of ``hidden_states``) and the target's arg-max after them."""

    def __init__(self, model, cache, prompt_mask: torch.Tensor, last_positions: torch.Tensor, max_new_tokens: int,
                 aux_layers: Sequence[int]):  # fmt: skip
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.aux_layers = tuple(aux_layers)
        batch, width = prompt_mask.shape  # [B, W]
        device, dtype = prompt_mask.device, next(model.parameters()).dtype
        self.width = width
        self.keys_allowed = torch.cat(
            [prompt_mask.bool(), torch.ones(batch, max_new_tokens, dtype=torch.bool, device=device)], dim=1
        )  # [B, L] the prompt's pads are never attended to
        self.slots = torch.arange(width + max_new_tokens, device=device)  # [L]
        self.masked = torch.finfo(dtype).min
        self.dtype = dtype
        self.first_positions = last_positions + 1  # [B] the position id of the first answer token
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.slot = torch.full((1,), width, dtype=torch.long, device=device)  # [1] the cache slot written
        self.extra = {"cache_position": self.slot} if _takes(self.decoder.forward, "cache_position") else {}
        self.extra.update(cache_kwarg(self.decoder.forward, cache))

    def set(self, tokens: torch.Tensor, step: int) -> None:
        """Feed ``tokens`` `[B]` as answer token ``step`` of every row (in place: a captured graph reads these)."""
        self.tokens.copy_(tokens[:, None])
        self.positions.copy_(self.first_positions[:, None] + step)
        self.slot.fill_(self.width + step)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        allowed = self.keys_allowed & (self.slots <= self.slot)  # [B, L] causal over the static slots
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill(~allowed, self.masked)
        out = self.decoder(input_ids=self.tokens, attention_mask=bias[:, None, None, :], position_ids=self.positions,
                           output_hidden_states=bool(self.aux_layers), **self.extra)  # fmt: skip
        last = out.last_hidden_state[:, 0]  # [B, H]
        states = torch.cat([last] + [out.hidden_states[i][:, 0] for i in self.aux_layers], dim=-1)  # [B, F]
        return states, self.lm_head(last).argmax(-1)


class GraphedStep:
    """`DecodeStep.run` captured as a CUDA graph (``replay`` returns the graph's own output tensors, overwritten by
    the next replay)."""

    def __init__(self, step: DecodeStep):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = step.run()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.outputs


def _runner(step: DecodeStep, graphs: bool):
    """What runs steps after the first: the captured graph where asked and CUDA can, else the eager step."""
    if graphs and step.tokens.is_cuda:
        try:
            return GraphedStep(step)
        except Exception as err:  # a model or a torch whose step cannot be captured: the eager step still works
            logger.warning("static decoding: CUDA graph capture failed (%s: %s); decoding eagerly",
                           type(err).__name__, err)  # fmt: skip
    return step.run


@torch.no_grad()
def greedy_answers_static(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: set[int],
    aux_layers: Sequence[int] = (),
    graphs: bool = True,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """`target_states.greedy_answers_with_states` over a static cache (module docstring): per row the greedy answer
    (cut after its first EOS) and `[len(prompt) + len(answer), H * (1 + len(aux_layers))]` states on the CPU.
    ``graphs``: replay the steps as one CUDA graph on CUDA (ignored elsewhere)."""
    from transformers import StaticCache

    check_static_decodable(model)
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    ids, mask = left_padded(prompts, pad_id)  # [B, W]
    ids, mask = ids.to(device), mask.to(device)
    width = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    extra = {"cache_position": torch.arange(width, device=device)} if _takes(decoder.forward, "cache_position") else {}
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=bool(aux_layers),
                  **cache_kwarg(decoder.forward, cache), **extra)  # fmt: skip
    prompt_states = torch.cat([out.last_hidden_state] + [out.hidden_states[i] for i in aux_layers], dim=-1).cpu()
    token = model.get_output_embeddings()(out.last_hidden_state[:, -1]).argmax(-1)  # [B] answer token 0
    del out
    step = DecodeStep(model, cache, mask, positions[:, -1], max_new_tokens, aux_layers)
    tokens, states = _decode(step, token, max_new_tokens, eos_ids, graphs)  # [T, B], [T, B, F]
    answers, row_states = [], []
    for r, p in enumerate(prompts):
        row = tokens[:, r].tolist()
        n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:n])
        row_states.append(torch.cat([prompt_states[r, width - len(p) :], states[:n, r]]))
    return answers, row_states


def _decode(step: DecodeStep, token: torch.Tensor, max_new_tokens: int, eos_ids: set[int], graphs: bool):
    """Feed answer tokens from ``token`` `[B]` until every row has fed an EOS or ``max_new_tokens`` were fed:
    ``(tokens [T, B], states [T, B, F])`` on the CPU, T the steps taken."""
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=token.device)  # [E]
    fed_eos = torch.zeros_like(token, dtype=torch.bool)  # [B]
    tokens, states, run = [], [], step.run
    for k in range(max_new_tokens):
        step.set(token, k)
        if k == 1:  # the first step ran eagerly (lazy initialisations); the graph captures the second
            run = _runner(step, graphs)
        hs, nxt = run()
        tokens.append(token)
        states.append(hs.clone())
        fed_eos |= torch.isin(token, eos)
        token = nxt.clone()
        if (k + 1) % STOP_CHECK_EVERY == 0 and bool(fed_eos.all()):
            break
    return torch.stack(tokens).cpu(), torch.stack(states).cpu()


__all__ = [
    "DecodeStep",
    "GraphedStep",
    "STOP_CHECK_EVERY",
    "check_static_decodable",
    "greedy_answers_static",
]
