"""Hub I/O shared by every speculative head type (Medusa, EAGLE, MLP speculator).

Our own format is a folder (local or a Hub model repo) holding

- ``config.json``: ``head_type`` (``"medusa"``, ...), ``hf_specdec_version``, the base model's id, hidden size and
  vocabulary size, the head's own hyper-parameters and tree defaults, and the model-card facts (``model_card``);
- ``model.safetensors``: the head's tensors;
- ``README.md``: a model card generated from the config (base model, training data, measured tau and speedup).

Upstream formats (docs/formats.md) are read through the same `HeadSource`, which resolves a local folder or a Hub
repo id (files are fetched one by one, on demand, so a head stored inside a multi-GB checkpoint costs only the shards
that hold it). Everything here is framework plumbing: format-specific key mapping lives in `formats`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelHubMixin, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..text_config import text_config
from ..version import __version__
from .checks import HUB_ID, check_finite
from .serving import serving_sections

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
LIBRARY_NAME = "hf-specdec"


def _library_version() -> str:
    return __version__  # also where the checkout runs from PYTHONPATH, uninstalled (importlib.metadata has none)


# --------------------------------------------------------------------------------------------------- sources
class HeadSource:
    """A folder of head files: a local directory, or a Hub model repo whose files are downloaded on first use.

    Args:
        path_or_repo: a local folder, or a Hub repo id such as ``"FasterDecoding/medusa-vicuna-7b-v1.3"``.
        revision / token / cache_dir / local_files_only / force_download: passed to `huggingface_hub.hf_hub_download`.
    """

    def __init__(
        self,
        path_or_repo: str | os.PathLike,
        *,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
    ):
        self.name = str(path_or_repo)
        self.is_local = os.path.isdir(self.name)
        self._hub_kwargs = dict(
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            force_download=force_download,
        )
        self._unreachable: list[str] = []  # files the Hub could not be asked about (offline, not cached)
        if not self.is_local:
            looks_like_path = (
                self.name.startswith((".", "/", "~"))
                or os.sep in self.name.replace("/", "", 1)
                or os.path.exists(self.name)
                or not HUB_ID.match(self.name)
            )
            if looks_like_path:
                raise FileNotFoundError(
                    f"{self.name!r} is neither an existing folder nor a Hub repo id (owner/name); pass the folder "
                    "that holds config.json and the weights, or a repo id such as 'FasterDecoding/medusa-vicuna-7b-v1.3'"
                )
            not_cached = offline_miss(self.name, cache_dir, local_files_only)
            if not_cached:  # fail now, not once per candidate file
                raise FileNotFoundError(not_cached)

    def __str__(self) -> str:
        return self.name

    def file(self, filename: str) -> Path | None:
        """Local path of ``filename`` (downloading it from the Hub if needed), or None when the source lacks it."""
        if self.is_local:
            path = Path(self.name) / filename
            return path if path.is_file() else None
        try:
            return Path(hf_hub_download(repo_id=self.name, filename=filename, **self._hub_kwargs))
        except LocalEntryNotFoundError:
            # offline (or local_files_only) and not in the cache: cannot tell "absent" from "not downloaded".
            # The Hub did not answer for this file, so it will not for the next ones: look only in the cache from
            # now on instead of paying huggingface_hub's connection retries once per candidate file.
            self._unreachable.append(filename)
            self._hub_kwargs["local_files_only"] = True
            return None
        except EntryNotFoundError:
            return None
        except RepositoryNotFoundError as err:
            raise FileNotFoundError(
                f"{self.name!r} is not a local folder and the Hub has no (accessible) model repo of that name; check "
                "the spelling, or log in (`hf auth login`) for a private or gated repo"
            ) from err
        except RevisionNotFoundError as err:
            raise FileNotFoundError(
                f"the Hub repo {self.name!r} has no revision {self._hub_kwargs['revision']!r}"
            ) from err
        except HFValidationError as err:
            raise FileNotFoundError(
                f"{self.name!r} is neither an existing folder nor a valid Hub repo id: {err}"
            ) from err

    def require(self, filename: str, what: str = "") -> Path:
        """Like `file`, but a missing file is an error that says where it was looked for."""
        path = self.file(filename)
        if path is None:
            raise FileNotFoundError(f"{self.describe_missing([filename])}{' (' + what + ')' if what else ''}")
        return path

    def json(self, filename: str) -> dict | None:
        """The parsed JSON file, or None when absent."""
        path = self.file(filename)
        if path is None:
            return None
        return read_json(path)

    def describe_missing(self, filenames: Iterable[str]) -> str:
        """An error message for files that could not be found, honest about offline lookups."""
        names = ", ".join(filenames)
        if self.is_local:
            present = sorted(p.name for p in Path(self.name).iterdir())
            return f"{self.name} has none of: {names} (the folder holds: {', '.join(present) or 'nothing'})"
        if self._unreachable:
            return (
                f"could not fetch {names} from the Hub repo {self.name!r}: the Hub is unreachable (offline, or "
                "HF_HUB_OFFLINE / local_files_only set) and the files are not in the local cache. Download the repo "
                f"once with network access (`hf download {self.name}`), or pass a local folder"
            )
        return f"the Hub repo {self.name!r} has none of: {names}"


def offline_miss(
    repo_id: str, cache_dir: str | os.PathLike | None = None, local_files_only: bool = False
) -> str | None:
    """Why the Hub repo ``repo_id`` cannot be read, when the Hub is switched off (``HF_HUB_OFFLINE``, or
    ``local_files_only``) and the local cache holds no copy of it: a message naming the local-folder alternative.
    None when the Hub may be asked, or the cache has the repo."""
    if not (constants.HF_HUB_OFFLINE or local_files_only):
        return None
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    if (cache / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir():
        return None
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "local_files_only=True"
    return (
        f"the Hub is unreachable ({why}) and the Hub repo {repo_id!r} is not in the local cache ({cache}): pass a "
        f"local folder that holds its files instead, or download it once with network access (`hf download {repo_id}`)"
    )


def check_reachable(source: HeadSource, found_any: bool) -> None:
    """Raise the offline error when nothing was found because the Hub could not be reached."""
    if not found_any and source._unreachable:
        raise OSError(source.describe_missing(source._unreachable))


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object file; invalid JSON or another type is an error naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); the file is damaged: download or write it again") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data


def config_int(owner: str, config: Mapping, key: str, where: str, *, required: bool = True, minimum: int = 1):
    """The integer field ``key`` of a head's config file ``where`` (None when absent and not ``required``).

    A missing required field, a value that is not an integer (a string, ``2.5``, ``true``) or one below ``minimum``
    is a `ValueError` naming ``owner``, the file, the field and the value.
    """
    value = config.get(key)
    if value is None:
        if required:
            raise ValueError(f"{owner}: {where} lacks an integer {key!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}: {where} field {key!r} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}: {where} field {key!r} must be at least {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------------------------------- tensors
def read_tensors(path: str | os.PathLike, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one weights file (``.safetensors``, or a ``torch.save`` file loaded with ``weights_only=True``).

    A truncated or damaged file, or a pickle that needs more than tensors to load, is a `ValueError` naming it.

    Args:
        path: the file.
        select: keep only keys for which it returns True. With safetensors the other tensors are never read.
    """
    path = str(path)
    if path.endswith(".safetensors"):
        out = {}
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if select is None or select(key):
                        out[key] = f.get_tensor(key)
        except SafetensorError as err:
            raise _damaged(path, err) from err
        return out
    state = _torch_load(path)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    if "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and (select is None or select(k))}


