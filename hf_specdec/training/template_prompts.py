"""The project's own prompt set: instructions built from templates x topics, and stage-2 tasks over the target's
own stage-1 answers; written for this project, no benchmark text.

    prompts = make_prompts(2000, seed=0)                         # templates x topics, fixed seed
    context = make_context_prompts(load_distillation_data("out/data"), tok, 500, seed=0)

`distinct_prompts` is the draw every prompt builder here and in `task_prompts` shares: tasks round-robin, duplicates
redrawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .shards import DistillationData

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


__all__ = [
    "CONTEXT_TEMPLATES",
    "TEMPLATES",
    "TOPICS",
    "context_prompt_recipe",
    "distinct_prompts",
    "make_context_prompts",
    "make_prompts",
    "prompt_recipe",
]
