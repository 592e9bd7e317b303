"""The Gradio app: vanilla `generate` against speculative decoding (one after the other, in two panes side by side),
and a benchmark tab.

    from hf_specdec.demo import launch
    launch("127.0.0.1", 7860)              # or: hf-specdec demo / python -m hf_specdec.demo / python demo/app.py

One model is loaded and shared by every user; each request builds its own assistant. Up to ``concurrency`` requests
are served at once (the others wait in Gradio's queue); their generate() calls take turns on the model, so every
tokens/s is measured without another generation competing for the CPU. ``parallel=True`` (``--parallel``) lets the
calls run at the same time instead (transformers' generate and hf_specdec's are then called from several threads
on one model object).

Within one request the two sides run one after the other, not at the same time: each streams into its pane while it
runs. Run at once on a CPU, the two sides share its cores: each loses speed and the speedup follows whichever side
finishes first (the other then has the CPU to itself), so a concurrent comparison would not time either side honestly
(docs/lab/measurements.md has the run that showed it).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import gradio as gr
import torch

from ..assistants import available_assistants, describe_assistant
from ..models import DEFAULT_MODEL_NAME, GGUF_FILENAME, default_model_dir
from .bench_tab import MAX_PER_CATEGORY, MAX_REPEATS, bench_categories, estimate_text, run_category
from .compare import MAX_NEW_TOKENS, MAX_RUNS, Request, View, compare, warm_up
from .options import DEFAULT_CONCURRENCY
from .quiet import startup_quiet
from .render import CSS, LEGEND

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 256  # most answers to the examples end before this (EOS), so none is cut mid-sentence
DOCS_URL_VARIABLE = "HF_SPECDEC_DOCS_URL"  # where the page's docs link points (e.g. the repository's docs/ folder)

EXAMPLES = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold.",
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
    "Summarize in two sentences: Speculative decoding drafts several tokens cheaply and lets the large model "
    "verify them in one forward pass; accepted tokens are exactly what the large model would have produced.",
    "What is the capital of France? Answer in one sentence.",
]

INTRO = """# hf-specdec: speculative decoding inside `model.generate()`
The same prompt runs through vanilla `generate` (left; above on a phone), then through speculative decoding with the
chosen assistant (right; below): one after the other, not at the same time, so that each side's tokens/s is measured
with the CPU to itself; each pane streams while its side runs. Greedy output is token-for-token identical; the
speedup comes from the target model verifying several drafted tokens per forward pass.