def tensor_names(path: str | os.PathLike) -> list[str]:
    """Keys of a weights file (for safetensors without reading any tensor)."""
    path = str(path)
    if path.endswith(".safetensors"):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                return list(f.keys())
        except SafetensorError as err:
            raise _damaged(path, err) from err
    return list(read_tensors(path))


def _torch_load(path: str):
    """``torch.load(weights_only=True)`` of ``path``: tensors and plain containers only, never arbitrary code."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) torch.save files cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} is a pickle that does not load with weights_only=True (it holds more than tensors, or is "
            f"damaged: {str(err).splitlines()[0]}); hf_specdec never runs a checkpoint's code: convert it to "
            "safetensors where you trust it"
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise _damaged(path, err) from err


def _damaged(path: str, err: BaseException) -> ValueError:
    size = os.path.getsize(path) if os.path.exists(path) else None
    return ValueError(
        f"{path} ({size} bytes) is not a readable weights file ({type(err).__name__}: {err}); it is truncated or "
        "damaged (an interrupted download?): download or save it again"
    )


def read_sharded_tensors(
    source: HeadSource, index_name: str, select: Callable[[str], bool]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The selected tensors of a sharded checkpoint (``*.index.json`` + shards); only shards holding them are read.

    Returns:
        the tensors and the shard file names that were opened.
    """
    index = source.json(index_name)
    if index is None or "weight_map" not in index:
        raise ValueError(f"{source}/{index_name} is not a sharded-checkpoint index (no weight_map)")
    wanted: dict[str, list[str]] = {}
    for key, shard in index["weight_map"].items():
        if select(key):
            wanted.setdefault(shard, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for shard, keys in sorted(wanted.items()):
        path = source.require(shard, f"shard named in {index_name}")
        keyset = set(keys)
        got = read_tensors(path, lambda k, keyset=keyset: k in keyset)
        missing = keyset - set(got)
        if missing:
            raise ValueError(f"{index_name} places {sorted(missing)[0]!r} in {shard}, but that shard does not hold it")
        out.update(got)
    return out, sorted(wanted)


def check_shapes(
    owner: str, tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], where: str
) -> None:
    """Every expected key present with its shape, nothing else, every float finite (`checks.check_finite`); errors
    name the key and both shapes (or the key and the file).

    Args:
        owner: what is being loaded, e.g. ``"MedusaHeads"``.
        tensors: the tensors found, by key.
        expected: the shape each key must have.
        where: the file or folder, for the message.
    """
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"{owner}: {where} lacks the tensor {key!r} (expected shape {list(shape)})")
        got = tuple(tensors[key].shape)
        if got != tuple(shape):
            raise ValueError(
                f"{owner}: tensor {key!r} in {where} has shape {list(got)}, expected {list(shape)}; the checkpoint "
                "does not match its config (or was written for a different model)"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{owner}: {where} holds unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    check_finite(owner, tensors, where)


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``model.safetensors`` (contiguous, unshared CPU copies; ``format: pt`` metadata like transformers)."""
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(clean, str(path), metadata={"format": "pt"})


def write_config(config: Mapping, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------------------------------- base model
def base_model_dims(model: torch.nn.Module) -> tuple[int, int]:
    """``(hidden size, vocab size)`` of a transformers causal LM, as its lm_head sees them."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1]), int(weight.shape[0])
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"cannot read the hidden and vocabulary sizes of a {type(model).__name__}")
    text = text_config(config)
    return int(text.hidden_size), int(text.vocab_size)


