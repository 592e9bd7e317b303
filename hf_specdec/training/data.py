"""Self-distillation data for speculative heads: a prompt set built here, the target's own answers, and the target's
final hidden states cached to disk so that head training never runs the target again.

    prompts = make_prompts(2000, seed=0)                         # templates x topics, fixed seed; no benchmark text
    ids = [chat_prompt_ids(tok, p)[0].tolist() for p in prompts]
    manifest = build_distillation_data(model, ids, "out/data", recipe=prompt_recipe(2000, 0), max_new_tokens=256)
    data = load_distillation_data("out/data")                    # flat ids / hidden states / sequence bounds

On disk (``out_dir``): ``manifest.json`` (the recipe: prompt templates, seed, counts, generation settings, the base
model's sizes, one entry per finished shard) and ``shard-00000.safetensors``... Each shard holds, for its sequences
(prompt + answer, no padding) concatenated: ``input_ids`` `[N]` int32, ``hidden`` `[N, H]` (fp16 or fp32: the base
model's final normed hidden states, what its lm_head sees; ``hidden[t]`` maps to token ``t + 1``), and per sequence
``seq_lens`` / ``prompt_lens`` `[S]` int64. Data built by teacher forcing over fixed text
(`hf_specdec.training.teacher_forced`) also hold ``target_next`` `[N]` int32 (the target's arg-max next token at
each position, over its whole vocabulary) and ``answer_mask`` `[N]` uint8 (the tokens an assistant wrote; several
turns per sequence). A rerun skips the shards the manifest already lists (resumable).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..cache.model_arg import cache_kwarg
from ..heads.hub import base_model_dims
from ..heads.hub import base_model_name as loaded_name
from ..models import chat_prompt_ids
from .benchmark_questions import find_questions_file, spec_bench_overlap

MANIFEST_NAME = "manifest.json"
CONTEXT_STAGE_DIR = "context"  # stage-2 data, inside the stage-1 folder
DATA_FORMAT_VERSION = 1

# ---------------------------------------------------------------------------------------------------- prompt set
# Instructions built from templates x topics with a fixed seed. Written for this project: no benchmark questions.
TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "the immune system", "volcanoes",
    "renewable energy", "the French Revolution", "the printing press", "ancient Rome", "the Silk Road",
    "machine learning", "binary search", "hash tables", "recursion", "compilers", "public-key cryptography",
    "the internet", "electric cars", "honey bees", "coral reefs", "rainforests", "the Moon", "Mars", "gravity",
    "magnetism", "sound waves", "rainbows", "vaccines", "sleep", "healthy breakfasts", "bread baking", "coffee",
    "chess", "jazz music", "the piano", "origami", "gardening", "recycling", "public libraries", "bicycles",
    "trains", "lighthouses", "weather forecasts", "clouds", "earthquakes", "glaciers", "deserts", "dolphins",
    "owls", "the human heart", "DNA", "the periodic table", "prime numbers", "fractions", "probability",
    "budgeting", "time management", "job interviews", "learning a new language", "teamwork", "museums",
    "the Olympic Games", "football", "marathons", "mountain hiking", "camping", "photography", "painting",
    "poetry", "fairy tales", "robots", "satellites", "the stock market", "inflation", "supply and demand",
    "democracy", "climate change", "ocean tides", "spreadsheets", "databases", "operating systems",
    "unit testing", "version control", "open-source software", "smartphones", "3D printing", "solar panels",
)  # fmt: skip

TEMPLATES = {
    "write": (
        "Write a short story about {topic}.",
        "Write a poem about {topic}.",
        "Write a friendly email inviting a colleague to a talk about {topic}.",
        "Write a product description for a children's book about {topic}.",
        "Write a short blog post introduction about {topic}.",
    ),
    "explain": (
        "Explain {topic} to a ten-year-old.",
        "Explain how {topic} works in simple terms.",
        "What is the most important thing to know about {topic}?",
        "Why does {topic} matter? Give two reasons.",
        "Describe {topic} in one paragraph.",
    ),
    "summarise": (
        "Summarise what you know about {topic} in three sentences.",
        "Give a one-sentence summary of {topic}.",
        "Summarise the history of {topic} briefly.",
    ),
    "list": (
        "List five facts about {topic}.",
        "List three common misconceptions about {topic}.",
        "Give me a numbered list of questions a student might ask about {topic}.",
        "List the pros and cons of {topic}.",
    ),
    "compare": (
        "Compare {topic} and {other}.",
        "What do {topic} and {other} have in common?",
    ),
    "translate": (
        'Translate into {language}: "{sentence}"',
        'How would you say "{sentence}" in {language}?',
    ),
    "compute": (
        "What is {a} plus {b}? Show your work.",
        "What is {a} times {b}? Explain step by step.",
        "A shop sells pens at {a} cents each. How much do {b} pens cost?",
        "If a train travels {a} kilometres in {b} hours, what is its average speed?",
    ),
    "code": (
        "Write a Python function that returns the sum of a list of numbers, then explain it.",
        "Write a Python function that checks whether a number is a multiple of {b}.",
        "Write a Python function that counts the vowels in a string.",
        "Explain what a for loop does in Python, using an example about {topic}.",
    ),
}

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
SENTENCES = (
    "The weather is nice today.",
    "Where is the train station?",
    "I would like a cup of tea, please.",
    "My brother is reading a book about {topic}.",
    "We are going to the museum tomorrow.",
    "Thank you for your help.",
    "The children are playing in the garden.",
    "Can you recommend a good restaurant?",
)


# Stage 2: tasks *over a text*, the text being one of the target's own stage-1 answers (so no outside corpus and no
# benchmark text): summarising, answering questions about one or two passages, extracting, rewriting, translating the
# target's own translations back, plus word problems. They teach the heads what answers that lean on a context look
# like, which the stage-1 instructions alone never show.
CONTEXT_TEMPLATES = {
    "summarise": (
        "Summarize the following text in two sentences.\n\n{text}",
        "Write a one-sentence summary of this passage:\n\n{text}",
        "Here is a text:\n\n{text}\n\nWhat are its main points? Answer briefly.",
    ),
    "answer": (
        "Read the passage and answer the question.\n\nPassage: {text}\n\nQuestion: {question}",
        "{text}\n\nBased on the text above: {question}",
        "Answer the question using the documents below.\n\nDocument 1: {text}\n\nDocument 2: {text2}\n\n"
        "Question: {question}",
    ),
    "extract": (
        "List the key terms mentioned in this text, with a short definition of each:\n\n{text}",
        "Give this text a title and explain your choice:\n\n{text}",
    ),
    "rewrite": (
        "Rewrite the following text for a ten-year-old:\n\n{text}",
        "Continue this text with one more paragraph:\n\n{text}",
    ),
    "translate": (
        "Translate into English:\n\n{foreign}",
        "Translate the following text into {language}:\n\n{first_sentence}",
    ),
    "word_problem": (
        "{name} has {a} apples, buys {b} more and gives {c} to a friend. How many apples are left? Think step by step.",
        "A bus carries {a} passengers. At the first stop {c} get off and {b} get on. How many passengers are on the "
        "bus now? Explain your reasoning.",
        "A recipe needs {c} eggs per cake. How many eggs do {b} cakes need, and how many boxes of 12 eggs is that? "
        "Show the calculation.",
        "{name} saves {c} dollars a week. How many weeks until {name} has at least {a}{b} dollars? Solve it step by "
        "step.",
        "A rectangle is {a} cm long and {c} cm wide. What are its area and its perimeter? Show your work.",
    ),
}
CONTEXT_QUESTIONS = (
    "What is the passage mainly about?",
    "Which facts does the passage give? Name three.",
    "What is one example mentioned in the passage?",
    "Who would find this text useful, and why?",
    "What is the most important claim in the passage?",
)
NAMES = ("Anna", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro")
MIN_CONTEXT_WORDS = 20


def prompt_recipe(num_prompts: int, seed: int = 0) -> dict:
    """The JSON-able description of `make_prompts(num_prompts, seed)` recorded in the manifest."""
    return {
        "kind": "templates x topics",
        "num_prompts": int(num_prompts),
        "seed": int(seed),
        "templates": {task: list(t) for task, t in TEMPLATES.items()},
        "topics": list(TOPICS),
        "languages": list(LANGUAGES),
        "sentences": list(SENTENCES),
        "numbers": "a, b uniform in [2, 99]",
    }


def make_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct instructions: tasks (write, explain, summarise, list, compare, translate, compute,
    code) round-robin, each a random template filled with random topics / numbers / sentences from ``seed``.

    Deterministic for a given ``(num_prompts, seed)``; a prefix of a longer list with the same seed.
    """
    rng = random.Random(seed)

    def make(task: str) -> str:
        topic, other = rng.sample(TOPICS, 2)
        fields = {
            "topic": topic,
            "other": other,
            "language": rng.choice(LANGUAGES),
            "sentence": rng.choice(SENTENCES).format(topic=topic),
            "a": rng.randint(2, 99),
            "b": rng.randint(2, 99),
        }
        return rng.choice(TEMPLATES[task]).format(**fields)

    return distinct_prompts(num_prompts, list(TEMPLATES), make, "prompts from the templates")