**Model:** {model} · **hardware:** {hardware} · **docs:** {docs}"""

# what each building block of an assistant's name is; `assistant_guide` composes an entry for every name the dropdown
# offers from these (a name with an unknown part is described by `describe_assistant`)
PARTS = {
    "ngram": ("prompt lookup", "copies what follows an earlier occurrence of the last words in the prompt (no "
              "weights): fast where the answer repeats the input (rewrite, summarise, answer from a passage)"),
    "suffix": ("suffix decoding", "copies from the prompt and from earlier answers of the same assistant (no "
               "weights): fast on repetitive, templated or agentic text"),
    "medusa": ("the Medusa heads", "extra heads trained on this model's own answers guess the next few tokens: "
               "for open answers with nothing to copy"),
    "eagle": ("the EAGLE head", "a small draft layer on the model's features, trained on its own answers, grows a "
              "tree of guesses: for open answers with nothing to copy"),
    "mlp_speculator": ("the MLP speculator", "a small network trained on this model's own answers guesses the next "
                       "tokens: for open answers with nothing to copy"),
    "dflash": ("the DFlash block drafter", "one small forward on the model's features drafts a whole block of "
               "guesses, spread into a tree: for open answers (the shipped one is briefly trained, still weak)"),
}  # fmt: skip

FIGURES_HELP = (
    "**How to read the figures.** τ = tokens produced per verification step (1 + accepted draft tokens per step; "
    "the acceptance rate = accepted / drafted tokens). The **step cost** is what a speculative step (drafting, then "
    "one target forward verifying the draft) took, over vanilla's time per token: speedup ≈ τ ÷ step cost. τ is not "
    "a ceiling: a verify forward over a few tokens can cost less than a vanilla decode step (on a CPU it runs on "
    "pre-packed weights, vanilla on stock kernels), so a step cost below 1 and a speedup above τ are measurements. "
    "Timings on a shared CPU vary by 10-20% from run to run: **Timed runs** repeats both sides, interleaved, and "
    "shows the spread."
)


def _entry(name: str) -> str:
    parts = name.split("+")
    if not all(p in PARTS for p in parts):
        return f"- `{name}`: {describe_assistant(name)}"
    if len(parts) == 1:
        return f"- `{name}`: {PARTS[name][0]}: {PARTS[name][1]}"
    chain = ", else ".join(PARTS[p][0] for p in parts)
    return f"- `{name}`: {chain} (each where the one before finds nothing to propose): copying and open answers"


def assistant_guide(names: list[str]) -> str:
    """The "Which assistant?" help: one line for every entry of the dropdown (``names``), then how to read τ, the
    speedup and the step cost."""
    return "\n".join(["**Which assistant?** Every entry of the menu:", *map(_entry, names), "", FIGURES_HELP])


def _say(line: str) -> None:
    """A startup progress line on stdout (the server is otherwise silent while it loads and warms up)."""
    print(f"hf-specdec demo: {line}" if not line.startswith("  ") else line, flush=True)


def docs_link() -> str:
    """The page's pointer to the documentation: a link to ``$HF_SPECDEC_DOCS_URL`` or to the package's
    ``Documentation`` / ``Homepage`` URL when one is known, else where the pages are in the source."""
    import importlib.metadata

    url = os.environ.get(DOCS_URL_VARIABLE)
    if not url:
        try:
            urls = importlib.metadata.metadata("hf-specdec").get_all("Project-URL") or []
        except importlib.metadata.PackageNotFoundError:
            urls = []
        found = dict(u.split(", ", 1) for u in urls if ", " in u)
        url = found.get("Documentation") or found.get("Homepage")
    where = '`docs/README.md` in the hf-specdec source (the index; then "use it with your own model")'
    return f"[hf-specdec documentation]({url})" if url else where


def hardware_line(model) -> str:
    """What the page says the model runs on: the GPU's name, or the CPU's with its cores and torch threads."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_name(model) -> str:
    """What runs, for the page: the model's name (its Hub id, or its folder's name) and the dtype its weights run in.
    The default model is named as what it is: SmolLM2-135M-Instruct dequantized from the GGUF file it ships as
    (`load_default_model` converts it to fp32 safetensors once; ``--dtype`` casts that on loading), not the name of
    the converted folder."""
    path = str(getattr(model, "name_or_path", "") or "").rstrip("/")
    dtype = getattr(model, "dtype", None)
    precision = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if path and Path(path).resolve() == default_model_dir(convert=False).resolve():
        quant = GGUF_FILENAME.split(".")[-2]
        return f"{DEFAULT_MODEL_NAME} ({precision}, dequantized from the {quant} GGUF)"
    name = os.path.basename(path) or type(model).__name__
    return f"{name} ({precision})" if dtype is not None else name


def error_view(message: str, view: View | None = None) -> tuple:
    """The Compare tab's outputs after a failure: the message in the summary (no exception reaches Gradio, so no
    "Error" badges and no traceback per bad input), the panes kept if the run had started, else cleared."""
    view = view if view is not None else View()
    return view.vanilla_html, view.speculative_html, f"### ⚠️ {message}", None, {"error": message}


