"""Loading a vision-language model's processor, where transformers needs a hand.

Without torchvision, transformers 5.24 cannot build the processors of Qwen2-VL / Qwen2.5-VL / Qwen3-VL / SmolVLM at
all: the video processor is absent (it needs torchvision), and ``ProcessorMixin`` then checks the missing argument
against ``VideoProcessorMixin``, a name that is only defined with torchvision, and fails with an AttributeError (with
torchvision, a processor built without a video processor fails the same check with a TypeError). unison takes images
only; it lets a missing (None) processor argument through that check and leaves it out when saving, and the image
processors (the PIL ones without torchvision) do the rest.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)
_patched = False


def allow_missing_video_processor() -> None:
    global _patched
    if _patched:
        return
    from transformers import processing_utils

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_present(self, argument_name, argument):
        return None if argument is None else check(self, argument_name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_present
    save = processing_utils.ProcessorMixin.save_pretrained

    def save_present(self, *args, **kwargs):  # ... and saving one iterates every attribute, the missing one too
        present = [a for a in type(self).get_attributes() if getattr(self, a, None) is not None]
        self.get_attributes = lambda: present
        try:
            return save(self, *args, **kwargs)
        finally:
            del self.get_attributes

    processing_utils.ProcessorMixin.save_pretrained = save_present
    _patched = True


def load_processor(folder: str, **kwargs):
    """A vision-language model's processor (its images' processing, chat template, tokenizer):
    ``AutoProcessor.from_pretrained(folder)``, or without torchvision, where that fails on the video processor, the
    processor class built from the folder's image processor, tokenizer, chat template and settings (its video
    processor left out)."""
    allow_missing_video_processor()
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, AttributeError, ImportError) as e:  # a video processor it cannot load
        log.info("%s: AutoProcessor failed (%s); building the processor for images alone", folder, e)
    settings = _settings(folder)
    name = settings.pop("processor_class", None) or AutoTokenizer.from_pretrained(folder, **kwargs).init_kwargs.get(
        "processor_class")
    cls = getattr(transformers, name or "", None)
    if cls is None:
        raise ValueError(f"{folder}: no processor class is named (processor_config.json's processor_class)")
    for key in ("image_processor", "video_processor", "auto_map", "chat_template"):
        settings.pop(key, None)
    template = Path(folder, "chat_template.jinja")
    parts = {"image_processor": AutoImageProcessor.from_pretrained(folder, **kwargs),
             "tokenizer": AutoTokenizer.from_pretrained(folder, **kwargs),
             "chat_template": template.read_text() if template.is_file() else None}
    if "video_processor" in inspect.signature(cls.__init__).parameters:
        parts["video_processor"] = None
    return cls(**parts, **settings)


def _settings(folder: str) -> dict:
    path = Path(folder, "processor_config.json")
    return json.loads(path.read_text()) if path.is_file() else {}
