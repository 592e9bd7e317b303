"""How to serve an exported head in vLLM and SGLang: the model card's "Serve" sections.

Each export format (docs/formats.md) is read by some engines and not others, and each engine drafts its own tree
shape; the card states the exact command line, the tree settings the engine takes, and what it does not do. The
facts here are the engines' documented behaviour, not something hf-specdec runs: the commands are not executed by
hf-specdec's tests (they need a GPU server).
"""

from __future__ import annotations

import json

from ..kinds import kind_of

# the EAGLE proposer's defaults (generation/proposers/eagle.py; a test checks they match), stated in the card when the
# head carries no tree of its own
_EAGLE_TREE_DEFAULTS = {"top_k": 6, "depth": 5, "num_nodes": 24}


def serving_sections(head, fmt: str, where: str) -> list[str]:
    """Markdown sections for the model card of ``head`` saved in ``fmt`` at ``where`` (a repo id or folder): its
    kind's (`HeadKind.serving`), none for a kind without them."""
    kind = kind_of(head.head_type)
    sections = None if kind is None else kind.load("serving")
    return [] if sections is None else sections(head, fmt, where)


def _export_hint(where: str, formats: list[str]) -> str:
    return (
        "## Serving with vLLM or SGLang\n\n"
        f"This folder is in hf-specdec's own format. `hf-specdec export {where} --format FORMAT --out DIR` (FORMAT: "
        f"{' or '.join(formats)}) writes the layout the engines load, with a model card that gives their command lines."
    )


def _spec_config(method: str, model: str, tokens: int) -> str:
    return json.dumps({"method": method, "model": model, "num_speculative_tokens": tokens})


def _base(head) -> str:
    return head.base_model_name_or_path or "<base model>"


def eagle_sections(head, fmt: str, where: str) -> list[str]:
    """An EAGLE head's card sections: vLLM (speculators, eagle layouts) and SGLang (eagle layout)."""
    base = _base(head)
    if fmt == "hf-specdec":
        return [_export_hint(where, ["speculators", "eagle"] if head.version == 3 else ["eagle"])]
    tree = {**_EAGLE_TREE_DEFAULTS, **{k: v for k, v in head.tree.items() if v is not None}}
    chain = int(tree["depth"])
    kind = "eagle3" if head.version == 3 else "eagle"
    vllm_lines = []
    if fmt == "speculators":
        vllm_lines += [
            "```bash",
            f"vllm serve {where}",
            "```",
            "",
            "vLLM reads the verifier (the target model) from `speculators_config.verifier` and drafts "
            f"`speculative_tokens` = {chain} tokens per step. The long form picks the target and the number of tokens:",
            "",
        ]
    vllm_lines += ["```bash", f"vllm serve {base} --speculative-config '{_spec_config(kind, where, chain)}'", "```"]
    notes = [
        "vLLM drafts a chain: the draft's top-1 token at each of `num_speculative_tokens` steps. hf-specdec's "
        f"dynamic tree (top_k={tree['top_k']}, depth={tree['depth']}, num_nodes={tree['num_nodes']}) has no vLLM "
        "counterpart in this format; recent vLLM releases have an experimental static tree "
        "(`speculative_token_tree`) for EAGLE drafters.",
    ]
    if head.version == 1 and head.fc.bias is not None:
        notes.append(
            "**This head's `fc` has a bias, which vLLM's EAGLE-1 drafter does not have**: vLLM builds `fc` without a "
            "bias and skips the `fc.bias` tensor, so it would draft with a different function (the output stays "
            "exact, acceptance drops). Serve this head with SGLang."
        )
    if head.version == 1 and head.draft_vocab_size is not None:
        notes.append(
            f"The head drafts over a draft vocabulary of {head.draft_vocab_size} tokens (`d2t` / `t2d`); the EAGLE-1 "
            "drafters of vLLM and SGLang know no draft vocabulary and draft over the full vocabulary with the "
            "target's lm_head (vLLM skips tensors it has no parameter for)."
        )
    sections = ["## Serve with vLLM\n\n" + "\n".join(vllm_lines) + "\n\n" + "\n\n".join(f"- {n}" for n in notes)]
    sections.append(_sglang_section(head, fmt, where, base, tree))
    return sections


def _sglang_section(head, fmt: str, where: str, base: str, tree: dict) -> str:
    if fmt != "eagle":
        return (
            "## Serve with SGLang\n\n"
            "SGLang loads EAGLE-3 heads in the upstream (SpecForge) layout: write it with "
            f"`hf-specdec export {where} --format eagle --out DIR` and follow that folder's model card."
        )
    algorithm = "EAGLE3" if head.version == 3 else "EAGLE"
    command = (
        f"python -m sglang.launch_server --model-path {base} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {where} --speculative-num-steps {tree['depth']} "
        f"--speculative-eagle-topk {tree['top_k']} --speculative-num-draft-tokens {int(tree['num_nodes']) + 1}"
    )
    return (
        "## Serve with SGLang\n\n```bash\n" + command + "\n```\n\n"
        "- SGLang drafts EAGLE-2's dynamic tree, as hf-specdec does: `--speculative-num-steps` is the tree depth, "
        "`--speculative-eagle-topk` the children per expanded node, `--speculative-num-draft-tokens` the tokens "
        "verified per step (the kept nodes plus the root); the values above are this head's tree defaults. "
        "`--speculative-eagle-topk 1` gives a chain."
    )


def medusa_sections(head, fmt: str, where: str) -> list[str]:
    """Medusa heads' card sections: vLLM's Medusa layout; SGLang has no Medusa drafter."""
    base = _base(head)
    if fmt == "hf-specdec":
        return [_export_hint(where, ["medusa"])]
    lm = (
        "`lm_heads.0.weight` is a copy of the target's lm_head (`original_lm_head: true`): vLLM's Medusa has no "
        "access to the target's own."
        if head.share_lm_head
        else "Each head has its own lm_head (`lm_heads.{i}.weight`)."
    )
    vocab = (
        f" The heads predict a truncated vocabulary of {head.draft_vocab_size} tokens (`token_map`, "
        "`truncated_vocab_size`)."
        if head.draft_vocab_size is not None
        else ""
    )
    command = f"vllm serve {base} --speculative-config '{_spec_config('medusa', where, head.num_heads)}'"
    return [
        "## Serve with vLLM\n\n```bash\n" + command + "\n```\n\n"
        f"- vLLM's Medusa drafts a chain: the top-1 guess of each of the first `num_speculative_tokens` (at most "
        f"{head.num_heads}) heads. hf-specdec's static tree of top-k guesses per head has no vLLM counterpart.\n"
        f"- {lm}{vocab}",
        "## Serve with SGLang\n\nSGLang has no Medusa drafter.",
    ]


def dflash_sections(head, fmt: str, where: str) -> list[str]:
    """A DFlash head's card sections: vLLM reads the speculators layout."""
    if fmt == "hf-specdec":
        return [_export_hint(where, ["speculators"])]
    return [
        f"## Serve with vLLM\n\n```bash\nvllm serve {where}\n```\n\n"
        "- vLLM reads the verifier (the target model) from `speculators_config.verifier` and drafts a chain: the "
        f"top-1 token of each of the block's {head.num_depths} slots (`speculative_tokens`, block_size - 1), one "
        "forward per step. hf-specdec drafts a DDTree from the same forward; it has no vLLM counterpart."
    ]


__all__ = ["dflash_sections", "eagle_sections", "medusa_sections", "serving_sections"]
