"""Memory across calls: the default model, every ready-made assistant in turn, 4-8 new tokens a call; the process's
resident memory (RSS) right after loading the model (and once a vanilla call has read its memory-mapped weights), and at chosen calls, with the bytes the packed GEMM copies hold
(`packed_bytes`). The bound `generate` promises (docs/usage.md, "Memory"): peak RSS at most twice the RSS after
loading, however many calls and assistants.

    python benchmarks/memory_soak.py --calls 1000 --out docs/results/memory_soak.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers

import hf_specdec
from hf_specdec.assistants import available_assistants, load_default_assistant
from hf_specdec.generation.packed_linears import packed_bytes

PROMPTS = [
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is.",
]


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


def peak_rss_bytes() -> int:
    """This process's highest resident memory so far (VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--marks", default="1,10,25,100,250,500,1000", help="calls after which RSS is recorded")
    parser.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = hf_specdec.load_default_model()
    mapped = rss_bytes()  # the weights are memory-mapped from the converted file: paged in at their first use
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False)  # vanilla: every weight read once
    loaded = rss_bytes()
    names = available_assistants()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    marks = {int(m) for m in args.marks.split(",")}
    record = {"calls": args.calls, "assistants": names, "rss_mapped_mib": mapped / 2**20,
              "rss_loaded_mib": loaded / 2**20, "at": {},
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print(f"RSS after loading: {mapped / 2**20:.0f} MiB, {loaded / 2**20:.0f} MiB once a vanilla call read the "
          f"weights; {len(names)} assistants: {', '.join(names)}", flush=True)  # fmt: skip
    start = time.perf_counter()
    for call in range(1, args.calls + 1):
        name = names[(call - 1) % len(names)]
        ids = prompts[(call - 1) % len(prompts)]
        model.generate(ids, max_new_tokens=4 + call % 5, do_sample=False, assistant=load_default_assistant(name))
        if call in marks or call == args.calls:
            rss, packed = rss_bytes(), packed_bytes(model)
            record["at"][call] = {"rss_mib": rss / 2**20, "packed_mib": packed / 2**20}
            print(f"call {call:5d}: RSS {rss / 2**20:6.0f} MiB ({rss / loaded:.2f}x loaded), packed copies "
                  f"{packed / 2**20:6.0f} MiB, {time.perf_counter() - start:6.0f} s", flush=True)  # fmt: skip
            if args.out:  # what was measured so far survives an interrupted run
                args.out.write_text(json.dumps({**record, "peak_rss_mib": peak_rss_bytes() / 2**20}, indent=1) + "\n")
    peak = peak_rss_bytes()
    record.update(
        peak_rss_mib=peak / 2**20,
        peak_over_loaded=peak / loaded,
        peak_over_mapped=peak / mapped,
        seconds=time.perf_counter() - start,
    )
    print(f"peak RSS {peak / 2**20:.0f} MiB = {peak / loaded:.2f}x the RSS of the loaded model "
          f"({peak / mapped:.2f}x the RSS before its weights were read)", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
