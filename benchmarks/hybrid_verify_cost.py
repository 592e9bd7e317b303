"""Cost of a verify forward of 1, 4 and 16 tree tokens on hybrid targets (LFM2: short convolutions; Qwen3.5: gated
delta nets) against a plain decode step of vanilla transformers, beside a Llama of the same shape: random weights in
LFM2-350M's layout (16 layers, 10 of them convolutions, hidden 1024) and Qwen3.5's pattern at that size (12 gated
delta nets, 4 attention layers), a 256-token context, fp32, 2 threads, the models' calls interleaved. Run: python benchmarks/hybrid_verify_cost.py (figures in docs/architectures.md)."""

import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_specdec  # noqa: F401  (registers the attention backend)
from hf_specdec.generation.target import PlannedModel

torch.set_num_threads(2)


def lfm2():
    kinds = [
        "conv",
        "conv",
        "full_attention",
        "conv",
        "conv",
        "full_attention",
        "conv",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv",
        "full_attention",
        "conv",
    ]
    c = AutoConfig.for_model(
        "lfm2",
        vocab_size=65536,
        hidden_size=1024,
        intermediate_size=4608,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        layer_types=kinds,
        block_auto_adjust_ff_dim=False,
    )
    return AutoModelForCausalLM.from_config(c).eval()


def qwen3_5():
    """Qwen3.5's pattern (three gated delta nets, then full attention) at the same width and depth."""
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * 4
    c = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=65536,
        hidden_size=1024,
        intermediate_size=4608,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        layer_types=kinds,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    return AutoModelForCausalLM.from_config(c).eval()


def llama():
    c = AutoConfig.for_model(
        "llama",
        vocab_size=65536,
        hidden_size=1024,
        intermediate_size=4608,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
    )
    return AutoModelForCausalLM.from_config(c).eval()


def tree(n: int):
    """A binary tree of ``n`` tokens after the 256-token context: tokens, positions, `[n, n]` ancestor mask."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return torch.randint(3, 60000, (n,)), 256 + mask.sum(-1) - 1, mask


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def main() -> None:
    setups = {}
    for name, make in (("lfm2", lfm2), ("qwen3_5", qwen3_5), ("llama", llama)):
        model = make()
        prompt = torch.randint(3, 60000, (1, 256))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(prompt, past_key_values=cache, use_cache=True)
        target = PlannedModel(model, pack_linears=False).__enter__()
        (row,) = target.add_rows(1)
        with torch.no_grad():
            target.forward([row], prompt[0], torch.arange(256), [256])
        target.commit_chunks([row], [256])
        setups[name] = (model, cache, target, row)
    times = {(m, k): [] for m in setups for k in ("vanilla", 1, 4, 16)}
    token = torch.tensor([[7]])
    with torch.no_grad():
        for rep in range(12):  # the first round warms up; the vanilla cache grows by 12 of 256 tokens
            for name, (model, cache, target, row) in setups.items():
                t = timed(model, token, past_key_values=cache, use_cache=True)
                if rep:
                    times[(name, "vanilla")].append(t)
                for n in (1, 4, 16):
                    toks, pos, mask = tree(n)
                    t = timed(target.forward, [row], toks, pos, [n], [mask] if n > 1 else None)
                    if rep:
                        times[(name, n)].append(t)
    for name in setups:
        v = statistics.median(times[(name, "vanilla")])
        cells = ", ".join(
            f"{n} tokens {statistics.median(times[(name, n)]) * 1e3:.1f} ms "
            f"({statistics.median(times[(name, n)]) / v:.2f}x)"
            for n in (1, 4, 16)
        )
        print(f"{name}: vanilla decode step {v * 1e3:.1f} ms; planned forward: {cells}", flush=True)


if __name__ == "__main__":
    main()