def distinct_prompts(num_prompts: int, tasks: Sequence[str], make, what: str, key=None) -> list:
    """``num_prompts`` distinct results of ``make(task)``, the tasks taken round-robin (duplicates are redrawn).

    Args:
        num_prompts: how many to return.
        tasks: the task names passed to ``make`` in turn.
        make: ``make(task) -> prompt`` (random, from the caller's seeded generator).
        what: what is made, for the error message.
        key: ``key(prompt) -> hashable`` that decides when two prompts are the same (default: the prompt itself).
    Raises:
        ValueError: when the templates cannot give that many distinct prompts.
    """
    prompts: list = []
    seen: set = set()
    attempts = 0
    while len(prompts) < num_prompts:
        attempts += 1
        if attempts > 50 * num_prompts + 1000:
            raise ValueError(
                f"cannot make {num_prompts} distinct {what} (got {len(prompts)}); ask for fewer or add templates"
            )
        prompt = make(tasks[attempts % len(tasks)])
        k = prompt if key is None else key(prompt)
        if k not in seen:
            seen.add(k)
            prompts.append(prompt)
    return prompts


def context_prompt_recipe(num_prompts: int, seed: int = 0) -> dict:
    """The JSON-able description of `make_context_prompts` recorded in the stage-2 manifest."""
    return {
        "kind": "tasks over the target's own stage-1 answers",
        "num_prompts": int(num_prompts),
        "seed": int(seed),
        "templates": {task: list(t) for task, t in CONTEXT_TEMPLATES.items()},
        "questions": list(CONTEXT_QUESTIONS),
        "names": list(NAMES),
        "min_context_words": MIN_CONTEXT_WORDS,
        "numbers": "a, b uniform in [2, 99], c uniform in [2, 12]",
    }


