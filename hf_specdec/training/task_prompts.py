"""Training prompts over the six kinds of task that Spec-Bench measures, built without any Spec-Bench text.

Spec-Bench (Xia et al. 2024, arXiv:2401.07851) scores speculative decoding on multi-turn conversation, translation,
summarisation, question answering, math reasoning and answering from a given passage (retrieval-augmented
generation). Heads trained on generic instructions transfer poorly to it: what they miss there is text the target
copies or translates from a long prompt. The prompts here cover the same six kinds in two stages:

1. **Seed stage** (self-instruct, Wang et al. 2023, arXiv:2212.10560): the target writes the material itself:
   passages (news reports, encyclopedia entries, biographies, reviews, letters...), short factual questions about a
   topic, and first answers in conversations. Nothing comes from an outside corpus or the benchmark.
2. **Task stage**: prompts of the six kinds over that material: two-turn conversations that continue the target's own
   first answer, translation of sentences written here in several languages, summaries of the target's passages,
   short factual questions (the target's and templated ones), word problems with random numbers, and questions over
   one to three of the target's passages.

Everything is deterministic for a seed. `TaskPrompt.messages` is a chat (multi-turn prompts carry the target's own
earlier answer); `chat_template.chat_ids` applies the tokenizer's chat template, and `task_data` builds the two
stages' data folders.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .template_prompts import distinct_prompts
from .text_sources import LocalText

TASK_KINDS = ("multi_turn", "translation", "summarisation", "qa", "math_reasoning", "rag")

TOPICS = (
    "a new city library", "a flood in a river valley", "a local football final", "a bakery that opened downtown",
    "a school science fair", "a solar farm", "a mountain rescue", "a jazz festival", "a rise in train fares",
    "a museum exhibition of old maps", "a marathon in the rain", "a shortage of nurses", "a robot vacuum cleaner",
    "a new vaccine trial", "a volcano eruption on an island", "an election for mayor", "a heat wave in summer",
    "a bridge that was closed for repairs", "a chess tournament", "the discovery of a shipwreck", "honey bees",
    "the history of the bicycle", "coral reefs", "the printing press", "the Roman road network", "glaciers",
    "the invention of the telephone", "owls", "the human liver", "tea cultivation", "lighthouses", "the Silk Road",
    "desert plants", "the origin of chess", "paper money", "wind turbines", "the metric system", "tides",
    "a small software company", "a farmer who grows apples", "a violin maker", "a nurse in a rural hospital",
    "a teacher who retired after forty years", "an astronaut's training", "a tailor's shop", "a fishing village",
    "a city park renovation", "a start-up selling electric scooters", "a power outage", "a food festival",
    "an old castle turned into a hotel", "a company's quarterly results", "a new hiking trail", "a lost dog found",
)  # fmt: skip

PASSAGE_TEMPLATES = (
    "Write a short news report about {topic}. Include names, dates and numbers.",
    "Write an encyclopedia-style paragraph about {topic}.",
    "Write a short news article about {topic} in {place}, with a quote from a witness.",
    "Write a short biography of a fictional person connected to {topic}, named {name}.",
    "Write a short review of {topic}.",
    "Write a letter to a friend describing {topic}.",
    "Write a factual report about {topic} for a local newspaper.",
    "Describe {topic} in two paragraphs.",
)
QUESTION_TEMPLATES = (
    "Write three short factual questions about {topic}, one per line. Do not answer them.",
    "Write three questions a student might ask about {topic}, one per line, without answers.",
)
FIRST_TURN_TEMPLATES = (
    "Write a professional email to {name} about {topic}.",
    "Give me some advice about {topic}.",
    "Write a short speech about {topic}.",
    "Explain {topic} to a child.",
    "Write a poem about {topic}.",
    "Pretend you are a tour guide and tell me about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short story about {name} and {topic}.",
)
FOLLOW_UPS = (
    "Now make it shorter.",
    "Rewrite your answer in a more formal tone.",
    "Can you add a concrete example?",
    "Turn your answer into a bulleted list.",
    "Please rewrite it for a ten-year-old.",
    "What would you change to make it more persuasive?",
    "Summarise your previous answer in one sentence.",
    "Write a title for it and explain your choice.",
    "Check your answer for mistakes and correct them.",
    "Continue with one more paragraph.",
)
SUMMARY_TEMPLATES = (
    "Summarize: {text}",
    "Summarize the following article in a few sentences.\n\n{text}",
    "{text}\n\nSummarize the text above.",
    "Write a brief summary of this news story:\n{text}",
)
RAG_TEMPLATES = (
    "{docs}\n\nQuestion: {question}\nAnswer:",
    "Use the passages below to answer the question.\n\n{docs}\n\nQuestion: {question}",
    "{docs}\n\n{question}",
    "Read the documents and answer: {question}\n\n{docs}",
)
QA_TEMPLATES = (
    "{question}",
    "Answer the question: {question}",
    "Question: {question}\nAnswer:",
)
TRANSLATION_TEMPLATES = (
    "Translate {language} to English: {sentence}",
    "Translate the following {language} text into English.\n{sentence}",
    "What does this {language} sentence mean in English? {sentence}",
    "Translate into English: {sentence}",
)
NAMES = ("Anna", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Marta")
PLACES = ("Lyon", "Porto", "Leipzig", "Bergen", "Kyoto", "Nairobi", "Quebec", "Adelaide", "Cork", "Valencia")
# Sentences written for this project, news-style, with slots; several languages.
FOREIGN_SENTENCES = {
    "German": (
        "Der Bürgermeister von {city} hat am {day} einen neuen Plan für den Verkehr vorgestellt .",
        "Nach Angaben der Polizei wurden bei dem Unfall {n} Menschen leicht verletzt .",
        "Die Regierung will bis {year} mehr Geld in Schulen und Krankenhäuser investieren .",
        "Im vergangenen Jahr besuchten mehr als {n} Tausend Gäste das Museum in {city} .",
        "Die Mannschaft gewann das Spiel am Samstag mit {a} zu {b} .",
        "Wegen des Streiks fielen am {day} viele Züge zwischen {city} und Berlin aus .",
        "Die Firma meldete für das dritte Quartal einen Gewinn von {n} Millionen Euro .",
        "Wissenschaftler haben in den Alpen eine neue Pflanzenart entdeckt .",
        "Die Preise für Lebensmittel sind im {month} erneut gestiegen .",
        "Viele Bewohner der Stadt fordern mehr Radwege und weniger Autos im Zentrum .",
        "Das Konzert musste wegen eines Gewitters nach {n} Minuten abgebrochen werden .",
        "Die neue Brücke über den Fluss soll im {month} {year} eröffnet werden .",
        "Laut einer Studie schlafen junge Menschen heute weniger als vor zehn Jahren .",
        "Der Schriftsteller {name} erhielt für seinen ersten Roman einen wichtigen Preis .",
    ),
    "French": (
        "Le maire de {city} a présenté {day} un nouveau projet pour le centre-ville .",
        "Selon la police , {n} personnes ont été légèrement blessées dans l' accident .",
        "Le gouvernement veut investir davantage dans les écoles d' ici {year} .",
        "L' équipe a gagné le match samedi soir sur le score de {a} à {b} .",
        "Les prix de l' énergie ont encore augmenté au mois de {month_fr} .",
        "Des chercheurs ont découvert une nouvelle espèce de poisson dans le lac .",
        "La grève a perturbé le trafic des trains entre {city} et Paris pendant {n} heures .",
        "L' entreprise a annoncé la création de {n} emplois dans la région .",
    ),
    "Spanish": (
        "El alcalde de {city} presentó el {day} un plan para mejorar el transporte público .",
        "Según la policía , {n} personas resultaron heridas en el accidente .",
        "El equipo ganó el partido del sábado por {a} a {b} .",
        "Los precios de la vivienda subieron un {a} por ciento el año pasado .",
        "Un grupo de científicos descubrió restos de un barco antiguo cerca de la costa .",
        "La nueva biblioteca abrirá sus puertas en {year} con más de {n} mil libros .",
    ),
    "Italian": (
        "Il sindaco di {city} ha annunciato un nuovo piano per i parchi della città .",
        "Secondo la polizia , {n} persone sono rimaste ferite nell' incidente .",
        "La squadra ha vinto la partita di domenica per {a} a {b} .",
    ),
}
DAYS = ("Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag")
MONTHS = ("Januar", "März", "Mai", "Juli", "September", "November")
MONTHS_FR = ("janvier", "mars", "mai", "juillet", "septembre", "novembre")
# Short-answer factual questions (template x entity), in the style of open-domain QA.
QA_FACT_TEMPLATES = (
    "What is the capital of {country}?",
    "Which language is mainly spoken in {country}?",
    "Who wrote the novel {book}?",
    "When did {event} take place?",
    "What is the largest {thing} in the world?",
    "How many {unit} are there in a {bigger}?",
    "Where is {landmark} located?",
    "What is {element} used for?",
)
QA_FILLS = {
    "country": ("Portugal", "Kenya", "Norway", "Chile", "Vietnam", "Canada", "Egypt", "Poland", "Peru", "Japan"),
    "book": ("Pride and Prejudice", "Moby-Dick", "War and Peace", "Don Quixote", "Frankenstein", "Dracula"),
    "event": ("the first Moon landing", "the fall of the Berlin Wall", "the French Revolution", "World War I"),
    "thing": ("ocean", "desert", "country by area", "lake", "rainforest", "island"),
    "unit": ("minutes", "days", "centimetres", "grams", "seconds"),
    "bigger": ("hour", "week", "metre", "kilogram", "day"),
    "landmark": ("the Eiffel Tower", "Machu Picchu", "the Great Barrier Reef", "the Acropolis", "Table Mountain"),
    "element": ("copper", "helium", "silicon", "chlorine", "lithium", "iron"),
}
# Multi-step word problems with random numbers (grade-school arithmetic).
MATH_TEMPLATES = (
    "{name} buys {a} notebooks at ${b} each and a pen for ${c}. How much does {name} spend in total?",
    "A bus carries {a} passengers. At the first stop {c} get off and {b} get on. How many passengers are on the "
    "bus now?",
    "{name} reads {c} pages every weekday and twice as many on each day of the weekend. How many pages does "
    "{name} read in a week?",
    "A farmer has {a} chickens. Each chicken lays {c} eggs a week. The farmer sells the eggs in boxes of 6. How "
    "many full boxes does the farmer sell in a week?",
    "{name} earns ${b} per hour and works {c} hours a day for 5 days. {name} saves a quarter of the money. How much "
    "does {name} save?",
    "A shop had {a} apples. It sold {c} apples in the morning and half of the rest in the afternoon. How many "
    "apples are left?",
    "The price of a jacket is ${a}0. It is on sale for {c}0 percent off. What is the sale price?",
    "{name} runs {c} kilometres on Monday, {b} kilometres on Wednesday and {a} kilometres on Saturday. What is "
    "the average distance per run?",
    "A recipe needs {c} eggs for 4 people. How many eggs are needed for {b} people?",
    "{name} has {a} stickers and gives {c} to each of {c} friends. How many stickers does {name} have left?",
)
MIN_PASSAGE_WORDS = 40
# With real text installed, the share of translation / summarisation / passage-question prompts that use it, and how
# often a foreign sentence is written with spaces before punctuation, as tokenised news corpora write it.
REAL_TEXT_SHARE = 0.75
SPACED_PUNCTUATION_SHARE = 0.5
MAX_RAG_DOC_WORDS = 220


@dataclass
class TaskPrompt:
    """One training prompt.

    Attributes:
        kind: one of `TASK_KINDS`, or ``"seed_passage"`` / ``"seed_question"`` / ``"seed_first_turn"``.
        messages: the chat, ``[{"role": "user" | "assistant", "content": str}, ...]``, ending with a user turn.
    """

    kind: str
    messages: list[dict]

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def _key(prompt: TaskPrompt) -> str:
    return repr(prompt.messages)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def seed_prompts(num_prompts: int, seed: int = 0) -> list[TaskPrompt]:
    """Stage 1: prompts that make the target write passages (half), questions (a sixth) and first conversation
    turns (a third). Deterministic; distinct."""
    rng = random.Random(f"seed-stage:{seed}")
    kinds = ["seed_passage", "seed_first_turn", "seed_passage", "seed_question", "seed_passage", "seed_first_turn"]
    templates = {
        "seed_passage": PASSAGE_TEMPLATES,
        "seed_question": QUESTION_TEMPLATES,
        "seed_first_turn": FIRST_TURN_TEMPLATES,
    }

    def make(kind: str) -> TaskPrompt:
        fields = {"topic": rng.choice(TOPICS), "name": rng.choice(NAMES), "place": rng.choice(PLACES)}
        return TaskPrompt(kind, _user(rng.choice(templates[kind]).format(**fields)))

    return distinct_prompts(num_prompts, kinds, make, "seed prompts", key=_key)


@dataclass
class SeedMaterial:
    """What the target wrote in stage 1, sorted by kind.

    Attributes:
        passages: ``(title, text)`` pairs of at least `MIN_PASSAGE_WORDS` words.
        questions: single questions (lines ending with "?").
        conversations: ``(user turn, target answer)`` pairs of first turns.
        real: real text read from installed packages (`text_sources.find_local_text`); when set, a share of the
            translation, summarisation and passage-question prompts use it (`REAL_TEXT_SHARE`).
    """

    passages: list[tuple[str, str]]
    questions: list[str]
    conversations: list[tuple[str, str]]
    real: LocalText | None = None  # real text installed on this machine (`text_sources`), if used

    def counts(self) -> dict:
        counts = {
            "seed_passages": len(self.passages),
            "seed_questions": len(self.questions),
            "seed_conversations": len(self.conversations),
        }
        return {**counts, "real_text_sources": dict(self.real.sources)} if self.real else counts


def collect_seed_material(prompts: Sequence[TaskPrompt], answers: Sequence[str]) -> SeedMaterial:
    """Sort the target's stage-1 answers (``answers[i]`` answers ``prompts[i]``) into passages, questions and
    conversations; too-short passages and lines that are not questions are dropped."""
    passages, questions, conversations = [], [], []
    for prompt, answer in zip(prompts, answers):
        answer = answer.strip()
        if not answer:
            continue
        if prompt.kind == "seed_passage" and len(answer.split()) >= MIN_PASSAGE_WORDS:
            m = re.search(r"about (.+?)[.,]", prompt.text)
            title = (m.group(1) if m else prompt.text).strip().removeprefix("a ").removeprefix("an ").capitalize()
            passages.append((title, answer))
        elif prompt.kind == "seed_question":
            for line in answer.splitlines():
                line = re.sub(r"^\s*(\d+[.)]|[-*•])\s*", "", line).strip()
                if line.endswith("?") and 4 <= len(line.split()) <= 30:
                    questions.append(line)
        elif prompt.kind == "seed_first_turn":
            conversations.append((prompt.text, answer))
    return SeedMaterial(passages, questions, conversations)


def _foreign_sentence(rng: random.Random) -> tuple[str, str]:
    language = rng.choice(list(FOREIGN_SENTENCES))
    parts = [rng.choice(FOREIGN_SENTENCES[language]) for _ in range(rng.choice((1, 1, 2, 3)))]
    fields = {
        "city": rng.choice(PLACES),
        "day": rng.choice(DAYS),
        "month": rng.choice(MONTHS),
        "month_fr": rng.choice(MONTHS_FR),
        "year": rng.randint(2025, 2035),
        "n": rng.randint(2, 90),
        "a": rng.randint(0, 5),
        "b": rng.randint(0, 5),
        "name": rng.choice(NAMES),
    }
    return language, " ".join(p.format(**fields) for p in parts)


def _real_foreign_sentence(real: LocalText, rng: random.Random) -> tuple[str, str]:
    """A real sentence (or two) in a random language, German half the time; spaced punctuation half the time."""
    languages = sorted(real.foreign)
    language = "German" if "German" in real.foreign and rng.random() < 0.5 else rng.choice(languages)
    sentence = rng.choice(real.foreign[language])
    if rng.random() < SPACED_PUNCTUATION_SHARE:
        sentence = re.sub(r"\s*([,.;:!?])(?=\s|$)", r" \1", sentence)
    return language, sentence


def _passage(material: SeedMaterial, rng: random.Random, max_words: int | None = None) -> tuple[str, str]:
    """A ``(title, text)`` passage: real text (`REAL_TEXT_SHARE` of the time, when installed) or the target's own,
    cut to ``max_words`` words at a paragraph or sentence boundary."""
    use_real = material.real is not None and material.real.passages and rng.random() < REAL_TEXT_SHARE
    title, text = rng.choice(material.real.passages if use_real else material.passages)
    if max_words and len(text.split()) > max_words:
        cut = " ".join(text.split(" ")[:max_words])
        end = max(cut.rfind("\n\n"), cut.rfind(". "))
        text = cut[: end + 1] if end > len(cut) // 3 else cut
    return title, text


def _make_task(kind: str, material: SeedMaterial, rng: random.Random) -> TaskPrompt:
    if kind == "multi_turn":
        first, answer = rng.choice(material.conversations)
        messages = [*_user(first), {"role": "assistant", "content": answer}, *_user(rng.choice(FOLLOW_UPS))]
        return TaskPrompt(kind, messages)
    if kind == "translation":
        real = material.real is not None and material.real.foreign and rng.random() < REAL_TEXT_SHARE
        language, sentence = _real_foreign_sentence(material.real, rng) if real else _foreign_sentence(rng)
        return TaskPrompt(kind, _user(rng.choice(TRANSLATION_TEMPLATES).format(language=language, sentence=sentence)))
    if kind == "summarisation":
        _, text = _passage(material, rng, max_words=600)
        return TaskPrompt(kind, _user(rng.choice(SUMMARY_TEMPLATES).format(text=text)))
    if kind == "qa":
        if material.questions and rng.random() < 0.5:
            question = rng.choice(material.questions)
        else:
            template = rng.choice(QA_FACT_TEMPLATES)
            fields = {k: rng.choice(v) for k, v in QA_FILLS.items()}
            question = template.format(**fields)
        return TaskPrompt(kind, _user(rng.choice(QA_TEMPLATES).format(question=question)))
    if kind == "math_reasoning":
        fields = {"name": rng.choice(NAMES), "a": rng.randint(12, 90), "b": rng.randint(2, 20), "c": rng.randint(2, 9)}
        return TaskPrompt(kind, _user(rng.choice(MATH_TEMPLATES).format(**fields)))
    if kind == "rag":
        docs = [_passage(material, rng, MAX_RAG_DOC_WORDS) for _ in range(rng.choice((1, 2, 2, 3)))]
        question = _rag_question(docs[0], material, rng)
        text = "\n\n".join(f"{title}\n{body}" for title, body in docs)
        return TaskPrompt(kind, _user(rng.choice(RAG_TEMPLATES).format(docs=text, question=question)))
    raise ValueError(f"unknown task kind {kind!r}; expected one of {TASK_KINDS}")


def _rag_question(doc: tuple[str, str], material: SeedMaterial, rng: random.Random) -> str:
    title, _ = doc
    generic = (
        f"What happened according to the passage about {title.lower()}?",
        f"Who is mentioned in the text about {title.lower()}, and what did they do?",
        "Which numbers are given in the passage, and what do they refer to?",
        "What is the main point of the first passage?",
        f"When and where did the events about {title.lower()} take place?",
    )
    if material.questions and rng.random() < 0.3:
        return rng.choice(material.questions)
    return rng.choice(generic)


def task_prompts(material: SeedMaterial, num_prompts: int, seed: int = 0) -> list[TaskPrompt]:
    """Stage 2: ``num_prompts`` distinct prompts, the six `TASK_KINDS` round-robin, over the target's ``material``.

    Raises:
        ValueError: when the material lacks passages or conversations (the seed stage produced too little).
    """
    if len(material.passages) < 3 or not material.conversations:
        raise ValueError(
            f"the seed stage gave {len(material.passages)} passages and {len(material.conversations)} conversations; "
            "need at least 3 passages and 1 conversation (run the seed stage with more prompts or longer answers)"
        )
    rng = random.Random(f"task-stage:{seed}")
    return distinct_prompts(num_prompts, TASK_KINDS, lambda kind: _make_task(kind, material, rng), "task prompts", _key)


def recipe(num_seed: int, num_tasks: int, seed: int, real_text: bool = False) -> dict:
    """The JSON-able description of the two stages, recorded in the data manifests."""
    return {
        "real_text": bool(real_text),
        "real_text_share": REAL_TEXT_SHARE if real_text else 0.0,
        "kind": "six Spec-Bench task kinds over self-instructed material (no benchmark text)",
        "task_kinds": list(TASK_KINDS),
        "num_seed_prompts": int(num_seed),
        "num_task_prompts": int(num_tasks),
        "seed": int(seed),
        "languages": sorted(FOREIGN_SENTENCES),
        "templates": {
            "passage": list(PASSAGE_TEMPLATES),
            "question": list(QUESTION_TEMPLATES),
            "first_turn": list(FIRST_TURN_TEMPLATES),
            "follow_up": list(FOLLOW_UPS),
            "summary": list(SUMMARY_TEMPLATES),
            "rag": list(RAG_TEMPLATES),
            "qa": list(QA_TEMPLATES),
            "translation": list(TRANSLATION_TEMPLATES),
            "math": list(MATH_TEMPLATES),
        },
    }


__all__ = [
    "TASK_KINDS",
    "SeedMaterial",
    "TaskPrompt",
    "collect_seed_material",
    "recipe",
    "seed_prompts",
    "task_prompts",
]