class DemoServer:
    """The shared model and the per-session Stop switches behind the app's event handlers."""

    def __init__(self, model, tokenizer, parallel: bool = False, assistants: list[str] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.assistants = assistants if assistants is not None else available_assistants()
        self.generation_lock = None if parallel else threading.Lock()  # one generate() at a time unless parallel
        self._lock = threading.Lock()
        self._cancels: dict[str, set[threading.Event]] = {}
        self._vanilla_rates: deque[float] = deque(maxlen=8)  # vanilla's tokens/s of its last finished calls

    def saw_vanilla(self, tokens: int, seconds: float) -> None:
        """Record a finished single-prompt vanilla call (its speed feeds the Benchmark tab's time estimate)."""
        if tokens > 1 and seconds > 0:
            self._vanilla_rates.append(tokens / seconds)

    def vanilla_rate(self) -> float | None:
        """Vanilla's tokens/s on this server: the median of its last calls (Compare and Benchmark), None before any."""
        return statistics.median(self._vanilla_rates) if self._vanilla_rates else None

    def bench_estimate(self, methods, per_category, max_new_tokens, repeats=1) -> str:
        """The Benchmark tab's estimate of how long a run with these settings takes (`bench_tab.estimate_text`)."""
        return estimate_text(len(methods or []), int(per_category or 1), int(max_new_tokens or 1), int(repeats or 1),
                             self.vanilla_rate())  # fmt: skip

    def _register(self, request: gr.Request | None) -> tuple[str, threading.Event]:
        key = getattr(request, "session_hash", None) or "anonymous"
        event = threading.Event()
        with self._lock:
            self._cancels.setdefault(key, set()).add(event)
        return key, event

    def _release(self, key: str, event: threading.Event) -> None:
        with self._lock:
            self._cancels.get(key, set()).discard(event)

    def stop(self, request: gr.Request = None) -> None:
        """Stop every run of the caller's session within one decoding step; the run then shows what it produced and
        says it was stopped."""
        key = getattr(request, "session_hash", None) or "anonymous"
        with self._lock:
            for event in self._cancels.get(key, ()):
                event.set()

    def compare(self, prompt, more_prompts, method, do_sample, temperature, top_p, seed, max_new_tokens, runs=1,
                request: gr.Request = None):  # fmt: skip
        """The Compare tab's handler: yields (vanilla HTML, speculative HTML, summary, chart, details). A bad input
        or a failed run ends with its message in the summary (and ``{"error": ...}`` as details)."""
        key, cancel = self._register(request)
        view = None
        try:
            extra = tuple(p.strip() for p in (more_prompts or "").splitlines() if p.strip())
            req = Request(prompts=((prompt or "").strip(), *extra), method=method, do_sample=bool(do_sample),
                          temperature=float(temperature), top_p=float(top_p), seed=int(seed or 0),
                          max_new_tokens=int(max_new_tokens), runs=int(runs or 1))  # fmt: skip
            if req.method not in self.assistants:
                raise ValueError(
                    f"assistant {req.method!r} is not offered here; choose one of {', '.join(self.assistants)}"
                )
            for view in compare(self.model, self.tokenizer, req, cancel, self.generation_lock):
                yield view.outputs()
            self._note_vanilla(view.details)
        except (ValueError, TypeError) as exc:  # what the user typed: the message is for them
            logger.info("hf-specdec demo: refused a request: %s", exc)
            yield error_view(str(exc), view)
        except Exception as exc:  # noqa: BLE001 - a failure is shown in the page (one traceback in the log)
            logger.exception("hf-specdec demo: the comparison failed")
            yield error_view(f"the run failed: {type(exc).__name__}: {exc}", view)
        finally:
            self._release(key, cancel)

    def _note_vanilla(self, details: dict | None) -> None:
        """Keep the speed of a finished single-prompt comparison's vanilla runs (a batch's is not comparable)."""
        vanilla = (details or {}).get("vanilla") or {}
        if details and not details.get("cancelled") and "text" in vanilla and vanilla["new_tokens"] > 1:
            self._vanilla_rates.extend(r for r in details["tokens_per_s_per_run"]["vanilla"] if r > 0)

    def bench(self, category, methods, per_category, max_new_tokens, repeats=1, request: gr.Request = None):
        """The Benchmark tab's handler: yields (log, results, chart); a failure ends with its message as results."""
        key, cancel = self._register(request)
        try:
            yield from run_category(self.model, self.tokenizer, category, list(methods or []), per_category,
                                    max_new_tokens, cancel, self.generation_lock, repeats=int(repeats or 1),
                                    vanilla_rate=self.vanilla_rate(), on_vanilla=self.saw_vanilla)  # fmt: skip
        except (ValueError, TypeError) as exc:
            logger.info("hf-specdec demo: refused a benchmark request: %s", exc)
            yield "", f"### ⚠️ {exc}", None
        except Exception as exc:  # noqa: BLE001
            logger.exception("hf-specdec demo: the benchmark failed")
            yield "", f"### ⚠️ the benchmark failed: {type(exc).__name__}: {exc}", None
        finally:
            self._release(key, cancel)


def _assistant_help(name: str | None) -> str:
    """What the chosen assistant is (under the menu; every entry is in the "Which assistant?" guide below it)."""
    return f"`{name}`: {describe_assistant(name)}." if name else ""


def _sampling_controls(do_sample: bool) -> tuple:
    """Temperature, top-p and seed only apply to sampling: editable when it is ticked, greyed out in greedy mode."""
    return tuple(gr.update(interactive=bool(do_sample)) for _ in range(3))


def _compare_options(methods: list[str]) -> list:
    """The Compare tab's right column: the assistant with its help and guide, and the generation options; returns
    the inputs after the prompts, in `DemoServer.compare`'s order."""
    method = gr.Dropdown(methods, value=methods[0] if methods else None, label="Assistant", elem_id="method")
    advice = gr.Markdown(_assistant_help(methods[0] if methods else None), elem_id="assistant-help")
    with gr.Accordion("Which assistant? How to read the figures", open=False, elem_id="assistant-guide-box"):
        gr.Markdown(assistant_guide(methods), elem_id="assistant-guide")
    max_new = gr.Slider(8, MAX_NEW_TOKENS, value=DEFAULT_NEW_TOKENS, step=8, label="Max new tokens",
                        elem_id="max-new-tokens")  # fmt: skip
    runs = gr.Slider(1, MAX_RUNS, value=1, step=1, elem_id="timed-runs",
                     label="Timed runs of each side (interleaved; more: the spread, i.e. the noise)")  # fmt: skip
    do_sample = gr.Checkbox(label="Sample (unticked: greedy)", value=False, elem_id="do-sample")
    with gr.Row(elem_classes="hfsd-stack"):  # greyed out (hfsd-sampling) and not editable in greedy mode
        sampling = {"interactive": False, "elem_classes": "hfsd-sampling"}
        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature", elem_id="temperature",
                                **sampling)  # fmt: skip
        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p", elem_id="top-p", **sampling)
        seed = gr.Number(value=0, precision=0, label="Seed", elem_id="seed", **sampling)
    method.change(_assistant_help, inputs=[method], outputs=[advice], queue=False, api_visibility="undocumented")
    do_sample.change(_sampling_controls, inputs=[do_sample], outputs=[temperature, top_p, seed], queue=False,
                     api_visibility="undocumented")  # fmt: skip
    return [method, do_sample, temperature, top_p, seed, max_new, runs]