def _stage1_texts(data: DistillationData, tokenizer) -> tuple[list[str], list[str]]:
    """``(answers, foreign)``: the decoded stage-1 answers of at least `MIN_CONTEXT_WORDS` words, and the answers to
    the translation instructions (text in another language)."""
    answers, foreign = [], []
    for start, answer_start, end in data.seq_bounds.tolist():
        prompt = tokenizer.decode(data.input_ids[start:answer_start].tolist(), skip_special_tokens=True)
        text = tokenizer.decode(data.input_ids[answer_start:end].tolist(), skip_special_tokens=True).strip()
        if not text:
            continue
        if "Translate into" in prompt or "How would you say" in prompt:
            foreign.append(text)
        elif len(text.split()) >= MIN_CONTEXT_WORDS:
            answers.append(text)
    return answers, foreign


def make_context_prompts(stage1: DistillationData, tokenizer, num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct stage-2 instructions: `CONTEXT_TEMPLATES` tasks round-robin over the target's own
    stage-1 answers (decoded with ``tokenizer``), random numbers and names. Deterministic for given data and seed."""
    answers, foreign = _stage1_texts(stage1, tokenizer)
    if len(answers) < 2:
        raise ValueError("the stage-1 data holds fewer than two answers long enough to serve as context")
    rng = random.Random(seed)

    def make(task: str) -> str:
        text, text2 = rng.sample(answers, 2)
        templates = CONTEXT_TEMPLATES[task]
        if task == "translate" and not foreign:
            templates = templates[1:]
        fields = {
            "text": text,
            "text2": text2,
            "question": rng.choice(CONTEXT_QUESTIONS),
            "foreign": rng.choice(foreign) if foreign else "",
            "language": rng.choice(LANGUAGES),
            "first_sentence": text.split(". ")[0].rstrip(".") + ".",
            "name": rng.choice(NAMES),
            "a": rng.randint(2, 99),
            "b": rng.randint(2, 99),
            "c": rng.randint(2, 12),
        }
        return rng.choice(templates).format(**fields)

    return distinct_prompts(num_prompts, list(CONTEXT_TEMPLATES), make, "context prompts")


# ---------------------------------------------------------------------------------------------------- target data
def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, W]` left-padded ids and attention mask of a batch of prompt id lists."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _generate_answers(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int, eos_ids: set[int], gen_kwargs: dict
) -> list[list[int]]:
    """Answers of ``model`` to a batch of prompt id lists (left padding), each cut after its first EOS."""
    device = next(model.parameters()).device
    ids, mask = _left_padded(prompts, pad_id)  # [B, W]
    width = ids.shape[1]
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        **gen_kwargs,
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


@torch.no_grad()
def greedy_answers_with_states(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: set[int],
    aux_layers: Sequence[int] = (),
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy answers of ``model`` to a batch of prompt id lists and, in the same forwards, the final hidden states
    of every prompt and answer token (no second pass over the finished sequences).

    The batch is left-padded with position ids counted over real tokens (as `generate` does); rows that reached an
    EOS leave the batch (their cache rows are dropped), so short answers stop costing compute. One last forward over
    each answer's final token gives its state too.

    Args:
        model: the target (a transformers causal LM whose ``get_decoder()`` returns the final-normed states).
        prompts: token ids of each prompt.
        max_new_tokens: answer length cap.
        pad_id / eos_ids: padding id and the ids that end an answer (kept in the answer).
        aux_layers: indices into transformers' ``hidden_states`` tuple (EAGLE-3's feature layers) whose states are
            returned too, concatenated after the final state of each token.
    Returns:
        ``(answers, states)``: per row the answer ids (cut after the first EOS) and `[len(prompt) + len(answer),
        H * (1 + len(aux_layers))]` hidden states (on the CPU): the final state, then each aux layer's.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    ids, mask = _left_padded(prompts, pad_id)  # [B, W]
    width = ids.shape[1]
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache()
    rows = torch.arange(len(prompts), device=device)  # [b] original row of each live batch row
    answers: list[list[int]] = [[] for _ in prompts]
    states: list[list[torch.Tensor]] = [[] for _ in prompts]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    past = {**cache_kwarg(decoder.forward, cache), "output_hidden_states": bool(aux_layers)}

    def states_of(out) -> torch.Tensor:  # [b, q, H * (1 + len(aux_layers))]
        return torch.cat([out.last_hidden_state] + [out.hidden_states[i] for i in aux_layers], dim=-1)

    out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, **past)
    h, hs = out.last_hidden_state, states_of(out)
    for i, p in enumerate(prompts):
        states[i].append(hs[i, width - len(p) :].cpu())
    next_pos = positions[:, -1:] + 1  # [b, 1]
    for step in range(max_new_tokens):
        token = lm_head(h[:, -1]).argmax(-1)  # [b]
        live = []
        for r, t in zip(rows.tolist(), token.tolist()):
            answers[r].append(t)
            live.append(t not in eos_ids and step + 1 < max_new_tokens)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = decoder(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, **past)
        h, hs = out.last_hidden_state, states_of(out)  # [b, 1, H]: the state of the token just chosen
        hs = hs.cpu()  # one copy per step, not one per row (on a GPU each .cpu() is a synchronising transfer)
        for j, r in enumerate(rows.tolist()):
            states[r].append(hs[j])
        keep = torch.tensor(live, device=device)
        if not keep.all():
            if not keep.any():
                break
            index = keep.nonzero().flatten()
            cache.batch_select_indices(index)
            rows, mask, h, next_pos = rows[index], mask[index], h[index], next_pos[index]
        next_pos = next_pos + 1
    return answers, [torch.cat(s) for s in states]


@torch.no_grad()
def final_hidden_states(
    model, sequences: Sequence[Sequence[int]], aux_layers: Sequence[int] = ()
) -> list[torch.Tensor]:
    """`[len_i, H * (1 + len(aux_layers))]` per sequence: the model's last entry of ``hidden_states`` (the normed
    states its lm_head sees), then the entries ``aux_layers`` (EAGLE-3's feature layers) if any.

    The batch is right-padded, so (causal attention) no real token sees a pad and positions need no offset.
    Checks, on the longest sequence, that the lm_head applied to the state reproduces the model's logits.
    """
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1]  # [B, W, H]
    longest = max(range(len(sequences)), key=lambda i: len(sequences[i]))
    if len(sequences[longest]) == width:
        lm_head = model.get_output_embeddings()
        again = lm_head(hidden[longest, -1:]).float()
        ref = out.logits[longest, -1:].float()
        if not torch.allclose(again, ref, atol=1e-3 * max(1.0, ref.abs().max().item()), rtol=1e-3):
            raise RuntimeError(
                f"{type(model).__name__}: lm_head(hidden_states[-1]) does not reproduce the logits, so the last "
                "hidden state is not the one fed to the lm_head (a final norm or logit scaling is missing); Medusa "
                "heads need the states the lm_head sees"
            )
    hidden = torch.cat([hidden] + [out.hidden_states[i] for i in aux_layers], dim=-1)
    return [hidden[i, : len(s)].cpu() for i, s in enumerate(sequences)]


def _fingerprint(prompt_ids: Sequence[Sequence[int]], settings: dict) -> str:
    h = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def build_distillation_data(
    model,
    prompt_ids: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    recipe: dict | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    shard_size: int = 64,
    do_sample: bool = False,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    hidden_dtype: torch.dtype = torch.float16,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    base_model_name: str | None = None,
    aux_layers: Sequence[int] = (),
    progress: bool = True,
) -> dict:
    """Let ``model`` answer every prompt and cache ids + final hidden states in safetensors shards under ``out_dir``.

    Resumable: shards the manifest already lists are skipped; a manifest written for other prompts or settings is
    refused (use a fresh folder).

    Args:
        model: the target (a transformers causal LM), in eval mode.
        prompt_ids: token ids of each prompt, chat template applied.
        out_dir: the data folder (created).
        recipe: how the prompts were made (`prompt_recipe`), recorded in the manifest.
        max_new_tokens: answer length cap.
        batch_size: prompts per `generate` / forward call.
        shard_size: sequences per shard file.
        do_sample / temperature / top_p: generation (greedy by default; sampling is seeded per shard).
        seed: sampling seed.
        hidden_dtype: dtype of the stored hidden states.
        eos_token_id / pad_token_id: default to the model's generation config.
        base_model_name: recorded in the manifest (default: ``model.config._name_or_path``).
        aux_layers: also store the states of these entries of transformers' ``hidden_states`` tuple (an EAGLE-3
            head's feature layers, e.g. ``EagleHead.bind(model).feature_layers``) as ``aux_hidden``
            `[N, H * len(aux_layers)]`.
        progress: tqdm bar.
    Returns:
        the manifest dict (also in ``out_dir/manifest.json``).
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    how = _Answering.of(model, max_new_tokens, batch_size, do_sample, temperature, top_p, eos_token_id, pad_token_id,
                        aux_layers)  # fmt: skip
    settings = {"generation": how.describe(seed), "shard_size": int(shard_size), "hidden_dtype": str(hidden_dtype)}
    if how.aux_layers:  # only then: folders built before keep their fingerprint
        settings["aux_layers"] = list(how.aux_layers)
    manifest = _open_manifest(out, model, prompt_ids, settings, recipe, base_model_name)
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).is_file()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    bar = tqdm(total=len(prompt_ids), desc="target answers", unit="prompt", disable=not progress)
    for index, start in enumerate(range(0, len(prompt_ids), shard_size)):
        name = f"shard-{index:05d}.safetensors"
        chunk = prompt_ids[start : start + shard_size]
        if name in done:
            bar.update(len(chunk))
            continue
        t0 = time.perf_counter()
        if do_sample:
            torch.manual_seed(seed * 1_000_003 + index)
        seqs, hiddens = how.answer(model, chunk, bar)
        entry = _write_shard(out / name, seqs, hiddens, chunk, hidden_dtype, len(how.aux_layers))
        record_shard(out, manifest, name, start, entry, t0)
    bar.close()
    return finish_manifest(out, manifest)