def base_model_name(model: torch.nn.Module) -> str | None:
    """The name or folder ``model`` was loaded from (its config's ``_name_or_path``), or None."""
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def check_base_model(
    owner: str,
    model: torch.nn.Module,
    hidden_size: int | None,
    vocab_size: int | None,
    base_model_name_or_path: str | None = None,
) -> None:
    """Refuse a base model whose hidden size or vocabulary differ from what the head was built for.

    A ``None`` size is not checked (e.g. heads that reuse the base lm_head work with any vocabulary).
    """
    hidden, vocab = base_model_dims(model)
    trained = f" (it was built for {base_model_name_or_path})" if base_model_name_or_path else ""
    if hidden_size is not None and hidden_size != hidden:
        raise ValueError(
            f"{owner} for hidden size {hidden_size} cannot serve a model with hidden size {hidden}{trained}; "
            "train or load heads for this model"
        )
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(
            f"{owner} for vocabulary size {vocab_size} cannot serve a model with vocabulary size {vocab}{trained}; "
            "train or load heads for this model"
        )


# --------------------------------------------------------------------------------------------------- model card
# Base models known under a local name (hf_specdec.load_default_model() reads a GGUF file, so a head trained on it
# records the file's name): their Hub repo, for the card's front matter and usage lines.
KNOWN_BASE_MODELS = {
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SmolLM2-135M-Instruct-Q4_1": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
# Licenses of those base models: a head card takes its base model's license unless the facts name one.
KNOWN_LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0"}
_LOCAL_PATH = re.compile(r"(?:~|\.{0,2})?/(?:[\w.\-]+/)+([\w.\-]+)")


def hub_base_model(base: str | None) -> str | None:
    """The base model's Hub repo id (``owner/name``), or None when ``base`` names none (a local folder of an unknown
    model)."""
    if not base:
        return None
    name = os.path.basename(str(base).rstrip("/"))
    if name in KNOWN_BASE_MODELS:
        return KNOWN_BASE_MODELS[name]
    if HUB_ID.match(str(base)) and not os.path.exists(str(base)):
        return str(base)
    return None


def without_local_paths(text: str) -> str:
    """``text`` with every absolute or home-relative path replaced by its last component (a model card is public:
    ``/root/cache/SmolLM2-135M-Instruct-Q4_1`` becomes ``SmolLM2-135M-Instruct-Q4_1``)."""
    return _LOCAL_PATH.sub(lambda m: m.group(1), text)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render_model_card(
    *,
    head_type: str,
    title: str,
    config: Mapping,
    usage: str,
    description: str,
    tags: Iterable[str] = (),
    sections: Iterable[str] = (),
) -> ModelCard:
    """A README.md model card for a head folder.

    Facts come from ``config`` (``base_model_name_or_path``, ``hidden_size``, ``vocab_size``) and its
    ``model_card`` dict (``training_data``, ``tau``, ``speedup``, ``measured_on``, ``notes``, ``license``); a fact
    that was not recorded is shown as "not recorded", never invented. ``sections`` (markdown) follow the usage
    section.

    The front matter is the Hub's model-card metadata: ``license`` (the facts' own, else the base model's where it
    is known), ``base_model`` (a Hub id: a local name of a known model is mapped to its repo, a local folder is left
    out) with ``base_model_relation: adapter`` (a head is used together with its base model), ``library_name`` and
    ``tags``. No ``pipeline_tag``: a head does not generate text on its own, the base model does. Local paths in
    the facts are cut to their last component.
    """
    base = config.get("base_model_name_or_path")
    hub_base = hub_base_model(base)
    facts = {
        k: without_local_paths(v) if isinstance(v, str) else v for k, v in (config.get("model_card") or {}).items()
    }
    meta = ["---"]
    license_id = facts.get("license") or KNOWN_LICENSES.get(hub_base or "")
    if license_id:
        meta.append(f"license: {license_id}")
    if hub_base:
        meta += [f"base_model: {hub_base}", "base_model_relation: adapter"]
    meta.append(f"library_name: {LIBRARY_NAME}")
    meta.append("tags:")
    for tag in ["speculative-decoding", head_type, LIBRARY_NAME, *tags]:
        meta.append(f"- {tag}")
    meta.append("---")

    def fact(key: str, fmt=_fmt) -> str:
        return fmt(facts[key]) if facts.get(key) is not None else "not recorded"

    shown_base = hub_base or (os.path.basename(str(base).rstrip("/")) if base else None)
    rows = [
        ("Base model", f"`{shown_base}`" if shown_base else "not recorded"),
        ("Base hidden size", _fmt(config.get("hidden_size"))),
        (
            "Base vocabulary size",
            _fmt(config.get("vocab_size")) if config.get("vocab_size") else "any (uses the base lm_head)",
        ),
        ("Training data", fact("training_data")),
        ("Mean accepted length τ", fact("tau")),
        ("Speedup over vanilla `generate`", fact("speedup", lambda v: f"{_fmt(v)}×")),
        ("Measured on", fact("measured_on")),
    ]
    lines = [
        *meta,
        "",
        f"# {title}",
        "",
        description,
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "τ = 1 + accepted draft tokens / verification steps (the Spec-Bench / EAGLE convention); speedup = vanilla "
        "`generate` wall time / speculative wall time, same prompts, same machine.",
        "",
    ]
    if facts.get("notes"):
        lines += [str(facts["notes"]), ""]
    lines += [
        "## Usage",
        "",
        "```python",
        usage.strip(),
        "```",
        "",
        *[line for section in sections for line in (section.rstrip(), "")],
        f"Written by {LIBRARY_NAME} {config.get('hf_specdec_version', _library_version())}; "
        "`config.json` holds every hyper-parameter, `model.safetensors` the weights.",
        "",
    ]
    return ModelCard("\n".join(lines))


# --------------------------------------------------------------------------------------------------- head classes
class PretrainedHead(ModelHubMixin):
    """The Hub I/O every head class shares (mixed into an ``nn.Module`` next to `ModelHubMixin`'s class options).

    A head class provides ``head_type``, ``model_card`` / ``base_model_name_or_path`` attributes and:

    - ``_read_checkpoint(source, **options)`` (classmethod): ``(init kwargs, tensors, source format)`` read from a
      `HeadSource` in any layout it supports, shapes already checked;
    - ``config_dict()``: what our ``config.json`` holds; ``expected_shapes()``: the name and shape of every tensor
      our format saves;
    - ``_card_text(base, where)``: the model card's ``(title, description, import line, load expression)``;
    - ``check_compatible(model)``: refuse a target whose sizes differ (``bind`` may also remember parts of it).

    It gives the class ``from_pretrained``, ``save_pretrained``, ``push_to_hub`` and ``generate_model_card``.
    """

    head_type: str = ""
    export_formats: tuple[str, ...] = ("hf-specdec",)  # what `save_pretrained(format=...)` writes

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        base_model: torch.nn.Module | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
        **read_options,
    ):
        """Load the head from a local folder or a Hub repo id, in any published layout its class reads
        (docs/formats.md): build it without initialising weights, load the tensors strictly, cast / move it, put it
        in eval mode and bind it to ``base_model``.

        Args:
            pretrained_model_name_or_path: folder or repo id (e.g. ``"FasterDecoding/medusa-vicuna-7b-v1.3"``).
            base_model: the target model; when given, its sizes are checked and the head is bound to it.
            dtype / device: cast / move the head (default: the checkpoint's dtype, CPU).
            revision / token / cache_dir / local_files_only / force_download: Hub download options.
            read_options: options of the class's reader (`MedusaHeads`: ``num_heads``, keep only the first heads).
        Returns:
            the head in eval mode.
        """
        source = HeadSource(
            pretrained_model_name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            force_download=force_download,
        )
        init_kwargs, tensors, source_format = cls._read_checkpoint(source, **read_options)
        with torch.device("meta"):
            head = cls(**init_kwargs)
        head.load_state_dict(tensors, strict=True, assign=True)
        head.source, head.source_format = str(source), source_format
        head._place(dtype, device)
        head.eval()
        if base_model is not None:
            head.bind(base_model)
        return head

    def _place(self, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        """Cast / move a head just loaded (a class whose modules hold state the checkpoint lacks rebuilds it here)."""
        if dtype is not None:
            self.to(dtype=dtype)
        if device is not None:
            self.to(device=device)

    def bind(self, model: torch.nn.Module):
        """Check ``model`` (`check_compatible`); returns self."""
        self.check_compatible(model)
        return self

    def save_pretrained(self, save_directory: str | os.PathLike, *, format: str | None = None, **kwargs):
        """Write the head to ``save_directory``: ``config.json``, ``model.safetensors`` and a ``README.md`` model card.

        Args:
            save_directory: the folder (created if needed).
            format: ``"hf-specdec"`` (our own format, the default) or another of the class's ``export_formats``
                (docs/formats.md): e.g. ``"speculators"`` (vLLM) and ``"eagle"`` (SGLang, upstream EAGLE) for
                `EagleHead`, ``"medusa"`` (vLLM's Medusa layout) for `MedusaHeads`. The model card then says how to
                serve the folder in vLLM and SGLang. A head the format cannot express is refused before anything is
                written.
            kwargs: `huggingface_hub.ModelHubMixin.save_pretrained`'s options (``push_to_hub``, ``repo_id``,
                ``model_card_kwargs``).
        """
        with self._saving_as(format):
            return super().save_pretrained(save_directory, **kwargs)

    def export_checkpoint(self, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json, tensors)`` of the head in export format ``fmt`` (a class with ``export_formats`` beyond
        ours overrides this)."""
        raise ValueError(f"{type(self).__name__} saves the formats {list(self.export_formats)}, not {fmt!r}")

    @contextlib.contextmanager
    def _saving_as(self, fmt: str | None):
        """Within: the format `_save_pretrained` writes and the model card describes (``None``: the one already set
        by an enclosing call, else ours). The export is built (and refused) here, before any file is written."""
        before = self.__dict__.get("_saving")
        fmt = fmt or (before[0] if before else "hf-specdec")
        if fmt not in self.export_formats:
            raise ValueError(f"{type(self).__name__} saves the formats {list(self.export_formats)}, not {fmt!r}")
        self.__dict__["_saving"] = (fmt, None if fmt == "hf-specdec" else self.export_checkpoint(fmt))
        try:
            yield fmt
        finally:
            self.__dict__.pop("_saving")
            if before is not None:
                self.__dict__["_saving"] = before

    @property
    def _save_format(self) -> str:
        saving = self.__dict__.get("_saving")
        return saving[0] if saving else "hf-specdec"

    def _save_pretrained(self, save_directory: Path) -> None:
        save_directory = Path(save_directory)
        saving = self.__dict__.get("_saving")
        if saving is not None and saving[1] is not None:  # an export: its own config and tensor names
            config, state = saving[1]
        else:
            state, config = self.state_dict(), self.config_dict()
            expected = self.expected_shapes()
            if set(state) != set(expected):
                raise RuntimeError(
                    f"{type(self).__name__} would save {sorted(state)}, its format holds {sorted(expected)}"
                )
        save_tensors(state, save_directory / WEIGHTS_NAME)
        write_config({**config, "hf_specdec_version": _library_version()}, save_directory / CONFIG_NAME)
        # ModelHubMixin writes README.md only when absent: remove a stale card so it is regenerated
        (save_directory / CARD_NAME).unlink(missing_ok=True)

    def push_to_hub(self, repo_id: str, *, format: str | None = None, **kwargs) -> str:
        """Upload ``config.json``, ``model.safetensors`` and the model card to the Hub repo ``repo_id``, in
        ``format`` (see `save_pretrained`; default ours).

        Takes `huggingface_hub.ModelHubMixin.push_to_hub`'s options (``private``, ``token``, ``commit_message``,
        ``branch``, ``create_pr``, ``model_card_kwargs``, ...).
        """
        card_kwargs = {"repo_id": repo_id, **(kwargs.pop("model_card_kwargs", None) or {})}
        with self._saving_as(format):
            return super().push_to_hub(repo_id, model_card_kwargs=card_kwargs, **kwargs)

    def card_config(self) -> dict:
        """The config facts the model card shows (``hidden_size``: the base model's)."""
        return self.config_dict()

    def generate_model_card(self, repo_id: str | None = None, **facts) -> ModelCard:
        """The README.md model card; ``facts`` add to / override ``self.model_card`` (tau, speedup, ...)."""
        config = self.card_config()
        config["model_card"] = {**self.model_card, **facts}
        recorded = self.base_model_name_or_path
        name = os.path.basename(str(recorded).rstrip("/")) if recorded else "base-model"
        # the usage lines hold loadable Hub ids: the base model's repo (or a placeholder of that form) and the repo
        # the head is pushed to (without one: the id push_to_hub would be given, under a placeholder user)
        base = hub_base_model(recorded) or f"your-org/{name}"
        where = repo_id or f"your-username/{self.head_type}-{name}".lower().replace("_", "-")
        title, description, import_line, load = self._card_text(name, where)
        usage = f"""
import hf_specdec
{import_line}
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("{base}")
model = AutoModelForCausalLM.from_pretrained("{base}")
assistant = {load}
ids = tok("The capital of France is", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=128, do_sample=False, assistant=assistant)
print(tok.decode(out[0]))
"""
        return render_model_card(
            head_type=self.head_type,
            title=title,
            config=config,
            usage=usage,
            description=description,
            sections=serving_sections(self, self._save_format, where),
        )


def warn_config_mismatch(where: str, what: str, config_value, actual) -> None:
    warnings.warn(
        f"{where}: config.json says {what}={config_value} but the weights hold {actual}; using {actual} "
        "(the weights are authoritative)",
        stacklevel=3,
    )
