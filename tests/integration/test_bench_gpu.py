"""The end-to-end GPU check's generate tables (`hf_specdec.bench.gpu`), run on the CPU path (`--dry-run-cpu`)."""

from __future__ import annotations

import json

from hf_specdec.bench import gpu


def test_each_method_is_warmed_up_untimed_then_timed_per_prompt(tmp_path, monkeypatch):
    calls = []
    real = gpu.timed_generate

    def counting(model, ids, mask, max_new_tokens, assistant, repeats):
        calls.append((assistant is None, repeats))
        return real(model, ids, mask, max_new_tokens, assistant, repeats)

    monkeypatch.setattr(gpu, "timed_generate", counting)
    args = [str(tmp_path), "--dry-run-cpu", "--dtypes", "fp32", "--batches", "1", "--methods", "ngram",
            "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--curve-shapes"]  # fmt: skip
    assert gpu.main(args) == 0
    # one untimed call of vanilla and of ngram on the first prompt, then both on each of the 2 prompts
    assert calls == [(True, 1), (False, 1)] + [(True, 1), (False, 1)] * 2
    report = json.loads((tmp_path / "gpu_e2e_dry_run.json").read_text())
    (table,) = report["generate"]
    rows = {r["method"]: r for r in table["rows"]}
    assert rows["ngram"]["identical"] == "2/2" and table["prompts"] == 2  # fp32: token-identical to vanilla
