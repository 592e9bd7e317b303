"""Time (and profile) the data builder's greedy pass by batch size, one process, the default model: the dynamic
loop (how the builder-throughput figures in scripts/gpu_train_heads.md, "The third run", were measured) against the
static-cache loop whose steps replay one CUDA graph (`hf_specdec.training.static_decoding`), interleaved.

    PYTHONPATH=$PWD:/tmp/hfsd_carry/py python scripts/profile_builder.py cuda /tmp/hfsd_carry/conversations.json.xz
    python scripts/profile_builder.py cpu .gpu_carry/base/conversations.json.xz 0.03   # a CPU dry run, tiny batches

Arguments: device, a carried conversations file (`python -m tools.gpu_recipe pack` writes one), and a
scale for the batch sizes (default 1).
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ (not installed) from this checkout

from hf_specdec.training.chat_template import chat_ids  # noqa: E402
from hf_specdec.training.static_decoding import greedy_answers_static  # noqa: E402
from hf_specdec.training.target_states import Answering, greedy_answers_with_states  # noqa: E402
from tools.gpu_recipe import load_carried_conversations, load_target  # noqa: E402


def main(device: str, conversations: str, scale: float = 1.0) -> None:
    model, tok = load_target("default", device, "float32")
    source = load_carried_conversations(conversations)
    prompts = [chat_ids(tok, [{"role": "user", "content": c.user_turns[0]}]) for c in source.train[:3000]]
    prompts = [p for p in prompts if len(p) <= 256][:1024]
    how = Answering.of(model, 128, 512, False, 1.0, 1.0, None, None)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(batch: int, new_tokens: int, aux=(), static=False):
        batch = max(2, int(batch * scale))
        loop = greedy_answers_static if static else greedy_answers_with_states
        sync()
        t = time.time()
        answers, _ = loop(model, prompts[:batch], new_tokens, how.pad, how.eos_ids, aux)
        sync()
        dt = time.time() - t
        tokens = sum(len(a) for a in answers)
        print(f"{'static ' if static else 'dynamic'} batch {batch} new {new_tokens} aux {aux}: {dt:.2f} s, answer tok "
              f"{tokens} ({tokens / dt:.0f}/s), prompt tok {sum(len(p) for p in prompts[:batch])}", flush=True)  # fmt: skip
        return answers

    run(64, 16)  # warm-up
    run(64, 16, static=True)
    for batch in (64, 256, 1024):
        dynamic, static = run(batch, 128), run(batch, 128, static=True)
        if static != dynamic:
            print(f"  the static loop's answers differ in {sum(a != b for a, b in zip(static, dynamic))} of "
                  f"{len(static)} rows (near-ties decided differently by other kernels?)")  # fmt: skip
    run(256, 128, (2, 15, 27))
    run(256, 128, (2, 15, 27), static=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    for static in (False, True):
        with profile(activities=activities) as prof:
            run(256, 32, static=static)
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