def _compare_tab(server: DemoServer, concurrency: int) -> None:
    with gr.Row(elem_classes="hfsd-stack"):
        with gr.Column(scale=3):
            prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0], lines=3, elem_id="prompt")
            more = gr.Textbox(
                label="More prompts (optional, one per line): all prompts then run as one batch, without streaming",
                lines=2,
                elem_id="more-prompts",
            )
            gr.Examples(EXAMPLES, inputs=[prompt], label="Examples")
        with gr.Column(scale=2):
            options = _compare_options(server.assistants)
    with gr.Row():
        run = gr.Button("Generate", variant="primary", elem_id="generate")
        stop = gr.Button("Stop", variant="stop", elem_id="stop")
    gr.HTML(LEGEND)
    with gr.Row(equal_height=True, elem_classes="hfsd-stack", elem_id="panes"):  # stacked on a phone (render.CSS)
        vanilla = gr.HTML(elem_id="vanilla-pane")
        speculative = gr.HTML(elem_id="speculative-pane")
    with gr.Row(elem_classes="hfsd-stack"):
        summary = gr.Markdown(elem_id="summary")
        depth = gr.Plot(show_label=False, elem_id="depth")  # the figure carries its title
    with gr.Accordion("Details (JSON)", open=False):
        details = gr.JSON(elem_id="details")
    run.click(
        server.compare,
        inputs=[prompt, more, *options],
        outputs=[vanilla, speculative, summary, depth, details],
        api_name="compare",
        concurrency_limit=concurrency,
        concurrency_id="generate",
    )
    # Stop ends the running comparison within one decoding step; the run then shows what it produced as "stopped"
    # (cancelling the Gradio event instead would leave every output under an "Error" badge)
    stop.click(server.stop, api_name="stop", queue=False)