def record_shard(out: Path, manifest: dict, name: str, start: int, entry: dict, t0: float) -> None:
    """Add a written shard (``entry`` from `_write_shard`, begun at ``t0``) to ``manifest`` and save it, so that a
    build stopped after this shard resumes after it."""
    manifest["shards"].append({"file": name, "first_prompt": start, **entry,
                               "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
    manifest["shards"].sort(key=lambda s: s["first_prompt"])
    write_json(out / MANIFEST_NAME, manifest)


def finish_manifest(out: Path, manifest: dict) -> dict:
    """Mark ``manifest`` complete with its totals over the shards, save and return it."""
    manifest["complete"] = True
    for key in ("num_sequences", "num_tokens", "num_answer_tokens"):
        manifest[key] = sum(s[key] for s in manifest["shards"])
    write_json(out / MANIFEST_NAME, manifest)
    return manifest


@dataclass
class _Answering:
    """How `build_distillation_data` lets the target answer: length, batch, greedy or sampled, stop and pad ids."""

    max_new_tokens: int
    batch_size: int
    do_sample: bool
    temperature: float
    top_p: float
    eos_ids: set[int]
    pad: int
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, model, max_new_tokens, batch_size, do_sample, temperature, top_p, eos_token_id, pad_token_id, aux_layers=()
    ):
        """Stop and pad ids default to the model's generation config (pad: the lowest stop id, else 0)."""
        gc = model.generation_config
        eos = eos_token_id if eos_token_id is not None else gc.eos_token_id
        eos_ids = set(torch.as_tensor(eos if eos is not None else []).reshape(-1).tolist())
        pad = pad_token_id if pad_token_id is not None else gc.pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        return cls(int(max_new_tokens), int(batch_size), bool(do_sample), float(temperature), float(top_p), eos_ids,
                   int(pad), tuple(int(i) for i in aux_layers))  # fmt: skip

    def describe(self, seed: int) -> dict:
        """The manifest's ``generation`` entry."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.do_sample,
            "temperature": self.temperature if self.do_sample else None,
            "top_p": self.top_p if self.do_sample else None,
            "seed": int(seed),
            "eos_token_id": sorted(self.eos_ids),
            "pad_token_id": self.pad,
            "batch_size": self.batch_size,
            "padding": "left (generate), right (hidden-state forward)" if self.do_sample else "left (one greedy pass)",
        }

    def answer(self, model, prompts: Sequence[Sequence[int]], bar) -> tuple[list[list[int]], list[torch.Tensor]]:
        """``(prompt + answer ids of each prompt, their final hidden states [len, H] each)``, ``batch_size`` prompts
        per call."""
        seqs: list[list[int]] = []
        hiddens: list[torch.Tensor] = []
        for b in range(0, len(prompts), self.batch_size):
            batch = [list(map(int, p)) for p in prompts[b : b + self.batch_size]]
            if self.do_sample:
                sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
                with torch.no_grad():
                    answers = _generate_answers(model, batch, self.max_new_tokens, self.pad, self.eos_ids, sampling)
                full = [p + a for p, a in zip(batch, answers)]
                hiddens += final_hidden_states(model, full, self.aux_layers)
            else:
                answers, states = greedy_answers_with_states(
                    model, batch, self.max_new_tokens, self.pad, self.eos_ids, self.aux_layers
                )
                full = [p + a for p, a in zip(batch, answers)]
                hiddens += states
            seqs += full
            bar.update(len(batch))
        return seqs, hiddens


def _open_manifest(out: Path, model, prompt_ids, settings: dict, recipe, base_model_name) -> dict:
    """The folder's manifest (refused when written for other prompts or settings), or a fresh one."""
    fingerprint = _fingerprint(prompt_ids, settings)
    path = out / MANIFEST_NAME
    if path.is_file():
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{out} already holds distillation data for other prompts or generation settings "
                f"(fingerprint {manifest.get('fingerprint')} vs {fingerprint}); use another folder or delete it"
            )
        return manifest
    hidden_size, vocab_size = base_model_dims(model)
    return {
        "format_version": DATA_FORMAT_VERSION,
        "fingerprint": fingerprint,
        "base_model": base_model_name or loaded_name(model) or type(model).__name__,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "prompt_recipe": recipe,
        "num_prompts": len(prompt_ids),
        **settings,
        "shards": [],
        "complete": False,
    }


