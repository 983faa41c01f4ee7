"""manifest.json as a typed, versioned model: what a version holds, checked when read and when written.

:class:`IndexManifest` is the format's manifest (docs/index-format.md, "manifest.json"). Its fields are closed:
a key this reader does not know is refused with an error naming the key, as is a field of the wrong type or a
missing required one. The records that tools deliberately extend (``biases``, ``invgc``, ``ncl_stage1``,
``stage1``, ``psi_fold``, ``builder``, ``ann_params``, ``checkpoint.model_config``) are open JSON objects: each
is checked to be an object, and its own reader checks its content (``AnnParams.from_dict``,
``gare_index.psi_consts.fold_status``, ...).

On disk the manifest stays what the writer has always written (``json.dumps(..., indent=1, sort_keys=True)``
of exactly the keys given), so indexes written before this model open unchanged and a rewritten manifest is
byte-identical: :meth:`IndexManifest.to_json` dumps only the fields that were set, numbers keep their JSON
type (``4`` stays ``4``, ``4.0`` stays ``4.0``).

Reads in code use attributes (``m.n``, ``m.files["ann.faiss"].sha256``); ``m["n"]`` and ``m.get("n")`` also
work (read-only, for scripts written against the JSON).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gare_index.store.format import FORMAT, FORMAT_VERSION

Number = int | float  # smart union: a JSON int stays an int, a float a float (byte-compatible re-dumps)
Record = dict[str, Any]  # an open JSON object (a record the format lets tools extend)


class _Closed(BaseModel):
    """A closed JSON object: unknown keys and wrong types are refused; dict-style reads allowed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, protected_namespaces=(), populate_by_name=True)

    @classmethod
    def _attr(cls, key: object) -> str | None:
        """The attribute of JSON key `key` (its alias or its name), or None."""
        for name, f in cls.model_fields.items():
            if key == (f.alias or name):
                return name
        return None

    def __getitem__(self, key: str) -> Any:
        name = self._attr(key)
        if name is None or name not in self.model_fields_set:
            raise KeyError(key)
        return getattr(self, name)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        name = self._attr(key)
        return name is not None and name in self.model_fields_set

    def keys(self) -> list[str]:
        return [f.alias or k for k, f in type(self).model_fields.items() if k in self.model_fields_set]

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((k, self[k]) for k in self.keys())

    def to_dict(self) -> dict[str, Any]:
        """The JSON object this model was read from (only the keys that were set, nested models as dicts)."""
        return self.model_dump(mode="python", exclude_unset=True, by_alias=True)


class FileEntry(_Closed):
    """``files[name]``: every file of the version except the manifest, with its size, its sha256 (``gare-index
    verify``) and its fast hash (``"<scheme>:<hex>"``, gare_index.store.fast_hash: checked before a version is
    served; absent in versions written before it was recorded)."""

    bytes: int
    sha256: str
    fast_hash: str | None = None


class CheckpointRef(_Closed):
    """``checkpoint``: the checkpoint the index is bound to (``sha256`` must match the one served)."""

    path: str | None = None
    sha256: str | None = None
    # JSON key "model_config": BaseModel reserves that attribute name, so the field is declared under another
    # one with the key as its alias (validation, dumps and dict-style reads use the key)
    model_cfg: Record | None = Field(None, alias="model_config")


class Sampling(_Closed):
    """``sampling``: how the encoder sampled frames (the model's values)."""

    max_frames: int
    video_framerate: Number
    image_size: int


class Segment(_Closed):
    """``segment``: the windows of a ``--segment`` build (seconds)."""

    seconds: Number
    overlap: Number


class IndexManifest(_Closed):
    """manifest.json of one version (format ``gare-index``, format_version 1)."""

    format: Literal["gare-index"]
    format_version: Literal[1]
    version: int
    created: str  # ISO 8601 UTC
    checkpoint: CheckpointRef | None = None
    precision: str | None = None
    sampling: Sampling | None = None
    n: int
    dim: int
    max_frames: int
    frame_dtype: Literal["float16", "int8"]  # int8: frame_scales.npy too (gare_index.frame_quant)
    kv: bool
    index_type: str
    ann_params: Record
    index_type_requested: str | None = None
    ann_trained_n: int | None = None
    biases: Record
    segment: Segment | None = None
    next_id: int | None = None
    files: dict[str, FileEntry]
    invgc: Record | None = None
    ncl_stage1: Record | None = None
    stage1: Record | None = None
    builder: Record | None = None
    psi_fold: Record | None = None
    synthetic: bool | None = None  # a gallery written by a benchmark script, not from videos
    fields: dict[str, str] | None = None  # the library's own fields: name -> type (gare_index.fields)

    @property
    def checkpoint_sha256(self) -> str | None:
        return None if self.checkpoint is None else self.checkpoint.sha256

    def to_json(self) -> str:
        """The text of manifest.json (the set fields, sorted keys, indent 1: what the writer always wrote)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str)


assert IndexManifest.model_fields["format"].annotation == Literal[FORMAT]  # noqa: S101 (kept in step with .format)
assert IndexManifest.model_fields["format_version"].annotation == Literal[FORMAT_VERSION]  # noqa: S101


def describe_errors(e: ValidationError) -> str:
    """One line naming every bad field: ``n: Input should be a valid integer (got 'twelve'); frobnicate: unknown
    field``."""
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown field (not part of format_version {FORMAT_VERSION}; written by a newer "
                         "gare-index?)")
        elif err["type"] == "missing":
            parts.append(f"{where}: required field missing")
        else:
            parts.append(f"{where}: {err['msg']} (got {err.get('input')!r:.80})")
    return "; ".join(parts)


def parse_manifest(data: Mapping[str, Any]) -> IndexManifest:
    """Validate a decoded manifest.json (ValueError naming every bad field)."""
    try:
        return IndexManifest.model_validate(dict(data))
    except ValidationError as e:
        raise ValueError(describe_errors(e)) from None
