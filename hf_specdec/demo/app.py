"""The Gradio app: vanilla `generate` against speculative decoding, side by side, and a benchmark tab.

    from hf_specdec.demo import launch
    launch("127.0.0.1", 7860)              # or: hf-specdec demo / python -m hf_specdec.demo / python demo/app.py

One model is loaded and shared by every user; each request builds its own assistant. Up to ``concurrency`` requests
are served at once (the others wait in Gradio's queue); their generate() calls take turns on the model, so every
tokens/s is measured without another generation competing for the CPU. ``parallel=True`` (``--parallel``) lets the
calls run at the same time instead (transformers' generate and hf_specdec's are then called from several threads
on one model object).
"""

from __future__ import annotations

import threading

import gradio as gr

from ..assistants import available_assistants, describe_assistant
from .bench_tab import MAX_PER_CATEGORY, bench_categories, run_category
from .compare import MAX_NEW_TOKENS, Request, compare, warm_up
from .options import DEFAULT_CONCURRENCY
from .render import CSS, LEGEND

EXAMPLES = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold.",
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
    "Summarize in two sentences: Speculative decoding drafts several tokens cheaply and lets the large model "
    "verify them in one forward pass; accepted tokens are exactly what the large model would have produced.",
    "What is the capital of France? Answer in one sentence.",
]

INTRO = """# hf-specdec: speculative decoding inside `model.generate()`
The same prompt runs through vanilla `generate` (left) and through speculative decoding with the chosen assistant
(right), one after the other on this machine's CPU. Greedy output is token-for-token identical; the speedup comes
from the target model verifying several drafted tokens per forward pass."""


