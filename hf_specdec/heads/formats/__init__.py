"""Readers and writers of the checkpoint layouts draft heads are published in (docs/formats.md), one module per
upstream format family; the head modules (`hf_specdec.heads.medusa`, ``.eagle``, ``.mlp_speculator``, ``.dflash``)
keep the ``nn.Module`` and its config and call in here.

- `medusa`: Medusa heads: FasterDecoding Medusa-1 (``medusa_lm_head.pt``), the version-2 ResBlock-only heads, heads
  inside a Medusa-2 full checkpoint, vLLM's Medusa layout (read; written by ``format="medusa"``) and our own format.
- `speculators`: vLLM's ``speculators`` library: kinds ``eagle3`` (read and written), ``eagle`` (read) and
  ``dflash`` (config and tensor names, read and written); every other kind refused by name.
- `eagle`: upstream EAGLE checkpoints: EAGLE-1/2 (``fc``, ``layers.0.*``), EAGLE-3 / SpecForge (``midlayer.*``,
  ``d2t``, ``t2d``), vLLM's EAGLE-3 names, and our EagleHead format (read); the upstream config ``format="eagle"``
  writes.
- `mlp_speculator`: IBM's fms-extras MLP speculator ("accelerator" models, ``model_type: "mlp_speculator"``) and our
  MLPSpeculator format (read).
- `common`: what several readers share (renaming tensor-name prefixes, checking a draft vocabulary's ``d2t``).

The files themselves (safetensors, ``torch.save`` files, shards, config.json, Hub downloads) are read and written by
`hf_specdec.heads.hub`.
"""
