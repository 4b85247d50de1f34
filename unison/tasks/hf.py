"""Rows through Hugging Face ``datasets``: parquet (and any other format it reads), folders written by
``save_to_disk``, and Hub data set ids. ``datasets`` is imported only here, when such a source is used."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from unison.config import InvalidInputError, MissingInputError

_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise InvalidInputError(f"{what} needs the `datasets` package: `pip install datasets` (or give a .jsonl, "
                                ".json or .csv file)") from None
    return datasets


def read_local(path: Path, split: str | None) -> Iterable[dict]:
    """The rows of a data file in a format ``datasets`` reads, or of a ``save_to_disk`` folder (its ``split``, or
    its only one)."""
    datasets = _datasets(f"reading {path}")
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = _split(ds, split, str(path))
    else:
        fmt = _FORMATS.get(path.suffix)
        if fmt is None:
            raise InvalidInputError(f"{path}: unknown data file type {path.suffix!r}; give .jsonl, .json, .csv, "
                                    ".parquet or a `datasets` folder")
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    return iter(ds)


def read_hub(name: str, subset: str | None, split: str) -> Iterable[dict]:
    """The rows of split ``split`` of Hub data set ``name`` (configuration ``subset``)."""
    datasets = _datasets(f"data.source={name} (a Hub data set)")
    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except (FileNotFoundError, ConnectionError, OSError) as e:
        raise MissingInputError(f"data.source={name} is not a local file or folder, and the Hub data set could not "
                                f"be loaded ({type(e).__name__}: {str(e)[:300]})") from None
    except ValueError as e:  # an unknown split or configuration
        raise InvalidInputError(f"data.source={name}: {str(e)[:400]}") from None
    return iter(ds)


def _split(ds, split: str | None, where: str):
    if split in ds:
        return ds[split]
    if split is None or len(ds) == 1:
        return ds["train"] if "train" in ds else next(iter(ds.values()))
    raise InvalidInputError(f"{where} has no split {split!r}; it has {sorted(ds)}")


def split_names(path: Path) -> list[str]:
    """The splits of a ``save_to_disk`` folder ([] for a single Dataset or a file)."""
    if not path.is_dir():
        return []
    datasets = _datasets(f"reading {path}")
    ds = datasets.load_from_disk(str(path))
    return sorted(ds) if isinstance(ds, datasets.DatasetDict) else []