def _bench_tab(server: DemoServer) -> tuple[list, gr.Markdown]:
    """The Benchmark tab; returns its settings (the estimate's inputs) and the estimate."""
    categories = bench_categories()
    methods = server.assistants
    gr.Markdown(
        "A few questions of one Spec-Bench category (greedy, batch 1): every method against vanilla `generate` on "
        "the same prompts, after an untimed warm-up, vanilla and the methods taking turns on each question. It "
        "shares the machine with the Compare tab, so run one at a time for meaningful timings; "
        "`hf-specdec bench --full` is the careful measurement."
    )
    with gr.Row(elem_classes="hfsd-stack"):
        category = gr.Dropdown(categories, value=categories[0], label="Spec-Bench category", elem_id="bench-category")
        chosen = gr.CheckboxGroup(methods, value=methods, label="Methods", elem_id="bench-methods")
    with gr.Row(elem_classes="hfsd-stack"):
        per_category = gr.Slider(1, MAX_PER_CATEGORY, value=2, step=1, label="Questions", elem_id="bench-questions")
        max_new = gr.Slider(16, 256, value=64, step=16, label="Max new tokens", elem_id="bench-max-new-tokens")
        repeats = gr.Slider(1, MAX_REPEATS, value=2, step=1, label="Timed runs per method (interleaved)",
                            elem_id="bench-repeats")  # fmt: skip
    estimate = gr.Markdown(server.bench_estimate(methods, per_category.value, max_new.value, repeats.value),
                           elem_id="bench-estimate")  # fmt: skip
    with gr.Row():
        run = gr.Button("Run benchmark", variant="primary", elem_id="bench-run")
        stop = gr.Button("Stop", variant="stop", elem_id="bench-stop")
    log = gr.Textbox(label="Progress", lines=6, max_lines=12, autoscroll=True, elem_id="bench-log")
    table = gr.Markdown(elem_id="bench-table")
    chart = gr.Plot(show_label=False, elem_id="bench-chart")
    settings = [chosen, per_category, max_new, repeats]
    # the estimate follows the settings and vanilla's speed as last measured on this server (also by the Compare tab)
    for i, control in enumerate(settings):  # the first one's event is the API's /bench_estimate
        control.change(server.bench_estimate, inputs=settings, outputs=[estimate], queue=False,
                       api_name="bench_estimate" if i == 0 else None, api_visibility="public" if i == 0 else "private",
                       show_progress="hidden")  # fmt: skip
    run.click(
        server.bench,
        inputs=[category, *settings],
        outputs=[log, table, chart],
        api_name="bench",
        concurrency_limit=1,
        concurrency_id="bench",
    ).then(server.bench_estimate, inputs=settings, outputs=[estimate], queue=False, api_visibility="private",
           show_progress="hidden")  # fmt: skip
    stop.click(server.stop, api_name="stop_bench", queue=False)
    return settings, estimate