def _write_shard(
    path: Path,
    seqs: list[list[int]],
    hiddens: list[torch.Tensor],
    prompts,
    hidden_dtype,
    num_aux: int = 0,
    per_token: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Write one shard atomically (``hiddens``: `[len, H * (1 + num_aux)]` each, the final state first; ``per_token``:
    more `[N]` tensors, e.g. ``target_next`` and ``answer_mask``); returns its manifest counts."""
    states = torch.cat(hiddens).to(hidden_dtype)  # [N, H * (1 + num_aux)]
    h = states.shape[-1] // (1 + num_aux)
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "hidden": states[:, :h].contiguous(),
        "seq_lens": torch.tensor([len(s) for s in seqs], dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        **(per_token or {}),
    }
    if num_aux:
        tensors["aux_hidden"] = states[:, h:].contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    if "answer_mask" in tensors:
        answer_tokens = int(tensors["answer_mask"].sum())
    else:
        answer_tokens = int(sum(len(s) - len(p) for s, p in zip(seqs, prompts)))
    return {
        "num_sequences": len(seqs),
        "num_tokens": int(tensors["input_ids"].numel()),
        "num_answer_tokens": answer_tokens,
    }


def build_default_data(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    num_prompts: int = 2000,
    seed: int = 0,
    num_context_prompts: int = 0,
    **kwargs,
) -> list[Path]:
    """The project's self-distillation data in ``tokenizer``'s chat template, in one or two stages.

    Stage 1 (``out_dir``): `build_distillation_data` on `make_prompts(num_prompts, seed)`. Stage 2
    (``out_dir/context``, when ``num_context_prompts`` > 0): on `make_context_prompts` built from stage 1's answers.
    Prompts that coincide with a Spec-Bench question (the file shipped in the package) are dropped and counted.

    Returns:
        the data folders, for `load_distillation_data`.
    """
    questions_file = find_questions_file()

    def build(prompts: list[str], recipe: dict, folder: Path) -> None:
        dropped = set(spec_bench_overlap(prompts, questions_file))
        prompts = [p for p in prompts if p not in dropped]
        recipe["dropped_spec_bench_overlap"] = len(dropped)
        recipe["chat_template"] = True
        ids = [chat_prompt_ids(tokenizer, p)[0].tolist() for p in prompts]
        build_distillation_data(model, ids, folder, recipe=recipe, seed=seed, **kwargs)

    out = Path(out_dir)
    build(make_prompts(num_prompts, seed), prompt_recipe(num_prompts, seed), out)
    folders = [out]
    if num_context_prompts > 0:
        stage1 = load_distillation_data(out)
        context = make_context_prompts(stage1, tokenizer, num_context_prompts, seed)
        build(context, context_prompt_recipe(num_context_prompts, seed), out / CONTEXT_STAGE_DIR)
        folders.append(out / CONTEXT_STAGE_DIR)
    return folders


# ---------------------------------------------------------------------------------------------------- loading
@dataclass
class DistillationData:
    """Every cached sequence, concatenated.

    Attributes:
        input_ids: `[N]` int64 token ids.
        hidden: `[N, H]` the target's final hidden states (stored dtype).
        seq_start: `[N]` int64, index of the first token of each token's sequence.
        seq_end: `[N]` int64, one past the last token of each token's sequence.
        answer_start: `[N]` int64, index of the first answer token of each token's sequence.
        seq_bounds: `[S, 3]` int64 (start, answer start, end) per sequence.
        manifest: the manifest dict.
        folder: the data folder it was read from.
        aux_hidden: `[N, H * len(aux_layers)]` the states of the target's ``hidden_states`` entries ``aux_layers``
            (EAGLE-3's features; built with ``aux_layers``), or None.
        aux_layers: those entries, or None.
        answer_mask: `[N]` bool, the tokens an assistant wrote (the target's answers; in teacher-forced data, every
            assistant turn). None means: from each sequence's answer start to its end.
        target_next: `[N]` int64, the target's arg-max next token after each position (teacher-forced data), or
            None. `next_tokens` gives it for any data.
    """

    input_ids: torch.Tensor
    hidden: torch.Tensor
    seq_start: torch.Tensor
    seq_end: torch.Tensor
    answer_start: torch.Tensor
    seq_bounds: torch.Tensor
    manifest: dict
    folder: Path | None = None
    aux_hidden: torch.Tensor | None = None
    aux_layers: tuple[int, ...] | None = None
    answer_mask: torch.Tensor | None = None
    target_next: torch.Tensor | None = None

    def __post_init__(self):
        if self.answer_mask is None:
            pos = torch.arange(self.input_ids.numel())
            self.answer_mask = (pos >= self.answer_start) & (pos < self.seq_end)

    def next_tokens(self) -> torch.Tensor:
        """`[N]` int64: the target's next token after each position where the data say it, -1 elsewhere.

        Teacher-forced data store it for every position. In self-distilled data the answers are the target's own
        greedy tokens, so after position t it is token t + 1 wherever that is an answer token; after prompt
        positions it is unknown here (-1; the trainers take the arg-max of the target's lm_head over the stored state
        where they need it).
        """
        if self.target_next is not None:
            return self.target_next
        n = self.input_ids.numel()
        nxt = torch.full((n,), -1, dtype=torch.long)
        pos = torch.arange(n - 1)
        known = self.answer_mask[1:] & (pos + 1 < self.seq_end[:-1])
        nxt[:-1][known] = self.input_ids[1:][known]
        return nxt

    def on_target_path(self) -> torch.Tensor:
        """`[N]` bool: whether the token after each position is one the decoding loop would also have there:
        given text (a prompt or user turn) or the target's own greedy choice.

        Self-distilled answers are the target's own tokens, so every position is on the path. Teacher-forced answers
        are someone else's text: token t + 1 is on the path only where it equals the target's arg-max after t (about
        two thirds of ShareGPT's answer tokens for SmolLM2-135M). Heads that guess several tokens ahead from the
        state at t (Medusa, the MLP speculator) are trained only where the tokens between are on it: elsewhere
        their labels describe a continuation the target never writes.
        """
        on = torch.ones(self.input_ids.numel(), dtype=torch.bool)
        if self.target_next is None:
            return on
        answer_next = self.answer_mask[1:]  # the token after t was written by an assistant
        on[:-1] = ~answer_next | (self.input_ids[1:] == self.target_next[:-1])
        return on

    def features(self, layers: Sequence[int]) -> torch.Tensor:
        """`[N, F]` the stored states a head reads: ``(-1,)`` = the final states (EAGLE-1), else the aux layers these
        data were built with (EAGLE-3); other layers are an error naming what the data hold."""
        layers = tuple(int(i) for i in layers)
        if layers == (-1,):
            return self.hidden
        if self.aux_hidden is None or layers != self.aux_layers:
            held = f"the states of layers {list(self.aux_layers)}" if self.aux_layers else "only the final states"
            raise ValueError(
                f"the head reads the target's hidden states {list(layers)}, but {self.folder} holds {held}; build "
                f"the data with aux_layers={list(layers)}"
            )
        return self.aux_hidden


def load_distillation_data(
    data_dir: str | os.PathLike | Sequence[str | os.PathLike], evaluation_only_ok: bool = False, with_aux: bool = True
) -> DistillationData:
    """Read the shards of ``data_dir`` (built by `build_distillation_data` or `build_teacher_forced_data`) into
    memory; a list of folders (built for the same base model) is read as one dataset, in order. ``with_aux=False``
    leaves the EAGLE-3 layer states on disk (a head reading the final states alone does not need them).

    A folder whose prompt recipe says ``evaluation_only`` (the target's answers to benchmark questions,
    `hf_specdec.bench.head_eval`) is refused unless ``evaluation_only_ok``: heads are never trained on it.
    """
    if not isinstance(data_dir, (str, os.PathLike)):
        parts = [load_distillation_data(d, evaluation_only_ok, with_aux) for d in data_dir]
        if not parts:
            raise ValueError("no data folder given")
        return _concatenate(parts)
    folder = Path(data_dir)
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{folder} has no {MANIFEST_NAME}; build the data with build_distillation_data first")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if (manifest.get("prompt_recipe") or {}).get("evaluation_only") and not evaluation_only_ok:
        raise ValueError(
            f"{folder} holds the target's answers to benchmark questions (evaluation only); heads are never trained "
            "on it. Pass it to the head evaluation (hf-specdec eval-heads), not to a trainer"
        )
    if not manifest["shards"]:
        raise ValueError(f"{folder}: the manifest lists no finished shard")
    ids, hidden, aux, lens, plens, masks, nexts = [], [], [], [], [], [], []
    aux_layers = tuple(manifest.get("aux_layers") or ()) or None
    if aux_layers and not with_aux:
        aux_layers = None
    teacher_forced = bool(manifest.get("teacher_forced"))
    for shard in manifest["shards"]:
        with safe_open(str(folder / shard["file"]), framework="pt", device="cpu") as f:
            ids.append(f.get_tensor("input_ids").long())
            hidden.append(f.get_tensor("hidden"))
            if aux_layers:
                aux.append(f.get_tensor("aux_hidden"))
            lens.append(f.get_tensor("seq_lens"))
            plens.append(f.get_tensor("prompt_lens"))
            if teacher_forced:
                masks.append(f.get_tensor("answer_mask").bool())
                nexts.append(f.get_tensor("target_next").long())
    seq_lens, prompt_lens = torch.cat(lens), torch.cat(plens)
    ends = seq_lens.cumsum(0)
    starts = ends - seq_lens
    bounds = torch.stack([starts, starts + prompt_lens, ends], dim=1)  # [S, 3]
    return DistillationData(
        input_ids=torch.cat(ids),
        hidden=torch.cat(hidden),
        seq_start=starts.repeat_interleave(seq_lens),
        seq_end=ends.repeat_interleave(seq_lens),
        answer_start=(starts + prompt_lens).repeat_interleave(seq_lens),
        seq_bounds=bounds,
        manifest=manifest,
        folder=folder,
        aux_hidden=torch.cat(aux) if aux_layers else None,
        aux_layers=aux_layers,
        answer_mask=torch.cat(masks) if teacher_forced else None,
        target_next=torch.cat(nexts) if teacher_forced else None,
    )


def _concatenate(parts: list[DistillationData]) -> DistillationData:
    first = parts[0].manifest
    for part in parts[1:]:
        m = part.manifest
        if (m["base_model"], m["hidden_size"], m["vocab_size"]) != (
            first["base_model"],
            first["hidden_size"],
            first["vocab_size"],
        ):
            raise ValueError(
                f"data folders {parts[0].folder} and {part.folder} were built for different base models "
                f"({first['base_model']} vs {m['base_model']})"
            )
    offsets = [0]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + part.input_ids.numel())
    manifest = {
        **first,
        "parts": [p.manifest for p in parts],
        "num_sequences": sum(int(p.seq_bounds.shape[0]) for p in parts),
        "num_tokens": sum(int(p.input_ids.numel()) for p in parts),
        "num_answer_tokens": sum(int(p.manifest.get("num_answer_tokens", 0)) for p in parts),
        "num_prompts": sum(int(p.manifest.get("num_prompts", 0)) for p in parts),
    }
    return DistillationData(
        input_ids=torch.cat([p.input_ids for p in parts]),
        hidden=torch.cat([p.hidden for p in parts]),
        seq_start=torch.cat([p.seq_start + o for p, o in zip(parts, offsets)]),
        seq_end=torch.cat([p.seq_end + o for p, o in zip(parts, offsets)]),
        answer_start=torch.cat([p.answer_start + o for p, o in zip(parts, offsets)]),
        seq_bounds=torch.cat([p.seq_bounds + o for p, o in zip(parts, offsets)]),
        manifest=manifest,
        folder=parts[0].folder,
        **_concatenated_aux(parts),
        answer_mask=torch.cat([p.answer_mask for p in parts]),
        target_next=torch.cat([p.next_tokens() for p in parts])
        if any(p.target_next is not None for p in parts)
        else None,
    )


def _concatenated_aux(parts: list[DistillationData]) -> dict:
    """The aux states of ``parts`` joined when every part holds the same layers, else none."""
    layers = {p.aux_layers for p in parts}
    if len(layers) != 1 or None in layers:
        return {"aux_hidden": None, "aux_layers": None}
    return {"aux_hidden": torch.cat([p.aux_hidden for p in parts]), "aux_layers": parts[0].aux_layers}


__all__ = [
    "CONTEXT_STAGE_DIR",
    "CONTEXT_TEMPLATES",
    "DistillationData",
    "TEMPLATES",
    "TOPICS",
    "build_default_data",
    "build_distillation_data",
    "context_prompt_recipe",
    "distinct_prompts",
    "final_hidden_states",
    "greedy_answers_with_states",
    "write_json",
    "load_distillation_data",
    "make_context_prompts",
    "make_prompts",
    "prompt_recipe",
]