class DemoServer:
    """The shared model and the per-session Stop switches behind the app's event handlers."""

    def __init__(self, model, tokenizer, parallel: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_lock = None if parallel else threading.Lock()  # one generate() at a time unless parallel
        self._lock = threading.Lock()
        self._cancels: dict[str, set[threading.Event]] = {}

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
        """Stop every run of the caller's session within one decoding step (Gradio also cancels the event)."""
        key = getattr(request, "session_hash", None) or "anonymous"
        with self._lock:
            for event in self._cancels.get(key, ()):
                event.set()

    def compare(self, prompt, more_prompts, method, do_sample, temperature, top_p, seed, max_new_tokens,
                request: gr.Request = None):  # fmt: skip
        """The Compare tab's handler: yields (vanilla HTML, speculative HTML, summary, chart, details)."""
        extra = tuple(p.strip() for p in (more_prompts or "").splitlines() if p.strip())
        req = Request(
            prompts=((prompt or "").strip(), *extra),
            method=method,
            do_sample=bool(do_sample),
            temperature=float(temperature),
            top_p=float(top_p),
            seed=int(seed or 0),
            max_new_tokens=int(max_new_tokens),
        )
        key, cancel = self._register(request)
        view = None
        try:
            for view in compare(self.model, self.tokenizer, req, cancel, self.generation_lock):
                yield view.outputs()
        except Exception as exc:  # noqa: BLE001 - every failure is shown in the page, the app stays up
            raise gr.Error(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._release(key, cancel)

    def bench(self, category, methods, per_category, max_new_tokens, request: gr.Request = None):
        """The Benchmark tab's handler: yields (log, results table, chart)."""
        key, cancel = self._register(request)
        try:
            yield from run_category(
                self.model,
                self.tokenizer,
                category,
                list(methods or []),
                per_category,
                max_new_tokens,
                cancel,
                self.generation_lock,
            )
        except Exception as exc:  # noqa: BLE001
            raise gr.Error(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._release(key, cancel)


def _compare_tab(server: DemoServer, concurrency: int) -> None:
    methods = available_assistants()
    with gr.Row():
        with gr.Column(scale=3):
            prompt = gr.Textbox(label="Prompt", value=EXAMPLES[0], lines=3, elem_id="prompt")
            more = gr.Textbox(
                label="More prompts (optional, one per line): all prompts then run as one batch, without streaming",
                lines=2,
                elem_id="more-prompts",
            )
            gr.Examples(EXAMPLES, inputs=[prompt], label="Examples")
        with gr.Column(scale=2):
            method = gr.Dropdown(
                methods,
                value=methods[0] if methods else None,
                label="Assistant",
                info="; ".join(f"{m}: {describe_assistant(m)}" for m in methods),
                elem_id="method",
            )
            max_new = gr.Slider(8, MAX_NEW_TOKENS, value=96, step=8, label="Max new tokens", elem_id="max-new-tokens")
            do_sample = gr.Checkbox(label="Sample (unticked: greedy)", value=False, elem_id="do-sample")
            with gr.Row():
                temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                seed = gr.Number(value=0, precision=0, label="Seed")
    with gr.Row():
        run = gr.Button("Generate", variant="primary", elem_id="generate")
        stop = gr.Button("Stop", variant="stop", elem_id="stop")
    gr.HTML(LEGEND)
    with gr.Row(equal_height=True):
        vanilla = gr.HTML(elem_id="vanilla-pane")
        speculative = gr.HTML(elem_id="speculative-pane")
    with gr.Row():
        summary = gr.Markdown(elem_id="summary")
        depth = gr.Plot(label="Per-depth acceptance: steps that accepted at least d drafted tokens", elem_id="depth")
    with gr.Accordion("Details (JSON)", open=False):
        details = gr.JSON(elem_id="details")
    event = run.click(
        server.compare,
        inputs=[prompt, more, method, do_sample, temperature, top_p, seed, max_new],
        outputs=[vanilla, speculative, summary, depth, details],
        api_name="compare",
        concurrency_limit=concurrency,
        concurrency_id="generate",
    )
    stop.click(server.stop, cancels=[event], api_name="stop", queue=False)


def _bench_tab(server: DemoServer) -> None:
    categories = bench_categories()
    methods = available_assistants()
    gr.Markdown(
        "Runs `hf_specdec.bench` (greedy, batch 1) on a few questions of one Spec-Bench category: every method "
        "against vanilla `generate` on the same prompts. It shares the CPU with the Compare tab, so run one at a time "
        "for meaningful timings; `hf-specdec bench` does the full run."
    )
    with gr.Row():
        category = gr.Dropdown(categories, value=categories[0], label="Spec-Bench category", elem_id="bench-category")
        chosen = gr.CheckboxGroup(methods, value=methods, label="Methods", elem_id="bench-methods")
        per_category = gr.Slider(1, MAX_PER_CATEGORY, value=2, step=1, label="Questions")
        max_new = gr.Slider(16, 256, value=64, step=16, label="Max new tokens")
    with gr.Row():
        run = gr.Button("Run benchmark", variant="primary", elem_id="bench-run")
        stop = gr.Button("Stop", variant="stop", elem_id="bench-stop")
    log = gr.Textbox(label="Progress", lines=6, max_lines=12, elem_id="bench-log")
    table = gr.Markdown(elem_id="bench-table")
    chart = gr.Plot(label="Speedup and τ per method", elem_id="bench-chart")
    event = run.click(
        server.bench,
        inputs=[category, chosen, per_category, max_new],
        outputs=[log, table, chart],
        api_name="bench",
        concurrency_limit=1,
        concurrency_id="bench",
    )
    stop.click(server.stop, cancels=[event], api_name="stop_bench", queue=False)


def build_app(
    model=None, tokenizer=None, concurrency: int = DEFAULT_CONCURRENCY, warmup: bool = True, parallel: bool = False
) -> gr.Blocks:
    """The demo's `gr.Blocks` (queue enabled), on ``model`` or the default model.

    Args:
        model / tokenizer: the causal LM to demo; both None: `hf_specdec.load_default_model()` (the ready-made
            assistants are trained for it).
        concurrency: requests served at once (the others wait in the queue).
        warmup: run each method once on a short prompt first (loads the heads, prepares the packed weights), so
            the first user's timings are not the one-time setup.
        parallel: let the generate() calls of concurrent requests run at the same time on the shared model (default:
            they take turns, and each tokens/s is measured without competition for the CPU).
    """
    import hf_specdec  # noqa: F401  (routes model.generate(assistant=...))

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither (the default model)")
    if model is None:
        model, tokenizer = hf_specdec.load_default_model()
    if warmup:
        warm_up(model, tokenizer)
    server = DemoServer(model, tokenizer, parallel=parallel)
    with gr.Blocks(title="hf-specdec demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Tab("Compare"):
            _compare_tab(server, concurrency)
        with gr.Tab("Benchmark"):
            _bench_tab(server)
    app.queue(default_concurrency_limit=concurrency)
    return app


def launch(host: str | None = None, port: int | None = None, share: bool = False, *, app: gr.Blocks | None = None,
           block: bool = True, **build_kwargs):  # fmt: skip
    """Build (unless ``app`` is given) and serve the demo.

    Args:
        host: interface to bind (None: ``$GRADIO_SERVER_NAME`` or 127.0.0.1; ``0.0.0.0`` for every interface).
        port: TCP port (None: ``$GRADIO_SERVER_PORT`` or the first free one from 7860).
        share: open a public gradio.live link (needs the internet; off by default).
        app: an app from `build_app`.
        block: wait until the server stops (False: return right after it started, e.g. in tests).
        build_kwargs: passed to `build_app` (``model``, ``tokenizer``, ``concurrency``, ``warmup``, ``parallel``).
    Returns:
        the app (``app.local_url`` is where it listens).
    """
    app = app if app is not None else build_app(**build_kwargs)
    app.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=not block,
        show_error=True,
        ssr_mode=False,
        css=CSS,
        footer_links=["api"],
    )
    return app
