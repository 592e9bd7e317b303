"""transformers' Hub convention for decoding methods: a folder holding ``custom_generate/generate.py`` and
``custom_generate/requirements.txt`` (the repository's own ``custom_generate/``, copied as a Hub repository would hold
it) runs hf-specdec's loop through ``model.generate(..., custom_generate=<folder>, trust_remote_code=True,
assistant=...)``, in a process whose code never imports hf_specdec."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from hf_specdec.testing import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, repo = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # the same weights: every draft is accepted
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]])  # [1, 14]
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)
    result = {"imported_before": "hf_specdec" in sys.modules}
    try:
        model.generate(ids, max_new_tokens=4, custom_generate=repo, assistant="ngram")
    except ValueError as err:
        result["without_trust"] = str(err)
    for name, assistant in (("ngram", "ngram"), ("draft", draft), ("default", None)):
        kwargs = {} if assistant is None else {"assistant": assistant}
        if name == "draft":
            kwargs["tree_budget"] = False  # hf-specdec's own options pass through: trees verified as drafted
        out = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=repo, trust_remote_code=True,
                             return_dict_in_generate=True, **kwargs)
        stats = out.spec_stats
        result[name] = {"equal": bool(torch.equal(out.sequences, reference)), "tau": stats.tau, "steps": stats.steps}
    try:
        model.generate(ids, max_new_tokens=4, custom_generate=repo, trust_remote_code=True, assistant="nope")
    except ValueError as err:
        result["unknown"] = str(err)
    sampled = model.generate(ids, max_new_tokens=8, do_sample=True, custom_generate=repo, trust_remote_code=True,
                             assistant=draft, return_dict_in_generate=True)
    result["sampled_steps"] = sampled.spec_stats.steps
    print("RESULT " + json.dumps(result))
    """
)


def test_custom_generate_folder_runs_the_speculative_loop(tmp_path):
    model_dir = tmp_path / "model"
    tiny_causal_lm("llama").save_pretrained(model_dir)
    repo = tmp_path / "hub-repo"
    shutil.copytree(ROOT / "custom_generate", repo / "custom_generate")
    assert sorted(p.name for p in (repo / "custom_generate").iterdir()) == ["README.md", "generate.py", "requirements.txt"]
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", USER_CODE, str(model_dir), str(repo)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["imported_before"] is False
    assert "custom generation code" in result["without_trust"] and "trust_remote_code" in result["without_trust"]
    for name in ("ngram", "draft", "default"):
        assert result[name]["equal"], f"{name}: greedy output differs from vanilla generate"
        assert result[name]["steps"] >= 1, "spec_stats: hf-specdec's loop ran"
    assert result["draft"]["tau"] > 2.0, "the draft model's tokens were accepted"
    assert "not a ready-made assistant" in result["unknown"] and "ngram" in result["unknown"]
    assert result["sampled_steps"] >= 1


def test_the_requirements_name_the_installed_package():
    from importlib.metadata import version

    from packaging.requirements import Requirement

    lines = (ROOT / "custom_generate" / "requirements.txt").read_text().split()
    requirements = {Requirement(line).name: Requirement(line) for line in lines}
    assert "hf-specdec" in requirements
    for name, requirement in requirements.items():
        assert requirement.specifier.contains(version(name), prereleases=True), (name, version(name))
