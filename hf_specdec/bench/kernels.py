"""GPU microbenchmark of the tree-attention kernel, and the whole-model verify-cost curve t(n) / t(1).

    python -m hf_specdec.bench.kernels OUT_DIR            # needs a CUDA GPU; writes kernels.md + kernels.json
    python -m hf_specdec.bench.kernels OUT_DIR --dry-run-cpu   # one tiny shape through the same code on a CPU

Attention (one layer, block size 16, a random tree of T nodes per row over a committed context of L tokens):

- ``ours``: `paged_tree_attention` on the paged pools (its metadata is built once per forward, before timing, as the
  speculative loop does: one plan per forward, shared by every layer).
- ``ours_no_tree``: the same kernel with causal rows instead of tree masks (what the tree mask costs).
- ``sdpa``: ``F.scaled_dot_product_attention`` over K/V already gathered into contiguous ``[B, H_kv, L + T, D]``
  with a materialised ``[B, 1, T, L + T]`` bool mask (the gather is not timed: this favours SDPA).
- ``flex``: ``torch.compile``-d ``flex_attention`` with a tree ``BlockMask`` over the same gathered K/V.
- ``flashinfer``: FlashInfer's paged prefill with a custom mask over the same pools (skipped when not importable).

Each cell is the median over ``iters`` CUDA-event timings after ``warmup`` calls, with the L2 cache flushed before
each timed call. Bandwidth = bytes the kernel must read (prefix + tree K/V, queries, bit-packed tree mask) / time,
and its fraction of the GPU's peak HBM bandwidth (H100 SXM 3.35e12 B/s, H200 4.8e12; detected from the device name,
``--peak-bw`` overrides).

Verify-cost curve: a random-weight Llama of real shape (default: Llama-3.2-1B's, bf16) verifies a random tree of n
nodes (n = 1..128) over a committed context; the whole forward is timed with our backend (plan build included) and
with transformers' ``sdpa`` (DynamicCache + 4D tree mask). ``t(n) / t(1)`` is what Sequoia-style tree sizing needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cli_args import non_negative_int, positive_float, positive_int
from ..training.step_cost import random_tree_mask, verify_cost_curve

ATTENTION_SHAPES = {  # name: (query heads, KV heads, head dim)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
PEAK_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
)
COLUMNS = ("ours", "ours_no_tree", "sdpa", "flex", "flashinfer")


@dataclass
class AttentionResult:
    """One row of the attention table: times in microseconds (None = skipped, with the reason in ``notes``)."""

    shape: str
    heads_q: int
    heads_kv: int
    head_dim: int
    batch: int
    context: int
    tree: int
    block_size: int
    bytes_read: int
    plan_build_us: float | None = None  # host: kernel metadata of one forward (built once, shared by all layers)
    times_us: dict[str, float | None] = field(default_factory=dict)
    max_abs_err: dict[str, float | None] = field(default_factory=dict)  # vs SDPA on the same inputs
    notes: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- timing helpers
def peak_bandwidth(device_name: str) -> float | None:
    """Peak HBM bytes/s of a GPU named ``device_name`` (None if unknown)."""
    for key, value in PEAK_HBM_BYTES_PER_S.items():  # most specific names first
        if key in device_name:
            return value
    return None


class _CudaTimer:
    """Median of CUDA-event timings (µs) with warmup, flushing L2 before each timed call."""

    def __init__(self, warmup: int, iters: int):
        self.warmup, self.iters = warmup, iters
        self._flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


class _WallTimer:
    """Wall-clock µs of a single call: for the CPU dry run, which makes no timing claims."""

    def __init__(self, warmup: int = 0, iters: int = 1):
        self.warmup, self.iters = warmup, iters

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(self.iters):
            fn()
        return (time.perf_counter() - t0) / self.iters * 1e6


# ---------------------------------------------------------------------------------------------- attention
def _attention_inputs(heads_q, heads_kv, head_dim, batch, context, tree, block_size, dtype, device, gen):
    """A one-layer PagedCache holding ``batch`` rows of ``context`` committed tokens (pages interleaved across
    rows), a tree plan and a causal plan over the same slots, and queries."""
    from ..attention.plan import build_plan
    from ..cache.paged import PagedCache

    cache = PagedCache(block_size=block_size, num_layers=1)
    rows = cache.add_rows(batch)
    layer = cache.layer(0)
    layer.lazy_initialization(
        torch.empty(1, heads_kv, head_dim, dtype=dtype, device=device),
        torch.empty(1, heads_kv, head_dim, dtype=dtype, device=device),
    )
    chunk = max(block_size, 256)
    for start in range(0, context, chunk):  # interleave rows so block tables are not contiguous
        for r in rows:
            cache.reserve(r, start, min(chunk, context - start))
    for r in rows:
        cache.commit_chunk(r, context)
    masks = [random_tree_mask(tree, gen) for _ in rows]
    positions = torch.zeros(batch * tree, dtype=torch.long)
    plan = build_plan(cache, rows, [tree] * batch, positions, masks, device)
    layer.ensure_capacity()
    layer.keys.normal_()
    layer.values.normal_()
    causal = build_plan(cache, rows, [tree] * batch, positions, [None] * batch, device)  # same slots, no tree
    query = torch.randn(batch * tree, heads_q, head_dim, dtype=dtype, device=device)
    return cache, plan, causal, query


def _gathered(cache, plan, query):
    """Contiguous `[B, H_kv, L + T, D]` K/V, `[B, H_q, T, D]` queries and the `[B, 1, T, L + T]` bool mask."""
    layer = cache.layer(0)
    ks, vs, ms = [], [], []
    for b, row in enumerate(plan.rows.tolist()):
        n = int(plan.q_lens[b])
        k, v = layer.gather(row, int(plan.prefix_lens[b]) + n)
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
        ms.append(plan.row_mask(b, query.device))
    batch = plan.num_rows
    q = query.view(batch, -1, *query.shape[1:]).transpose(1, 2)
    return q, torch.stack(ks), torch.stack(vs), torch.stack(ms)[:, None]


_COMPILED_FLEX = None


def _flex_callable(q, k, v, mask, scale):
    """A compiled flex_attention call with a tree BlockMask built from the dense `[B, 1, T, L + T]` mask."""
    global _COMPILED_FLEX
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dense = mask[:, 0]  # [B, T, L + T]

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    if not q.is_cuda:  # the dry run: eager flex (it warns that it is unfused; that is the point here)

        def eager():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

        return eager
    if _COMPILED_FLEX is None:
        # one compiled graph per shape: lift dynamo's recompile limit (8) so every cell stays compiled
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    compiled = _COMPILED_FLEX
    return lambda: compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _flashinfer_callable(cache, plan, query, scale):
    """FlashInfer's paged prefill with a custom mask over our pools (NHD layout), or raise ImportError."""
    import flashinfer  # noqa: F401  (optional)
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    device = query.device
    layer, block_size = cache.layer(0), cache.block_size
    q_lens = plan.q_lens.tolist()
    kv_lens = [p + n for p, n in zip(plan.prefix_lens.tolist(), q_lens)]
    tables = cache.block_tables(plan.rows).tolist()  # [B, max_blocks]
    pages = [table[: -(-length // block_size)] for table, length in zip(tables, kv_lens)]
    kv_indptr = torch.tensor([0] + [len(p) for p in pages], dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indices = torch.tensor([b for p in pages for b in p], dtype=torch.int32)
    last_len = torch.tensor([(length - 1) % block_size + 1 for length in kv_lens], dtype=torch.int32)
    qo_indptr = torch.from_numpy(plan.cu_seqlens).to(torch.int32)
    custom = torch.cat([plan.row_mask(b, "cpu").flatten() for b in range(len(q_lens))])
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        qo_indptr.to(device),
        kv_indptr.to(device),
        kv_indices.to(device),
        last_len.to(device),
        query.shape[1],
        layer.keys.shape[2],
        query.shape[2],
        block_size,
        custom_mask=custom.to(device),
        sm_scale=scale,
        q_data_type=query.dtype,
        kv_data_type=layer.keys.dtype,
    )
    return lambda: wrapper.run(query, (layer.keys, layer.values))


def bench_attention_config(
    shape: str,
    heads: tuple[int, int, int],
    batch: int,
    context: int,
    tree: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Callable[[Callable[[], object]], float],
    columns: Sequence[str] = COLUMNS,
    seed: int = 0,
) -> AttentionResult:
    """Time every column of one (shape, batch, context, tree) cell; outputs are checked against SDPA."""
    from ..attention.backend import tree_attention_metadata, triton_tree_attention
    from ..kernels.tree_attention import max_block_m

    heads_q, heads_kv, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    cache, plan, causal, query = _attention_inputs(
        heads_q, heads_kv, head_dim, batch, context, tree, block_size, dtype, device, gen
    )
    layer = cache.layer(0)
    scale = head_dim**-0.5
    group, block_m = heads_q // heads_kv, max_block_m(dtype)
    meta = tree_attention_metadata(plan, query.device, group, block_m)
    build_times = []
    for _ in range(5):
        kept = plan.kernel_metadata.pop((group, block_m))
        t0 = time.perf_counter()
        tree_attention_metadata(plan, query.device, group, block_m)
        if query.is_cuda:
            torch.cuda.synchronize()
        build_times.append((time.perf_counter() - t0) * 1e6)
        plan.kernel_metadata[group, block_m] = kept
    elt = query.element_size()
    kv_bytes = 2 * batch * (context + tree) * heads_kv * head_dim * elt
    result = AttentionResult(
        shape, heads_q, heads_kv, head_dim, batch, context, tree, block_size,
        bytes_read=kv_bytes + query.numel() * elt + meta.mask_bytes, plan_build_us=statistics.median(build_times),
    )  # fmt: skip
    q4, k4, v4, mask4 = _gathered(cache, plan, query)
    reference = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask4, scale=scale, enable_gqa=True)
    reference = reference.transpose(1, 2).reshape_as(query)  # [N, H_q, D]

    def ours():
        return triton_tree_attention(query, layer.keys, layer.values, plan, scale)

    def ours_no_tree():
        return triton_tree_attention(query, layer.keys, layer.values, causal, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask4, scale=scale, enable_gqa=True)

    makers = {
        "ours": lambda: ours,
        "ours_no_tree": lambda: ours_no_tree,
        "sdpa": lambda: sdpa,
        "flex": lambda: _flex_callable(q4, k4, v4, mask4, scale),
        "flashinfer": lambda: _flashinfer_callable(cache, plan, query, scale),
    }
    for name in columns:
        try:
            fn = makers[name]()
            out = fn()
        except ImportError as exc:
            result.times_us[name], result.notes[name] = None, f"not installed ({exc.name or exc})"
            continue
        except Exception as exc:  # a baseline that fails on this shape is reported, not fatal
            result.times_us[name], result.notes[name] = None, f"{type(exc).__name__}: {exc}"[:200]
            continue
        if name != "ours_no_tree":  # the causal variant computes something else on purpose
            out = out.transpose(1, 2).reshape_as(query) if out.dim() == 4 else out
            result.max_abs_err[name] = float((out.float() - reference.float()).abs().max())
        result.times_us[name] = timer(fn)
    return result


# ---------------------------------------------------------------------------------------------- model curve
def _random_llama(dtype: torch.dtype, device: str, **overrides):
    """A random-weight Llama of real shape (Llama-3.2-1B's by default)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**LLAMA_1B, **overrides})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# the dry run's model: the tests' tiny Llama (`testing.tiny_causal_lm("llama")`), which the package does not import
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)  # fmt: skip


def _tiny_llama():
    """A 2-layer Llama of hidden size 64 on the CPU, seed 0, its matrices drawn at std 0.08 (peaked logits)."""
    torch.manual_seed(0)
    model = _random_llama(torch.float32, "cpu", **TINY_LLAMA)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


# ---------------------------------------------------------------------------------------------- report
def _markdown(report: dict) -> str:
    env = report["environment"]
    peak = env.get("peak_hbm_bytes_per_s")
    lines = [
        "# hf-specdec kernel benchmark",
        "",
        f"Device: {env['device']}; torch {env['torch']}; triton {env['triton']}; dtype {env['dtype']}.",
    ]
    if report.get("dry_run"):
        lines += ["", "**Dry run on a CPU through the Triton interpreter: the times below mean nothing.**"]
    lines += [
        "",
        "## Attention (one layer)",
        "",
        "Median µs per call; `bw` = bytes that must be read (prefix + tree K/V, queries, tree mask) / time"
        + (f", as a fraction of peak HBM bandwidth ({peak:.3g} B/s)." if peak else "."),
        "",
        "`plan` = host time to build the forward's kernel metadata (once per forward, shared by all layers).",
        "",
        "| shape | B | L | T | " + " | ".join(COLUMNS) + " | ours GB/s | ours bw/peak | tree-mask overhead | plan µs |",
        "|" + "---|" * (4 + len(COLUMNS) + 4),
    ]

    def fmt(value, spec):
        return "—" if value is None else format(value, spec)

    for r in report["attention"]:
        t = r["times_us"]
        ours = t.get("ours")
        gbs = r["bytes_read"] / (ours * 1e-6) / 1e9 if ours else None
        frac = gbs * 1e9 / peak if gbs and peak else None
        over = ours / t["ours_no_tree"] - 1 if ours and t.get("ours_no_tree") else None
        cells = [fmt(t.get(c), ".1f") for c in COLUMNS]
        cells += [fmt(gbs, ".0f"), fmt(frac, ".0%"), fmt(over, "+.0%"), fmt(r.get("plan_build_us"), ".0f")]
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['tree']} | " + " | ".join(cells) + " |")
    notes = sorted({f"{c}: {n}" for r in report["attention"] for c, n in r["notes"].items()})
    if notes:
        lines += ["", "Skipped or failed baselines:", ""] + [f"- {n}" for n in notes]
    errs = [max((v for v in r["max_abs_err"].values() if v is not None), default=0.0) for r in report["attention"]]
    if errs:
        lines += ["", f"Largest output difference from SDPA across all cells: {max(errs):.3g}."]
    curve = report.get("verify_curve")
    if curve:
        lines += [
            "",
            f"## Verify cost t(n) / t(1), whole model ({curve['model']}, context {curve['context']})",
            "",
            "| n | " + " | ".join(f"{b} ms | {b} t(n)/t(1)" for b in curve["times_us"]) + " |",
            "|---|" + "---|---|" * len(curve["times_us"]),
        ]
        for n in curve["nodes"]:
            cells = []
            for times in curve["times_us"].values():
                t_n, t_1 = times[str(n)], times[str(curve["nodes"][0])]
                cells.append(f"{t_n / 1e3:.2f} | {t_n / t_1:.2f}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        diff = curve.get("max_abs_logit_diff_largest_tree")
        if diff is not None:
            lines += ["", f"Largest logit difference between the backends on the largest tree: {diff:.3g}."]
    return "\n".join(lines) + "\n"


def run_kernel_bench(
    out_dir: str | os.PathLike,
    shapes: Sequence[str] = tuple(ATTENTION_SHAPES),
    batches: Sequence[int] = (1, 8, 32),
    contexts: Sequence[int] = (512, 4096, 16384),
    trees: Sequence[int] = (16, 64),
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 10,
    iters: int = 50,
    columns: Sequence[str] = COLUMNS,
    model_curve: bool = True,
    curve_context: int = 1024,
    curve_nodes: Sequence[int] = tuple(range(1, 129)),
    peak_bw: float | None = None,
    dry_run_cpu: bool = False,
) -> dict:
    """Run the attention microbenchmark (and the whole-model verify-cost curve), write ``kernels.md`` and
    ``kernels.json`` to ``out_dir`` and return the report.

    Args:
        dry_run_cpu: run one tiny shape through the same code on the CPU (Triton interpreter, fp32, wall-clock
            times that mean nothing) to check the benchmark itself; needs ``TRITON_INTERPRET=1`` in the
            environment before triton is first imported (``main`` re-runs itself with it set).
    Raises:
        RuntimeError: no CUDA device and not a dry run.
    """
    import triton

    setup = _bench_setup(dry_run_cpu, shapes, batches, contexts, trees, dtype, warmup, iters)
    peak = peak_bw if peak_bw is not None else (None if dry_run_cpu else peak_bandwidth(setup.device_name))
    report: dict = {
        "dry_run": dry_run_cpu,
        "environment": {
            "device": setup.device_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": str(setup.dtype).replace("torch.", ""),
            "peak_hbm_bytes_per_s": peak,
            "block_size": block_size,
            "warmup": warmup,
            "iters": iters,
        },
        "attention": [],
    }
    for shape, batch, context, tree in setup.grid:
        res = bench_attention_config(
            shape, setup.shapes[shape], batch, context, tree, block_size, setup.dtype, setup.device, setup.timer,
            columns,
        )  # fmt: skip
        report["attention"].append(asdict(res))
        print(f"{shape} B={batch} L={context} T={tree}: {res.times_us}", file=sys.stderr)
    if model_curve:
        report["verify_curve"] = _verify_curve_section(setup, curve_context, curve_nodes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(report, indent=2))
    (out / "kernels.md").write_text(_markdown(report))
    return report


@dataclass
class _BenchSetup:
    """Where and how the benchmark runs: the device, the dtype, the cells to time and the timer."""

    device: torch.device
    device_name: str
    dtype: torch.dtype
    shapes: dict[str, tuple[int, int, int]]  # name: (query heads, KV heads, head dim)
    grid: list[tuple[str, int, int, int]]  # (shape, batch, context, tree) cells
    timer: Callable[[Callable[[], object]], float]
    dry_run: bool


def _bench_setup(
    dry_run_cpu: bool,
    shapes: Sequence[str],
    batches: Sequence[int],
    contexts: Sequence[int],
    trees: Sequence[int],
    dtype: torch.dtype,
    warmup: int,
    iters: int,
) -> _BenchSetup:
    """The CUDA setup of the requested grid, or the CPU dry run's one tiny cell (Triton interpreter, fp32)."""
    if dry_run_cpu:
        from ..kernels import tree_attention

        if not tree_attention.INTERPRETED:
            raise RuntimeError("the CPU dry run needs TRITON_INTERPRET=1 set before hf_specdec's kernels are imported")
        name = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
        return _BenchSetup(
            torch.device("cpu"), name, torch.float32, {"tiny": (4, 2, 16)}, [("tiny", 2, 40, 8)], _WallTimer(), True
        )
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU (use --dry-run-cpu to check it on a CPU)")
    device = torch.device("cuda")
    grid = [(s, b, c, t) for s in shapes for b in batches for c in contexts for t in trees]
    return _BenchSetup(
        device,
        torch.cuda.get_device_name(device),
        dtype,
        {s: ATTENTION_SHAPES[s] for s in shapes},
        grid,
        _CudaTimer(warmup, iters),
        False,
    )


def _verify_curve_section(setup: _BenchSetup, curve_context: int, curve_nodes: Sequence[int]) -> dict:
    """The report's whole-model verify-cost curve: a random Llama-3.2-1B-shaped model on CUDA, a tiny one on the
    dry run; the hf_specdec curve runs our kernels, also on a CPU."""
    if setup.dry_run:
        model, name, context, nodes = _tiny_llama(), "tiny llama (random)", 16, (1, 2, 4)
    else:
        model, name = _random_llama(setup.dtype, "cuda"), "random-weight Llama-3.2-1B shape"
        context, nodes = curve_context, tuple(curve_nodes)
    times, logit_diff = verify_cost_curve(model, context, nodes, setup.timer, attention="triton")
    return {
        "model": name,
        "context": context,
        "nodes": list(nodes),
        "max_abs_logit_diff_largest_tree": logit_diff,
        "times_us": {b: {str(n): t for n, t in c.items()} for b, c in times.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_specdec.bench.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default="bench-results/kernels", help="where kernels.md/json go")
    parser.add_argument("--shapes", nargs="+", default=list(ATTENTION_SHAPES), choices=list(ATTENTION_SHAPES))
    parser.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32])
    parser.add_argument("--contexts", nargs="+", type=positive_int, default=[512, 4096, 16384])
    parser.add_argument("--trees", nargs="+", type=positive_int, default=[16, 64])
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--warmup", type=non_negative_int, default=10)
    parser.add_argument("--iters", type=positive_int, default=50)
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--no-model-curve", action="store_true", help="skip the whole-model t(n)/t(1) curve")
    parser.add_argument("--curve-context", type=positive_int, default=1024)
    parser.add_argument("--curve-max-nodes", type=positive_int, default=128)
    parser.add_argument(
        "--peak-bw", type=positive_float, default=None, help="peak HBM bytes/s (default: from device name)"
    )
    parser.add_argument(
        "--dry-run-cpu", action="store_true", help="one tiny shape on the CPU via the Triton interpreter (no timings)"
    )
    args = parser.parse_args(argv)
    if args.dry_run_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads TRITON_INTERPRET when it is imported, which importing hf_specdec already did: re-run with it set
        cmd = [sys.executable, "-m", "hf_specdec.bench.kernels", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.call(cmd, env={**os.environ, "TRITON_INTERPRET": "1"})
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(
            "hf_specdec.bench.kernels: no CUDA device found; this benchmark measures GPU kernels. "
            "Run it on a machine with an NVIDIA GPU, or pass --dry-run-cpu to check the code path on a CPU.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print(
            "hf_specdec.bench.kernels: triton is not installed (pip install triton, or pip install -e '.[triton]' in a checkout)",
            file=sys.stderr,
        )
        return 2
    report = run_kernel_bench(
        args.out_dir,
        shapes=args.shapes,
        batches=args.batches,
        contexts=args.contexts,
        trees=args.trees,
        block_size=args.block_size,
        dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype],
        warmup=args.warmup,
        iters=args.iters,
        columns=args.columns,
        model_curve=not args.no_model_curve,
        curve_context=args.curve_context,
        curve_nodes=range(1, args.curve_max_nodes + 1),
        peak_bw=args.peak_bw,
        dry_run_cpu=args.dry_run_cpu,
    )
    print(_markdown(report))
    print(f"wrote {Path(args.out_dir) / 'kernels.md'} and kernels.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
