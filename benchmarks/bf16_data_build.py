"""Self-distilled head data built by a bf16 target on a CPU: how much faster, and how close to the fp32 build.

Issue 34 asks whether the heads' data can be built in bf16 where AMX / AVX512-BF16 make it cheaper. This script
measures it on the default model. The served target is the fp32 one, so fp32 is the reference throughout.

1. **Throughput.** The same ShareGPT first turns are answered by the fp32 and the bf16 target,
   `build_conversation_data(mode="self")`, the recipe's builder. The builds are interleaved (fp32, bf16, bf16,
   fp32, ...). Throughput is tokens per second of wall time and per second of process CPU time. The CPU time
   is the figure to trust when other work shares the machine.
2. **Labels.** On the bf16 build's sequences, teacher-forced through the fp32 target: how often the fp32 target's
   arg-max equals the bf16 target's answer token. A head trained on bf16 labels learns the bf16 target's choices;
   this is how often they are the fp32 target's.
3. **States.** The stored final hidden states (fp16 on disk) of each build against the fp32 target's own states on
   the same sequences: relative L2 error per position. The fp32 build's error is the storage alone, the control.
4. **Answers.** How many bf16 answers equal the fp32 answers to the same prompts, and the mean length of the
   common prefix.

    python benchmarks/bf16_data_build.py --conversations 64 --max-new-tokens 128 --repeats 2 \
        --json docs/results/intel_bf16_data_build.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers

from hf_specdec.bench.host import cpu_name
from hf_specdec.models import load_default_model
from hf_specdec.training.conversation_data import build_conversation_data, pick_conversations
from hf_specdec.training.conversations import ConversationSet, load_sharegpt
from hf_specdec.training.shards import DistillationData, load_distillation_data


def timed_build(model, tokenizer, source: ConversationSet, folder: Path, args) -> dict:
    """Build the answers of ``source``'s conversations into ``folder``; its times and counts."""
    wall, cpu = time.perf_counter(), time.process_time()
    build_conversation_data(model, tokenizer, folder, mode="self", num_conversations=None, seed=0,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, source=source,
                            progress=False)  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    data = load_distillation_data([folder / "self"])
    answers = int(data.answer_mask.sum())
    return {"wall_s": wall, "cpu_s": cpu, "tokens": int(data.input_ids.numel()), "answer_tokens": answers}


def fp32_view(model32, data: DistillationData) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 target teacher-forced over every sequence of ``data``: `[N]` its arg-max next token, `[N, H]` its
    final hidden states (both aligned with ``data.input_ids``)."""
    argmax = torch.empty_like(data.input_ids)
    hidden = torch.empty(data.hidden.shape, dtype=torch.float32)
    with torch.no_grad():
        for start, _, end in data.seq_bounds.tolist():
            out = model32(data.input_ids[start:end][None], output_hidden_states=True)
            argmax[start:end] = out.logits[0].argmax(-1)
            hidden[start:end] = out.hidden_states[-1][0]
    return argmax, hidden


def agreement(model32, data: DistillationData) -> dict:
    """Labels and states of ``data`` against the fp32 target (module docstring, 2 and 3)."""
    argmax, hidden = fp32_view(model32, data)
    nxt = data.next_tokens()  # the build's answer token after each position, -1 where the next token is no answer
    label_pos = nxt >= 0
    same = (argmax[label_pos] == nxt[label_pos]).float()
    stored = data.hidden.float()
    rel = (stored - hidden).norm(dim=-1) / hidden.norm(dim=-1).clamp_min(1e-6)  # [N]
    return {"label_positions": int(label_pos.sum()), "fp32_argmax_agrees": round(float(same.mean()), 4),
            "state_rel_error_mean": round(float(rel[data.answer_mask].mean()), 5),
            "state_rel_error_p99": round(float(rel[data.answer_mask].quantile(0.99)), 5)}  # fmt: skip


def answers_of(data: DistillationData) -> list[list[int]]:
    return [data.input_ids[a:e].tolist() for _, a, e in data.seq_bounds.tolist()]


def compare_answers(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many answers are equal, and the mean common prefix (module docstring, 4)."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    return {"answers": len(a), "equal": equal, "mean_common_prefix": round(sum(prefixes) / len(a), 1),
            "mean_answer_tokens": round(sum(map(len, a)) / len(a), 1)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="keep the first build of each dtype here (for training on them)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model32, tok = load_default_model()
    model16, _ = load_default_model(dtype=torch.bfloat16)
    source = load_sharegpt()
    convs = pick_conversations(source, args.conversations, 1, "train")
    subset = ConversationSet(train=convs, held_out=[], counts=source.counts)
    work = Path(tempfile.mkdtemp(prefix="bf16_data_"))
    runs, kept = {"float32": [], "bfloat16": []}, {}
    try:
        for rep in range(args.repeats):
            order = ["float32", "bfloat16"] if rep % 2 == 0 else ["bfloat16", "float32"]
            for name in order:
                folder = work / f"{name}-{rep}"
                runs[name].append(timed_build(model32 if name == "float32" else model16, tok, subset, folder, args))
                print(name, rep, runs[name][-1], flush=True)
                kept.setdefault(name, folder)
        data = {n: load_distillation_data([f / "self"]) for n, f in kept.items()}
        result = {
            "machine": {"cpu": cpu_name(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "threads": args.threads},  # fmt: skip
            "settings": vars(args),
            "runs": runs,
            "throughput": {n: {"answer_tokens_per_wall_s": round(sum(r["answer_tokens"] for r in rs)
                                                                 / sum(r["wall_s"] for r in rs), 1),
                               "answer_tokens_per_cpu_s": round(sum(r["answer_tokens"] for r in rs)
                                                                / sum(r["cpu_s"] for r in rs), 1)}
                           for n, rs in runs.items()},  # fmt: skip
            "agreement": {n: agreement(model32, d) for n, d in data.items()},
            "answers_bf16_vs_fp32": compare_answers(answers_of(data["float32"]), answers_of(data["bfloat16"])),
        }
    finally:
        if args.keep:
            for name, folder in kept.items():
                shutil.copytree(folder, Path(args.keep) / name, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    t = result["throughput"]
    result["bf16_speedup_wall"] = round(t["bfloat16"]["answer_tokens_per_wall_s"]
                                        / t["float32"]["answer_tokens_per_wall_s"], 2)  # fmt: skip
    result["bf16_speedup_cpu"] = round(t["bfloat16"]["answer_tokens_per_cpu_s"]
                                       / t["float32"]["answer_tokens_per_cpu_s"], 2)  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
