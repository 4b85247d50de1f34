"""Checkpoints in Hugging Face format: what plain ``AutoModelForCausalLM.from_pretrained`` loads.

The live model runs with ``attn_implementation="unison"``, an implementation that exists only in a
process that imported ``unison.engine.attention``. The saved config must not ask a loader for it: a
checkpoint has to open in transformers, vLLM or an evaluation harness that has never heard of unison.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

from unison.config import MissingInputError
from unison.engine.attention import ATTN_NAME

# What a save killed midway leaves behind (unison.train.run_dir clears it): a trainer state's temporary file inside
# the checkpoint directory, and beside it `.NAME.tmp-*` (a checkpoint being written) and `.NAME.old-*` (the one it
# replaces, moved aside under SET_ASIDE until the new one is in place).
TRAINER_STATE_TMP_PREFIX = "tmp_trainer_state_"
SET_ASIDE = "ckpt"

# Keys under which some transformers versions write the attention implementation into config.json.
_ATTN_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


def save_hf_checkpoint(model: Any, tokenizer: Any | None, path: str, state_dict: dict | None = None) -> str:
    """Save ``model`` (safetensors, tied weights stored once) and ``tokenizer`` to the directory ``path``;
    ``state_dict`` replaces the model's own (a tensor-parallel model's weights, gathered whole).

    Atomic: everything is written to a temporary sibling directory that is renamed to ``path`` at the end,
    so ``path`` never holds half a checkpoint; an existing checkpoint there is replaced only once the new
    one is complete. Returns ``path``.
    """
    return _write_atomically(path, lambda tmp: _write_hf(model, tokenizer, tmp, state_dict))


def save_lora_checkpoint(model: Any, tokenizer: Any | None, path: str, lora: Any, base_model: str,
                         state_dict: dict | None = None) -> str:
    """Save a LoRA policy's adapters in PEFT's format (``PeftModel.from_pretrained(base, path)`` loads them; so does a
    resumed unison run) and its tokenizer into ``path``, atomically; with ``lora.save_merged`` also the weights merged
    into a plain HF folder, ``path/merged``. ``state_dict`` replaces the model's own (a tensor-parallel model's
    weights, gathered whole). Returns ``path``."""
    from unison.lora import merged_state_dict, save_adapter

    def write(tmp: str) -> None:
        save_adapter(model, lora, tmp, base_model, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if lora.save_merged:
            merged = os.path.join(tmp, "merged")
            os.makedirs(merged)
            _write_hf(model, tokenizer, merged, merged_state_dict(model, state_dict))
    return _write_atomically(path, write)


def _write_hf(model: Any, tokenizer: Any | None, folder: str, state_dict: dict | None) -> None:
    model.save_pretrained(folder, state_dict=state_dict)
    _drop_attn_implementation(os.path.join(folder, "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _write_atomically(path: str, write) -> str:
    """``write(tmp)`` into a temporary sibling directory of ``path``, renamed to ``path`` once complete."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)  # same filesystem: rename is atomic
    try:
        write(tmp)
        _permit_as_umask(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _drop_attn_implementation(config_path: str) -> None:
    """Remove a forced ``"unison"`` attention from config.json (and nested sub-configs): loaders pick
    their own default instead of failing on an unknown implementation."""
    with open(config_path) as f:
        config = json.load(f)
    if _scrub(config):
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def _scrub(node: Any) -> bool:
    changed = False
    if isinstance(node, dict):
        for key in _ATTN_KEYS:
            value = node.get(key)  # a str, or a per-sub-config dict of them
            if value == ATTN_NAME or (isinstance(value, dict) and ATTN_NAME in value.values()):
                del node[key]
                changed = True
        for value in node.values():
            changed |= _scrub(value)
    return changed


def _replace_dir(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``. A directory cannot be renamed over a non-empty one, so an old ``dst`` is
    first moved aside and deleted after: between the two renames ``dst`` is briefly absent, never partial."""
    if not os.path.exists(dst):
        os.rename(src, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
    os.rename(dst, os.path.join(old, SET_ASIDE))  # (a run killed here: unison.train.run_dir puts it back)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _permit_as_umask(path: str) -> None:
    """Give ``path`` (a directory or file) and what it holds the permissions a plain ``open``/``mkdir`` would: 0o777
    and 0o666 less the umask. mkdtemp and mkstemp make 0700 / 0600, and safetensors 0.8 writes its files 0600: a
    checkpoint others on the machine (an evaluation job, a teammate) could not read."""
    umask = _umask()
    if os.path.isfile(path):
        os.chmod(path, 0o666 & ~umask)
        return
    for root, _, files in os.walk(path):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read from /proc where Linux shows it: ``os.umask`` reads it only by setting it, which
    for a moment would give another thread's new files the wrong permissions."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def prune_checkpoints(output_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` ``checkpoint-N`` folders in ``output_dir`` (the final ``checkpoint`` is not
    one of them); returns the paths deleted, oldest first."""
    steps = sorted(int(m.group(1)) for m in map(re.compile(r"checkpoint-(\d+)$").match, os.listdir(output_dir))
                   if m and os.path.isdir(os.path.join(output_dir, m.group(0))))
    gone = [os.path.join(output_dir, f"checkpoint-{n}") for n in steps[:max(0, len(steps) - keep)]]
    for path in gone:
        shutil.rmtree(path)
        logging.getLogger(__name__).info("save_total_limit=%d: deleted %s", keep, path)
    return gone


def save_trainer_state(path: str, rank: int, state: dict) -> str:
    """Write one rank's trainer state (optimizer state, step, data order, RNGs) as ``trainer_state-rank{rank}.pt``
    in the checkpoint directory ``path``, atomically (a temporary file renamed into place)."""
    target = os.path.join(path, f"trainer_state-rank{rank}.pt")
    fd, tmp = tempfile.mkstemp(prefix=TRAINER_STATE_TMP_PREFIX, suffix=".pt", dir=path)
    os.close(fd)
    try:
        import torch

        torch.save(state, tmp)
        _permit_as_umask(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return target


def load_trainer_state(path: str, rank: int) -> dict:
    import torch

    target = os.path.join(path, f"trainer_state-rank{rank}.pt")
    if not os.path.isdir(path):
        raise MissingInputError(f"resume={path}: no such checkpoint directory")
    if not os.path.exists(target):
        raise MissingInputError(f"{path} has no trainer state for rank {rank} ({os.path.basename(target)}): resume "
                                "from a checkpoint `unison train` wrote, with the same number of replicas")
    return torch.load(target, map_location="cpu", weights_only=False)