def build_app(model=None, tokenizer=None, concurrency: int = DEFAULT_CONCURRENCY, warmup: bool = True,
              parallel: bool = False, own_model: bool = False) -> gr.Blocks:  # fmt: skip
    """The demo's `gr.Blocks` (queue enabled), on ``model`` or the default model.

    Args:
        model / tokenizer: the causal LM to demo; both None: `hf_specdec.load_default_model()` (the ready-made
            assistants are trained for it).
        concurrency: requests served at once (the others wait in the queue).
        warmup: run each method once on a short prompt first (loads the heads, prepares the packed weights), so
            the first user's timings are not the one-time setup.
        parallel: let the generate() calls of concurrent requests run at the same time on the shared model (default:
            they take turns, and each tokens/s is measured without competition for the CPU).
        own_model: ``model`` is not the default model: offer prompt lookup only (the shipped heads are trained for
            the default model).
    """
    import hf_specdec  # noqa: F401  (routes model.generate(assistant=...))

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither (the default model)")
    with startup_quiet():  # the progress lines below, not transformers' bars
        if model is None:
            t0 = time.perf_counter()
            _say(f"loading the default model ({DEFAULT_MODEL_NAME}; the first start converts its GGUF file, ~30 s)…")
            model, tokenizer = hf_specdec.load_default_model()
            _say(f"  model loaded in {time.perf_counter() - t0:.1f} s")
        assistants = ["ngram"] if own_model else available_assistants()
        if warmup:
            t0 = time.perf_counter()
            _say(f"warming up vanilla and {len(assistants)} assistant(s), one short call each (loads the heads)…")
            warm_up(model, tokenizer, assistants, report=_say)
            _say(f"  warm-up done in {time.perf_counter() - t0:.1f} s; building the page…")
    server = DemoServer(model, tokenizer, parallel=parallel, assistants=assistants)
    with gr.Blocks(title="hf-specdec demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO.format(model=model_name(model), hardware=hardware_line(model), docs=docs_link()),
                    elem_id="intro")  # fmt: skip
        with gr.Tab("Compare"):
            _compare_tab(server, concurrency)
        with gr.Tab("Benchmark"):
            settings, estimate = _bench_tab(server)
        # each page load estimates anew (vanilla's speed may have been measured since the page was built)
        app.load(server.bench_estimate, inputs=settings, outputs=[estimate], queue=False, api_visibility="private",
                 show_progress="hidden")  # fmt: skip
    app.queue(default_concurrency_limit=concurrency)
    return app


def launch(host: str | None = None, port: int | None = None, share: bool = False, *, app: gr.Blocks | None = None,
           block: bool = True, **build_kwargs):  # fmt: skip
    """Build (unless ``app`` is given) and serve the demo; prints where it listens.

    Args:
        host: interface to bind (None: ``$GRADIO_SERVER_NAME`` or 127.0.0.1; ``0.0.0.0`` for every interface).
        port: TCP port (None: ``$GRADIO_SERVER_PORT`` or the first free one from 7860).
        share: open a public gradio.live link (needs the internet; off by default).
        app: an app from `build_app`.
        block: wait until the server stops (False: return right after it started, e.g. in tests).
        build_kwargs: passed to `build_app` (``model``, ``tokenizer``, ``concurrency``, ``warmup``, ``parallel``,
            ``own_model``).
    Returns:
        the app (``app.local_url`` is where it listens).
    """
    app = app if app is not None else build_app(**build_kwargs)
    app.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=True,
        show_error=True,
        ssr_mode=False,
        css=CSS,
        footer_links=["api"],
        quiet=True,  # Gradio's own lines name its Python API (share=True in launch()); ours name the options
    )
    print(f"hf-specdec demo: {app.local_url}", flush=True)
    if share and getattr(app, "share_url", None):
        print(f"hf-specdec demo, public link: {app.share_url}", flush=True)
    elif not share:
        print("(hf-specdec demo --share also opens a public gradio.live link; --host 0.0.0.0 serves the network)",
              flush=True)  # fmt: skip
    if block:
        app.block_thread()
    return app
